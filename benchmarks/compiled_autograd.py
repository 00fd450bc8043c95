"""Backward time under ``aotkit.compiled_autograd`` against eager backward.

Two models, one ``loss.backward()`` timed per call (the forward is run, untimed, before it):

- ``mlp``: ``aotkit.models.MLP`` (4 x Linear(256) + GELU), batch 32, MSE loss;
- ``transformer``: ``nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256,
  dropout=0.0, batch_first=True)`` on an (8, 16, 64) input, MSE loss.

Each runs under ``aotkit.compiled_autograd.enable(compiler_fn)`` with

- ``eager``: no compiled autograd (eager against eager: the noise floor);
- ``nop``: ``aotkit.compiled_autograd.nop``, the captured graph (lowered to ATen) run op by op
  from Python, its ATen calls bound to PyTorch's Python bindings;
- ``inductor``: ``torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False)``;
- ``pytorch_inductor``: PyTorch's own compiled autograd
  (``torch._dynamo.compiled_autograd._enable``) with the same Inductor compiler, for
  reference. The two implementations cannot share a process (each binds the engine's backward
  formulas to itself), so this row runs in a fresh process, warmed up the same way.

"first" is the first backward after ``aotkit.compiled_autograd.reset()`` (capture and compile
included); "steady" is the median of ``--steps`` backwards after ``--warmup``. Every compiled
backward is paired with an eager backward on an identical copy of the model (the two alternate
who goes first) and "vs eager" divides by the median of those, so both see the same load.
"capture" is first minus steady. ``.grad`` is set to ``None`` before every backward, eager and
compiled, so the engine sees one autograd-graph structure. Before timing, the first compiled
backward's gradients are checked against eager's (the script exits 1 if they differ); a compiler
that raises is reported in the table. Before measuring, compiled autograd and Inductor each run
once on a tiny program so one-time imports are charged to nobody; Inductor compiles into a fresh
cache directory unless ``--warm-inductor-cache``.

Run::

    .venv/bin/python benchmarks/compiled_autograd.py            # markdown table on stdout
    .venv/bin/python benchmarks/compiled_autograd.py --steps 500 --profile
    python benchmarks/compiled_autograd.py --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import json
import math
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import aotkit
from _timing import clock, describe_device, paired_medians
from aotkit.models import MLP, make_mlp_batch

NOP_TARGET = 1.1        # nop compiled backward / eager backward
INDUCTOR_TARGET = 1.0   # inductor compiled backward / eager backward, strictly below

LossFn = Callable[[nn.Module], torch.Tensor]


def inductor(gm: torch.fx.GraphModule) -> Callable[..., object]:
    return torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False)


COMPILERS: dict[str, Callable[[torch.fx.GraphModule], Callable[..., object]] | None] = {
    "eager": None, "nop": aotkit.compiled_autograd.nop, "inductor": inductor,
    "pytorch_inductor": inductor,
}


def enabler(compiler: str) -> Callable[..., contextlib.AbstractContextManager[None]]:
    """The ``enable`` that installs ``compiler``: PyTorch's for the ``pytorch_`` rows."""
    if compiler.startswith("pytorch_"):
        return torch._dynamo.compiled_autograd._enable
    return aotkit.compiled_autograd.enable


def make_mlp(device: str) -> tuple[nn.Module, LossFn]:
    x, target = (t.to(device) for t in make_mlp_batch(seed=0))
    return MLP.from_seed(0).to(device), lambda model: F.mse_loss(model(x), target)


def make_transformer(device: str) -> tuple[nn.Module, LossFn]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256,
                                           dropout=0.0, batch_first=True)
        x, target = torch.randn(8, 16, 64), torch.randn(8, 16, 64)
    x, target = x.to(device), target.to(device)
    return layer.to(device), lambda model: F.mse_loss(model(x), target)


MODELS: dict[str, Callable[[str], tuple[nn.Module, LossFn]]] = {
    "mlp": make_mlp, "transformer": make_transformer,
}


@dataclass
class Timing:
    model: str
    compiler: str
    first: float = math.nan
    steady: float = math.nan
    paired_eager: float = math.nan  # eager backwards interleaved with this compiler's
    captures: int = 0
    compiles: int = 0
    error: str | None = None
    detail: str = ""  # where the compiler failed, for the block under the table

    @property
    def vs_eager(self) -> float:
        return self.steady / self.paired_eager

    @property
    def capture(self) -> float:
        return self.first - self.steady


class GradientMismatch(Exception):
    pass


def make_backward(model: nn.Module, loss_fn: LossFn, compiler: str,
                  device: str = "cpu") -> Callable[[], float]:
    """A function that runs the forward, then times one backward (compiled unless eager) to
    the end of its kernels."""
    params = list(model.parameters())
    now = clock(device)
    compiler_fn, enable = COMPILERS[compiler], enabler(compiler)

    def backward() -> float:
        for p in params:
            p.grad = None
        loss = loss_fn(model)
        if compiler_fn is None:
            start = now()
            loss.backward()
            return now() - start
        with enable(compiler_fn):
            start = now()
            loss.backward()
            return now() - start

    return backward


def reset_all() -> None:
    aotkit.compiled_autograd.reset()
    torch._dynamo.compiled_autograd.reset()
    torch._dynamo.reset()
    aotkit.counters.reset()


def check_grads(name: str, model: nn.Module, reference: nn.Module) -> None:
    pairs = zip(model.named_parameters(), reference.parameters(), strict=True)
    for (param_name, p), ref in pairs:
        try:
            torch.testing.assert_close(p.grad, ref.grad)
        except AssertionError as exc:
            raise GradientMismatch(f"{name}: gradient of {param_name} differs from eager:\n"
                                   f"{exc}") from exc


def describe(exc: BaseException) -> tuple[str, str]:
    """A table cell (type and first line of the message) and a few lines saying where."""
    lines = [line.rstrip() for line in str(exc).splitlines() if line.strip(" ^")]
    cell = f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"
    where = next((i for i, line in enumerate(lines) if line.startswith("from user code")), None)
    detail = lines[1:2] + (lines[where:where + 5] if where is not None else [])
    return cell, "\n".join(detail)


def measure(model_name: str, compiler: str, steps: int, warmup: int,
            device: str = "cpu") -> Timing:
    """First backward, gradient check, then ``steps`` backwards interleaved with eager's."""
    reset_all()
    model, loss_fn = MODELS[model_name](device)
    reference = copy.deepcopy(model)
    timing = Timing(model_name, compiler)
    backward = make_backward(model, loss_fn, compiler, device)
    eager_backward = make_backward(reference, loss_fn, "eager", device)
    try:
        timing.first = backward()
    except Exception as exc:  # a compiler that cannot handle the graph is a result, not a crash
        timing.error, timing.detail = describe(exc)
        reset_all()
        return timing
    eager_backward()
    check_grads(f"{model_name}/{compiler}", model, reference)
    timing.steady, timing.paired_eager = paired_medians(backward, eager_backward, warmup, steps)
    stats = (torch._dynamo.utils.counters if compiler.startswith("pytorch_")
             else aotkit.counters.counters)["compiled_autograd"]
    timing.captures, timing.compiles = stats["captures"], stats["compiles"]
    reset_all()
    return timing


def measure_in_fresh_process(model_name: str, compiler: str, steps: int, warmup: int,
                             device: str) -> Timing:
    """``measure`` in a new Python process: PyTorch's compiled autograd row."""
    code = ("import sys, json, dataclasses; sys.path.insert(0, sys.argv[1]); "
            "import compiled_autograd as b; "
            f"b.warm_up_machinery({device!r}, {compiler!r}); "
            f"t = b.measure({model_name!r}, {compiler!r}, {steps}, {warmup}, {device!r}); "
            "print(json.dumps(dataclasses.asdict(t)))")
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise GradientMismatch(f"{model_name}/{compiler} in a fresh process:\n{proc.stderr}")
    return Timing(**json.loads(proc.stdout.strip().splitlines()[-1]))


def warm_up_machinery(device: str, compiler: str = "nop") -> None:
    """Compiled autograd (aotkit's, or PyTorch's for a ``pytorch_`` compiler) on a tiny Linear,
    and one tiny Inductor compile (imports, C++ headers)."""
    layer = nn.Linear(4, 4).to(device)
    nop = (lambda gm: gm) if compiler.startswith("pytorch_") else aotkit.compiled_autograd.nop
    with enabler(compiler)(nop):
        layer(torch.randn(2, 4, device=device)).sum().backward()
    torch.compile(lambda x: torch.sin(x) + 1, backend="inductor",
                  fullgraph=True)(torch.randn(4, device=device))
    reset_all()


def profile_nop(model_name: str, calls: int, top: int = 15) -> str:
    """cProfile of ``calls`` steady nop-compiled backwards (the forward runs outside)."""
    reset_all()
    model, loss_fn = MODELS[model_name]("cpu")
    params = list(model.parameters())
    profiler = cProfile.Profile()
    with aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):
        for i in range(calls + 5):
            for p in params:
                p.grad = None
            loss = loss_fn(model)
            if i < 5:
                loss.backward()
                continue
            profiler.enable()
            loss.backward()
            profiler.disable()
    reset_all()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.3f}"


def table(timings: list[Timing]) -> str:
    header = ("| model | compiler | eager backward (ms) | compiled backward (ms) | vs eager | "
              "first backward (ms) | capture: first - steady (ms) | captures | compiles |")
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for t in timings:
        if t.error is not None:
            cell = t.error.replace("|", "\\|")
            rows.append(f"| {t.model} | {t.compiler} | failed: {cell} | - | - | - | - | - | - |")
            continue
        rows.append(f"| {t.model} | {t.compiler} | {ms(t.paired_eager)} | {ms(t.steady)} | "
                    f"{t.vs_eager:.3f}x | {ms(t.first)} | {ms(t.capture)} | {t.captures} | "
                    f"{t.compiles} |")
    return "\n".join(rows)


def verdict(t: Timing | None, target: float, strict: bool) -> str:
    if t is None:
        return "not run"
    if t.error is not None:
        return "MISSED (the compiler failed, see the table)"
    met = t.vs_eager < target if strict else t.vs_eager <= target
    return f"{t.vs_eager:.3f}x: {'met' if met else 'MISSED'}"


def verdicts(timings: list[Timing], models: list[str]) -> list[str]:
    by = {(t.model, t.compiler): t for t in timings}
    return [f"- {m}: nop {verdict(by.get((m, 'nop')), NOP_TARGET, strict=False)}; inductor "
            f"{verdict(by.get((m, 'inductor')), INDUCTOR_TARGET, strict=True)}" for m in models]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="backwards to take the median of")
    parser.add_argument("--warmup", type=int, default=10, help="backwards before timing")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for all")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--compilers", nargs="+", choices=list(COMPILERS), default=list(COMPILERS))
    parser.add_argument("--device", default="cpu", help="where models and batches live")
    parser.add_argument("--warm-inductor-cache", action="store_true",
                        help="use Inductor's usual on-disk cache instead of a fresh one")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of the nop replay for each model")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    # Dynamo warns once per untraceable builtin; the failure is reported under the table.
    warnings.filterwarnings("ignore", message="Dynamo does not know how to trace")
    cache_dir = None
    if not args.warm_inductor_cache:
        cache_dir = tempfile.mkdtemp(prefix="aotkit-bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        warm_up_machinery(args.device)
        timings = [(measure_in_fresh_process if c.startswith("pytorch_") else measure)(
            m, c, args.steps, args.warmup, args.device)
            for m in args.models for c in args.compilers]
    except GradientMismatch as exc:
        print(f"compiled gradients differ from eager; stopped before timing them.\n{exc}", file=sys.stderr)
        return 1
    finally:
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)

    print(f"torch {torch.__version__}, {describe_device(args.device)}, {args.threads} thread(s), {os.cpu_count()} CPU(s); "
          f"backward only (forward untimed); steady = median of {args.steps} backwards after "
          f"{args.warmup} warm-up ones, each paired with an eager backward on a copy whose "
          f"median is the 'vs eager' reference; Inductor cache: "
          f"{'warm' if args.warm_inductor_cache else 'fresh'}\n")
    print(table(timings))
    print(f"\nTargets: nop compiler within {NOP_TARGET}x of eager backward; "
          "Inductor faster than eager")
    print("\n".join(verdicts(timings, args.models)))
    for t in timings:
        if t.error is not None:
            print(f"\n{t.model}/{t.compiler} failed: {t.error}\n{t.detail}")
    if args.profile:
        for m in args.models:
            print(f"\ncProfile of 200 nop replays, {m} (tottime):\n{profile_nop(m, 200)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
