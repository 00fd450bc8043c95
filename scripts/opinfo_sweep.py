"""OpInfo sweep: every sample of every float32/autograd OpInfo through aotkit's ``aot_function``.

Writes a markdown table (op, samples passed/total, first error) and checks the rule behind
``tests/aot/opinfo_expectations.py``: an op listed in EXPECTED_FAILURES must also fail with
PyTorch's own ``aot_function``. Exits 1 when one does not.

With ``--compiled-autograd`` each sample's forward runs eagerly and its backward under aotkit's
compiled autograd (nop compiler): input gradients must equal eager's bit for bit (close, for
COMPILED_AUTOGRAD_NOT_BIT_EXACT); failing samples are also run under PyTorch's compiled autograd.

``--dtype`` (float64, complex64, bfloat16, ...) and ``--noncontiguous`` sweep other samples than
float32 contiguous ones (gradients where the op differentiates the dtype). The lists are about
float32, so such a sweep reports every failing op with PyTorch's result; ``--strict`` exits 1
when PyTorch passes a sample aotkit fails.

    .venv/bin/python scripts/opinfo_sweep.py --max-samples 1 --out /tmp/x.md
    .venv/bin/python scripts/opinfo_sweep.py --partition min_cut   # docs/opinfo_sweep_min_cut.md
    .venv/bin/python scripts/opinfo_sweep.py --compiled-autograd   # docs/opinfo_sweep_compiled_autograd.md
    .venv/bin/python scripts/opinfo_sweep.py --dtype complex64     # docs/opinfo_sweep_complex64.md
    .venv/bin/python scripts/opinfo_sweep.py --dynamic             # docs/opinfo_sweep_dynamic.md
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import aotkit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "aot"))

import opinfo_harness as harness  # noqa: E402
from opinfo_expectations import (  # noqa: E402
    AOTKIT_BUGS,
    COMPILED_AUTOGRAD_NOT_BIT_EXACT,
    EXPECTED_FAILURES,
    SKIP,
)


@dataclass
class OpResult:
    name: str
    passed: int = 0
    total: int = 0
    eager_fails: int = 0
    first_error: str = ""
    failing: list[Any] = field(default_factory=list)  # samples aotkit fails, for the reference
    pytorch_checked: int = 0  # failing samples also run through PyTorch's aot_function
    pytorch_passes: int = 0  # ... and how many of those it passes
    pytorch_error: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> int:
        return self.total - self.passed


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:240]


Check = Callable[[Any, Any], None]  # (op, sample) -> None, or raises


def aot_check(compile_fn: Any) -> Check:
    return lambda op, sample: harness.check_sample(op, sample, compile_fn)


def compiled_autograd_check(enable: Any) -> Check:
    return lambda op, sample: harness.check_backward_sample(
        op, sample, enable, exact=op.full_name not in COMPILED_AUTOGRAD_NOT_BIT_EXACT)


def shared_check(compile_fn: Any) -> Check:
    """Check every sample of an op through one compiled function (new for each op), so that
    samples of other sizes also check the shape guards of the entries earlier samples made."""
    compiled: dict[str, Any] = {}

    def check(op: Any, sample: Any) -> None:
        if op.full_name not in compiled:
            compiled.clear()
            compiled[op.full_name] = compile_fn(op.op)
        with aotkit.config.patch(recompile_limit=10_000):  # samples vary in structure too
            harness.check_sample(op, sample, lambda _: compiled[op.full_name])

    return check


CHECKS = {"default": aot_check(harness.aotkit_compile),
          "min_cut": aot_check(harness.aotkit_min_cut_compile),
          "dynamic": shared_check(harness.aotkit_dynamic_compile),
          "compiled_autograd": compiled_autograd_check(harness.aotkit_compiled_autograd)}
REFERENCES = {"default": aot_check(harness.pytorch_compile),
              "min_cut": aot_check(harness.pytorch_compile),
              "dynamic": aot_check(functools.partial(harness.pytorch_compile, dynamic=True)),
              "compiled_autograd": compiled_autograd_check(harness.pytorch_compiled_autograd)}


@dataclass(frozen=True)
class Samples:
    """Which samples a sweep takes: float32 contiguous ones unless asked otherwise."""

    max_samples: int | None = None
    dtype: torch.dtype = torch.float32
    noncontiguous: bool = False

    @property
    def is_variant(self) -> bool:
        """Other samples than those the expectation lists are about."""
        return self.dtype is not torch.float32 or self.noncontiguous

    def describe(self) -> str:
        kind = f"{str(self.dtype).removeprefix('torch.')}{', non-contiguous' if self.noncontiguous else ''}"
        count = "all" if self.max_samples is None else self.max_samples
        return f"{kind} samples, per op: {count}"


def sweep_op(op: Any, taken: Samples, check: Check = CHECKS["default"]) -> OpResult:
    result = OpResult(op.full_name)
    start = time.perf_counter()
    try:
        for sample in harness.samples(op, taken.max_samples, taken.dtype, taken.noncontiguous):
            try:
                check(op, sample)
            except harness.EagerError:
                result.eager_fails += 1
                continue
            except Exception as exc:
                result.failing.append(sample)
                result.first_error = result.first_error or describe(exc)
            else:
                result.passed += 1
            result.total += 1
    except Exception as exc:  # the sample generator itself
        result.first_error = result.first_error or f"generating samples: {describe(exc)}"
    result.seconds = time.perf_counter() - start
    return result


def check_reference(op: Any, result: OpResult, limit: int | None,
                    reference: Check = REFERENCES["default"]) -> None:
    """Run PyTorch's counterpart on (the first ``limit`` of) the samples aotkit fails."""
    for sample in result.failing[:limit]:
        result.pytorch_checked += 1
        try:
            reference(op, sample)
        except Exception as exc:
            result.pytorch_error = result.pytorch_error or describe(exc)
        else:
            result.pytorch_passes += 1


def listed_as(name: str) -> str:
    if name in SKIP:
        return "skip"
    if name in EXPECTED_FAILURES:
        return "expected failure"
    if name in AOTKIT_BUGS:
        return "aotkit bug"
    return ""


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("`", "'")


def reference_cell(r: OpResult) -> str:
    if not r.pytorch_checked:
        return ""
    return f"passes {r.pytorch_passes}/{r.pytorch_checked}"


TITLES = {  # mode -> (what is checked, PyTorch's counterpart)
    "default": ("aotkit.aot_function(op, nop) against eager (default partition)",
                "torch._functorch.aot_autograd.aot_function"),
    "min_cut": ("aotkit.aot_function(op, nop) against eager (min_cut partition)",
                "torch._functorch.aot_autograd.aot_function"),
    "dynamic": ("aotkit.aot_function(op, nop, dynamic=True) against eager, one compiled "
                "function per op",
                "torch._functorch.aot_autograd.aot_function(dynamic=True)"),
    "compiled_autograd": ("the backward under aotkit.compiled_autograd.enable(nop) against "
                          "eager, bit for bit",
                          "torch._dynamo.compiled_autograd (its graph run as captured)"),
}


def write_table(results: list[OpResult], path: Path, taken: Samples, mode: str,
                command: list[str]) -> None:
    passed_ops = sum(1 for r in results if r.total and not r.failed)
    what, reference = TITLES[mode]
    lines = [
        f"# OpInfo sweep: {what}",
        "",
        f"Generated by `{shlex.join(['scripts/opinfo_sweep.py', *command])}` "
        f"({taken.describe()}). {len(results)} ops, "
        f"{passed_ops} pass every sample. 'PyTorch' is {reference} on the samples aotkit fails.",
        "",
        "| op | passed/total | listed as | PyTorch | first error |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        listed = listed_as(r.name) if mode in ("default", "min_cut") and not taken.is_variant \
            else ""
        lines.append(f"| {r.name} | {r.passed}/{r.total} | {listed} | "
                     f"{reference_cell(r)} | {cell(r.first_error)} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


@dataclass
class Verdicts:
    """The sweep's conclusions; ``bad`` breaks the rule, the others are news for the lists."""

    bad: list[str]  # EXPECTED_FAILURES that PyTorch's aot_function passes on some failing sample
    bugs: list[str]  # AOTKIT_BUGS still failing
    bugs_pytorch_fails: list[str]  # AOTKIT_BUGS where PyTorch fails every checked sample too
    stale: list[str]  # listed ops passing every sample
    unlisted: list[str]  # failing ops in neither list


def judge(results: list[OpResult], lists_apply: bool) -> Verdicts:
    """The verdicts on the lists of ``opinfo_expectations.py``, which are about ``aot_function``
    on float32 samples; elsewhere (compiled autograd, other samples) every failing op is
    unlisted."""
    ran = {r.name: r for r in results}
    if not lists_apply:
        return Verdicts([], [], [], [], sorted(r.name for r in results if r.failed))

    def failing(names: Any) -> list[str]:
        return sorted(n for n in names if n in ran and ran[n].failed)

    listed = {*EXPECTED_FAILURES, *AOTKIT_BUGS}
    return Verdicts(
        bad=[n for n in failing(EXPECTED_FAILURES) if ran[n].pytorch_passes],
        bugs=failing(AOTKIT_BUGS),
        bugs_pytorch_fails=[n for n in failing(AOTKIT_BUGS) if not ran[n].pytorch_passes],
        stale=sorted(n for n in listed if n in ran and ran[n].total and not ran[n].failed),
        unlisted=failing(r.name for r in results if r.name not in listed),
    )


def _print_failures(ran: dict[str, OpResult], names: list[str]) -> None:
    for name in names:
        r = ran[name]
        print(f"  {name}: {r.failed}/{r.total} samples fail; PyTorch {reference_cell(r)}; "
              f"{r.first_error}")


def report(results: list[OpResult], v: Verdicts, lists_apply: bool) -> None:
    ran = {r.name: r for r in results}
    clean = sum(1 for r in results if r.total and not r.failed)
    print(f"ops: {len(results)}, passing every sample: {clean}, skipped: {sorted(SKIP)}")
    if not lists_apply:
        print(f"failing ops: {v.unlisted}")
        _print_failures(ran, v.unlisted)
        return
    print(f"aotkit bugs (PyTorch's aot_function passes), still failing: {v.bugs}")
    _print_failures(ran, v.bugs)
    print(f"aotkit bugs that PyTorch's aot_function fails too (move to EXPECTED_FAILURES): "
          f"{v.bugs_pytorch_fails}")
    print(f"listed ops that pass every sample run (remove them from the lists): {v.stale}")
    print(f"failing ops in neither list: {v.unlisted}")
    _print_failures(ran, v.unlisted)
    eager = sorted(r.name for r in results if r.eager_fails)
    print(f"ops with samples that fail in eager (not counted): {eager}")
    print(f"expected failures that PyTorch's aot_function passes: {v.bad}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-samples", type=int, default=None,
                        help="samples per op (default: all)")
    parser.add_argument("--partition", choices=["default", "min_cut"], default="default",
                        help="the partitioner aotkit uses (default: default)")
    parser.add_argument("--compiled-autograd", action="store_true",
                        help="check backwards under aotkit's compiled autograd instead")
    parser.add_argument("--dynamic", action="store_true",
                        help="trace with dynamic=True, each op's samples through one compiled "
                             "function")
    parser.add_argument("--out", type=Path, default=None,
                        help="markdown table to write (default: docs/opinfo_sweep.md, "
                             "docs/opinfo_sweep_min_cut.md for --partition min_cut, "
                             "docs/opinfo_sweep_compiled_autograd.md for --compiled-autograd)")
    parser.add_argument("--dtype", default="float32",
                        help="the samples' dtype, e.g. float64, complex64 (default: float32)")
    parser.add_argument("--noncontiguous", action="store_true",
                        help="make every sample's tensors non-contiguous")
    parser.add_argument("--ops", nargs="*", default=None,
                        help="only these ops (full names such as max.reduction_with_dim)")
    parser.add_argument("--max-reference-samples", type=int, default=10,
                        help="per failing op, how many of its failing samples to run through "
                             "PyTorch's counterpart (default: 10; 0 for all)")
    parser.add_argument("--strict", action="store_true",
                        help="also exit 1 on unlisted failures and on listed ops that pass "
                             "(with --dtype/--noncontiguous: on samples only PyTorch passes)")
    args = parser.parse_args(argv)
    if args.dynamic and (args.compiled_autograd or args.partition != "default"):
        parser.error("--dynamic goes with the default partition and without --compiled-autograd")
    mode = "compiled_autograd" if args.compiled_autograd else "dynamic" if args.dynamic \
        else args.partition
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        parser.error(f"--dtype {args.dtype}: not a torch dtype")
    taken = Samples(args.max_samples, dtype, args.noncontiguous)
    if args.out is None:
        stem = "opinfo_sweep" + ("" if mode == "default" else f"_{mode}") + (
            "" if dtype is torch.float32 else f"_{args.dtype}") + (
            "_noncontiguous" if args.noncontiguous else "")
        args.out = ROOT / "docs" / f"{stem}.md"
    warnings.filterwarnings("ignore")

    ops = [op for op in harness.supported_ops(dtype) if op.full_name not in SKIP]
    if args.ops is not None:
        ops = [op for op in ops if op.full_name in set(args.ops)]
    results = []
    for op in ops:
        result = sweep_op(op, taken, CHECKS[mode])
        if result.failed:
            check_reference(op, result, args.max_reference_samples or None, REFERENCES[mode])
        result.failing.clear()
        results.append(result)
        print(f"{result.name}: {result.passed}/{result.total} ({result.seconds:.1f}s)"
              + (f"  {result.first_error}" if result.failed else ""), flush=True)
    write_table(results, args.out, taken, mode, sys.argv[1:] if argv is None else argv)
    print(f"wrote {args.out}")
    lists_apply = mode in ("default", "min_cut") and not taken.is_variant
    verdicts = judge(results, lists_apply)
    report(results, verdicts, lists_apply)
    if not lists_apply:
        only_pytorch = [r.name for r in results if r.failed and r.pytorch_passes]
        print(f"ops with samples PyTorch passes and aotkit fails: {only_pytorch}")
        return 1 if args.strict and only_pytorch else 0
    if verdicts.bad or (args.strict and (verdicts.unlisted or verdicts.stale)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
