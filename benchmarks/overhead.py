"""First-call and steady-step overhead of aotkit against eager PyTorch and ``aot_eager``.

For the MLP (4 x Linear(256) + GELU, batch 32) and the TinyTransformer, one training step
(forward + backward + optimizer step) is timed for each variant:

- ``eager``: the plain module;
- ``aotkit``: ``torch.compile(model, backend="aotkit")``;
- ``aot_eager``: ``torch.compile(model, backend="aot_eager")`` (PyTorch's own AOT autograd);
- ``aot_module``: ``aotkit.aot_module(model, aotkit.compilers.nop)`` (no Dynamo);
- ``dynamo``: ``torch.compile(model, backend="eager")``, Dynamo's share of both compiled variants.

"first call" is the first step (it includes capturing and compiling); "steady" is the median of
``--steps`` steps after ``--warmup`` steps. Ratios are measured in the same run: first call
against ``aot_eager``'s, steady step against eager's. Before measuring, Dynamo, aotkit and
``aot_eager`` each compile a tiny function once, so one-time imports are charged to nobody.
With ``--cold`` each compiled variant's first call is also measured in a fresh process.

Run::

    .venv/bin/python benchmarks/overhead.py            # markdown table on stdout
    .venv/bin/python benchmarks/overhead.py --cold --steps 100
    python benchmarks/overhead.py --device cuda --variants eager aotkit aot_eager inductor aotkit_inductor
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import aotkit
from _timing import clock, describe_device, paired_medians
from aotkit.models import MLP, TinyTransformer, make_mlp_batch, make_token_batch

FIRST_CALL_TARGET = 0.3   # aotkit first call / aot_eager first call
STEADY_TARGET = 1.05      # aotkit steady step / eager steady step

VARIANTS = ("eager", "dynamo", "aotkit", "aot_eager", "aot_module")
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., tuple[torch.Tensor, torch.Tensor]]]] = {
    "mlp": (MLP.from_seed, make_mlp_batch),
    "transformer": (TinyTransformer.from_seed, make_token_batch),
}


@dataclass
class Timing:
    model: str
    variant: str
    first: float
    steady: float
    paired_eager: float  # eager steps interleaved with this variant's steady steps
    traces: int = 0

    @property
    def steady_vs_eager(self) -> float:
        return self.steady / self.paired_eager


def wrap(model: nn.Module, variant: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The callable a variant trains through; any other name is a ``torch.compile`` backend
    (``aotkit``, ``aot_eager``, ``inductor``, ``aotkit_inductor``, ...)."""
    if variant == "eager":
        return model
    if variant == "dynamo":  # Dynamo alone: its graph runs eagerly, no AOT autograd
        return torch.compile(model, backend="eager")
    if variant == "aot_module":
        return aotkit.aot_module(model, aotkit.compilers.nop)
    return torch.compile(model, backend=variant)


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())
    return nn.functional.mse_loss(out, target)


def make_step(model_name: str, variant: str, device: str = "cpu") -> Callable[[], float]:
    """A fresh model on ``device`` wrapped for ``variant``; the returned function trains one
    step and returns its time (forward + backward + SGD step, kernels finished)."""
    make_model, make_batch = MODELS[model_name]
    model = make_model().to(device)
    run = wrap(model, variant)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, target = (t.to(device) for t in make_batch(seed=0))
    now = clock(device)

    def step() -> float:
        start = now()
        loss = loss_of(run(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return now() - start

    return step


def measure(model_name: str, variant: str, steps: int, warmup: int, repeats: int = 1,
            device: str = "cpu") -> Timing:
    """Time one variant's first step (median over ``repeats`` fresh models, Dynamo and aotkit
    reset before each), then the median of ``steps`` steps after ``warmup``, interleaved step
    by step with an eager copy of the model so that both see the same machine load."""
    firsts = []
    for _ in range(max(repeats, 1)):
        torch._dynamo.reset()
        aotkit.counters.reset()
        torch.manual_seed(0)
        step = make_step(model_name, variant, device)
        firsts.append(step())
    first = statistics.median(firsts)
    eager_step = make_step(model_name, "eager", device)
    steady, paired_eager = paired_medians(step, eager_step, warmup, steps)
    traces = aotkit.counters.counters["aot"]["traces"]
    return Timing(model_name, variant, first, steady, paired_eager, traces)


def warm_up_machinery(variants: list[str], device: str) -> None:
    """Compile a tiny training step with each backend once (imports, lazy tables, Dynamo)."""
    for variant in variants:
        torch._dynamo.reset()
        run = wrap(nn.Linear(4, 4).to(device), variant)
        run(torch.randn(2, 4, device=device)).sum().backward()
    torch._dynamo.reset()
    aotkit.counters.reset()


def cold_first_call(model_name: str, variant: str, threads: int, device: str) -> float:
    """First-step time of ``variant`` in a fresh Python process."""
    code = (
        "import sys, json, torch; sys.path.insert(0, sys.argv[1]); import overhead; "
        f"torch.set_num_threads({threads}); "
        f"print(json.dumps(overhead.measure({model_name!r}, {variant!r}, 1, 0, device={device!r}).first))"
    )
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True,
                          check=True, timeout=600)
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def table(timings: list[Timing], cold: dict[tuple[str, str], float]) -> str:
    by = {(t.model, t.variant): t for t in timings}
    header = "| model | variant | first call (s) | vs aot_eager | steady step (ms) | vs eager | aot traces |"
    if cold:
        header += " cold first call (s) | cold vs aot_eager |"
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for t in timings:
        ref = by.get((t.model, "aot_eager"))
        vs_ref = f"{t.first / ref.first:.2f}x" if ref else "-"
        row = (f"| {t.model} | {t.variant} | {t.first:.3f} | {vs_ref} | "
               f"{t.steady * 1e3:.3f} | {t.steady_vs_eager:.3f}x | {t.traces} |")
        if cold:
            c, ref = cold.get((t.model, t.variant)), cold.get((t.model, "aot_eager"))
            row += (f" {c:.3f} | {c / ref:.2f}x |" if c is not None and ref else " - | - |")
        rows.append(row)
    return "\n".join(rows)


def verdicts(timings: list[Timing], cold: dict[tuple[str, str], float]) -> list[str]:
    by = {(t.model, t.variant): t for t in timings}
    lines = []
    for model in MODELS:
        if (model, "aotkit") not in by or (model, "aot_eager") not in by:
            continue
        aot = by[(model, "aotkit")]
        first = aot.first / by[(model, "aot_eager")].first
        steady = aot.steady_vs_eager
        dynamo = by[(model, "dynamo")].first if (model, "dynamo") in by else 0.0
        backend_only = (aot.first - dynamo) / (by[(model, "aot_eager")].first - dynamo)
        lines.append(
            f"- {model}: first call {first:.2f}x aot_eager (target <= {FIRST_CALL_TARGET}x: "
            f"{'met' if first <= FIRST_CALL_TARGET else 'MISSED'}); steady step {steady:.3f}x "
            f"eager (target <= {STEADY_TARGET}x: {'met' if steady <= STEADY_TARGET else 'MISSED'})"
            f"; backend alone (first call minus Dynamo's): {backend_only:.2f}x aot_eager's"
        )
        if (model, "aotkit") in cold and cold.get((model, "aot_eager")):
            ratio = cold[(model, "aotkit")] / cold[(model, "aot_eager")]
            lines.append(f"  cold process: first call {ratio:.2f}x aot_eager "
                         f"({'met' if ratio <= FIRST_CALL_TARGET else 'MISSED'})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="steady steps to take the median of")
    parser.add_argument("--warmup", type=int, default=5, help="steps between first call and timing")
    parser.add_argument("--repeats", type=int, default=3,
                        help="first calls (fresh model each) to take the median of")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for all")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        help="eager, dynamo, aot_module or any torch.compile backend name")
    parser.add_argument("--device", default="cpu", help="where models and batches live")
    parser.add_argument("--cold", action="store_true",
                        help="also time each compiled variant's first call in a fresh process")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if "eager" not in args.variants:
        args.variants.insert(0, "eager")
    warm_up_machinery([v for v in args.variants if v != "eager"], args.device)
    timings = [measure(m, v, args.steps, args.warmup, args.repeats, args.device)
               for m in args.models for v in args.variants]
    cold = {(m, v): cold_first_call(m, v, args.threads, args.device)
            for m in args.models for v in args.variants
            if args.cold and v not in ("eager", "dynamo")}

    print(f"torch {torch.__version__}, {describe_device(args.device)}, {args.threads} "
          f"thread(s), {os.cpu_count()} CPU(s); "
          f"step = forward + backward + SGD step; first call = median of {args.repeats} "
          f"(fresh model, Dynamo reset); steady = median of {args.steps} steps after "
          f"{args.warmup} warm-up steps, each followed by an eager step whose median is the "
          "'vs eager' reference\n")
    print(table(timings, cold))
    print("\nTargets (aotkit): first call <= "
          f"{FIRST_CALL_TARGET}x aot_eager, steady step <= {STEADY_TARGET}x eager")
    print("\n".join(verdicts(timings, cold)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
