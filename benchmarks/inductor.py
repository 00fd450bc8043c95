"""Training-step time of ``torch.compile(backend="aotkit_inductor")`` against PyTorch's own
``backend="inductor"`` and eager PyTorch.

For the MLP (4 x Linear(256) + GELU, batch 32) and the TinyTransformer from ``aotkit.models``,
one training step (forward + backward + SGD step) is timed for each variant:

- ``eager``: the plain module;
- ``inductor``: ``torch.compile(model, backend="inductor")`` (PyTorch's AOT autograd, min-cut
  partitioner and Inductor);
- ``aotkit_inductor``: ``torch.compile(model, backend="aotkit_inductor")`` (aotkit's AOT
  autograd and min-cut partitioner, Inductor as the code generator of each graph).

"first call" is the first step of a fresh model after ``torch._dynamo.reset()``, compiled into
a fresh Inductor cache (in-memory and on-disk) so that neither compiled variant reuses kernels
the other built. "steady" is the median of ``--steps`` steps after ``--warmup`` steps. The
compiled variants' steady steps are timed against each other, step by step in alternating
order (the ``vs inductor`` column and the target), and each against an eager copy of the model
(the ``vs eager`` column). Before measuring, both backends compile a tiny function once, so
one-time imports are charged to nobody.

Run::

    .venv/bin/python benchmarks/inductor.py              # markdown table on stdout
    .venv/bin/python benchmarks/inductor.py --steps 200 --models mlp
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch
from torch import nn
from torch._inductor.utils import fresh_cache

import aotkit
from _timing import describe_device, paired_medians
from overhead import MODELS, Timing, make_step

STEADY_TARGET = 1.0  # aotkit_inductor steady step / inductor steady step

VARIANTS = ("eager", "inductor", "aotkit_inductor")
Step = Callable[[], float]


def first_step(model_name: str, variant: str, repeats: int, device: str) -> tuple[float, Step]:
    """Median first-step time over ``repeats`` fresh models, each compiled into a fresh Inductor
    cache; returns it and the last model's step function (its graphs are compiled)."""
    firsts = []
    for _ in range(max(repeats, 1)):
        torch._dynamo.reset()
        aotkit.counters.reset()
        torch.manual_seed(0)
        with fresh_cache():
            step = make_step(model_name, variant, device)
            firsts.append(step())
    return statistics.median(firsts), step


def measure(model_name: str, steps: int, warmup: int, repeats: int,
            device: str = "cpu") -> tuple[list[Timing], float]:
    """Every variant's timing for one model, and the steady-step ratio aotkit_inductor /
    inductor taken with the two interleaved."""
    timings, compiled = [], {}
    for variant in VARIANTS:
        first, step = first_step(model_name, variant, repeats, device)
        steady, eager = paired_medians(step, make_step(model_name, "eager", device), warmup,
                                       steps)
        timings.append(Timing(model_name, variant, first, steady, eager))
        compiled[variant] = step
    ours, theirs = paired_medians(compiled["aotkit_inductor"], compiled["inductor"], warmup, steps)
    return timings, ours / theirs


def warm_up_machinery(device: str) -> None:
    """Compile a tiny training step with each backend once (imports, lazy tables, Dynamo)."""
    for variant in VARIANTS[1:]:
        torch._dynamo.reset()
        with fresh_cache():
            run = torch.compile(nn.Linear(4, 4).to(device), backend=variant)
            run(torch.randn(2, 4, device=device)).sum().backward()
    torch._dynamo.reset()
    aotkit.counters.reset()


def table(timings: list[Timing], ratios: dict[str, float]) -> str:
    by = {(t.model, t.variant): t for t in timings}
    rows = ["| model | variant | first call (s) | vs inductor | steady step (ms) | vs eager "
            "| steady vs inductor (interleaved) |", "|---|---|---|---|---|---|---|"]
    for t in timings:
        ref = by[(t.model, "inductor")]
        paired = f"{ratios[t.model]:.3f}x" if t.variant == "aotkit_inductor" else "-"
        rows.append(f"| {t.model} | {t.variant} | {t.first:.3f} | {t.first / ref.first:.2f}x | "
                    f"{t.steady * 1e3:.3f} | {t.steady_vs_eager:.3f}x | {paired} |")
    return "\n".join(rows)


def verdicts(ratios: dict[str, float]) -> list[str]:
    return [f"- {model}: aotkit_inductor steady step {ratio:.3f}x inductor's (target <= "
            f"{STEADY_TARGET}x: {'met' if ratio <= STEADY_TARGET else 'MISSED'})"
            for model, ratio in ratios.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steady steps to take the median of")
    parser.add_argument("--warmup", type=int, default=5, help="steps between first call and timing")
    parser.add_argument("--repeats", type=int, default=1,
                        help="first calls (fresh model and Inductor cache each) to take the median of")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for all")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--device", default="cpu", help="where models and batches live")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    warm_up_machinery(args.device)
    timings, ratios = [], {}
    for model in args.models:
        model_timings, ratios[model] = measure(model, args.steps, args.warmup, args.repeats,
                                               args.device)
        timings += model_timings

    print(f"torch {torch.__version__}, {describe_device(args.device)}, {args.threads} "
          f"thread(s), {os.cpu_count()} CPU(s); "
          f"step = forward + backward + SGD step; first call = median of {args.repeats} (fresh "
          f"model, Dynamo reset, fresh Inductor cache); steady = median of {args.steps} steps "
          f"after {args.warmup} warm-up steps, interleaved with an eager copy ('vs eager') and, "
          "for aotkit_inductor, with inductor ('steady vs inductor')\n")
    print(table(timings, ratios))
    print(f"\nTarget: aotkit_inductor steady step <= {STEADY_TARGET}x inductor's")
    print("\n".join(verdicts(ratios)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
