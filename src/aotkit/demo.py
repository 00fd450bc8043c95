"""``aotkit demo`` and ``aotkit graphs``: compile a real model, check it against eager, report.

The demo trains :class:`~aotkit.models.TinyTransformer` a few steps eagerly and through
``torch.compile(backend="aotkit")`` from the same seeds, compares every loss and gradient, and
reports compile time, step time against eager, the graphs aotkit captured and any recompiles::

    >>> from aotkit.demo import run_demo
    >>> report = run_demo(steps=4)  # doctest: +SKIP
    >>> report.ok, report.steady_ratio  # doctest: +SKIP
    (True, 1.02)
"""

from __future__ import annotations

import operator
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

import aotkit
from aotkit.models import MLP, TinyTransformer, TransformerConfig, make_mlp_batch, make_token_batch
from aotkit.partition import PartitionReport

__all__ = ["CapturedGraph", "DemoReport", "TrainRun", "Trainer", "capture_graphs", "run_demo", "train"]

Batch = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TrainRun:
    """Losses, per-step gradients (by parameter name) and step times of one training run."""

    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)

    @property
    def first_step(self) -> float:
        return self.step_times[0]

    @property
    def steady_step(self) -> float:
        """Median step time after the first step."""
        return statistics.median(self.step_times[1:] or self.step_times)


class Trainer:
    """Trains ``model`` (called as ``run``) with AdamW on token batches seeded ``0, 1, ...``.

    The trainer keeps its own copy of the global RNG state, started from
    ``torch.manual_seed(seed)``, and swaps it in for each step: two trainers can take turns
    (so that their step times see the same machine load) and still draw the dropout masks
    each would draw alone. A step's time covers forward, backward and the optimizer step.

    Example::

        >>> from aotkit.models import TinyTransformer
        >>> model = TinyTransformer.from_seed(0)
        >>> trainer = Trainer(model, model)
        >>> trainer.step(); trainer.step()
        >>> len(trainer.result.losses)
        2
    """

    def __init__(self, model: nn.Module, run: Callable[[torch.Tensor], torch.Tensor],
                 seed: int = 0, lr: float = 1e-2) -> None:
        self.model = model
        self.run = run
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.rng = torch.get_rng_state()
        self.result = TrainRun()

    def step(self) -> None:
        """Train one step on the next batch and record its loss, gradients and time."""
        index = len(self.result.losses)
        tokens, targets = make_token_batch(seed=index, cfg=getattr(self.model, "cfg", None))
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng)
            start = time.perf_counter()
            logits = self.run(tokens)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            elapsed = time.perf_counter() - start
            self.rng = torch.get_rng_state()
        self.result.step_times.append(elapsed)
        self.result.losses.append(loss.detach())
        self.result.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()
                                  if p.grad is not None})


def train(model: nn.Module, run: Callable[[torch.Tensor], torch.Tensor], steps: int,
          seed: int = 0, lr: float = 1e-2) -> TrainRun:
    """Train ``steps`` steps with a :class:`Trainer` and return what it recorded.

    Example::

        >>> from aotkit.models import TinyTransformer
        >>> model = TinyTransformer.from_seed(0)
        >>> result = train(model, model, steps=2)
        >>> len(result.losses), sorted(result.grads[0])[:1]
        (2, ['blocks.0.attn.in_proj_bias'])
    """
    trainer = Trainer(model, run, seed, lr)
    for _ in range(steps):
        trainer.step()
    return trainer.result


def compare(eager: TrainRun, compiled: TrainRun, limit: int = 5) -> list[str]:
    """Differences between two runs (at most ``limit``), each a readable line; empty if equal."""
    problems: list[str] = []
    for step, (want, got) in enumerate(zip(eager.losses, compiled.losses, strict=True)):
        if not torch.allclose(got, want, rtol=1.3e-6, atol=1e-5):
            problems.append(f"step {step}: loss {got.item():.6f}, eager {want.item():.6f}")
    for step, (want, got) in enumerate(zip(eager.grads, compiled.grads, strict=True)):
        for name in sorted(want.keys() | got.keys()):
            if name not in got or name not in want:
                problems.append(f"step {step}: grad of {name} exists in only one run")
                continue
            try:
                torch.testing.assert_close(got[name], want[name])
            except AssertionError:
                diff = (got[name] - want[name]).abs().max().item()
                problems.append(f"step {step}: grad of {name} differs (max abs diff {diff:.3g})")
    return problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])


@dataclass
class DemoReport:
    """What :func:`run_demo` found; ``str(report)`` is the text ``aotkit demo`` prints."""

    steps: int
    threads: int
    dropout: bool
    eager: TrainRun
    compiled: TrainRun | None
    counts: dict[str, int]
    recompiles: list[str]
    other_decisions: list[str]
    problems: list[str]
    partitions: dict[str, PartitionReport] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.compiled is not None and not self.problems

    @property
    def compile_time(self) -> float:
        assert self.compiled is not None
        return self.compiled.first_step - self.compiled.steady_step

    @property
    def steady_ratio(self) -> float:
        assert self.compiled is not None
        return self.compiled.steady_step / self.eager.steady_step

    def __str__(self) -> str:
        lines = [f"aotkit demo: TinyTransformer, {self.steps} AdamW steps "
                 f"{'with' if self.dropout else 'without'} dropout, "
                 f"torch {torch.__version__}, {self.threads} thread(s)"]
        if self.compiled is not None:
            ms = 1000.0
            lines += [
                f"  compile time:       {self.compile_time:.2f} s "
                f"(first step {self.compiled.first_step:.2f} s minus steady step)",
                f"  steady step:        {self.compiled.steady_step * ms:.2f} ms vs eager "
                f"{self.eager.steady_step * ms:.2f} ms ({self.steady_ratio:.2f}x eager)",
            ]
        c = self.counts
        lines.append(f"  graphs captured:    {c.get('traces', 0)} trace(s), "
                     f"{c.get('fw_compiles', 0)} forward, {c.get('bw_compiles', 0)} backward, "
                     f"{c.get('inference_compiles', 0)} inference compile(s)")
        lines.append(f"  recompiles:         {len(self.recompiles)}")
        lines += [f"    - {r}" for r in self.recompiles]
        if self.other_decisions:
            lines.append(f"  other decisions:    {len(self.other_decisions)}")
            lines += [f"    - {d}" for d in self.other_decisions]
        if len(self.partitions) == 2:
            default, min_cut = self.partitions["default"], self.partitions["min_cut"]
            ratio = min_cut.saved_bytes / max(default.saved_bytes, 1)
            lines.append(f"  saved activations:  default partition {default.saved_bytes / 1e6:.2f} MB; "
                         f"min-cut {min_cut.saved_bytes / 1e6:.2f} MB ({ratio:.2f}x), "
                         f"recomputing {len(min_cut.recomputed)} op(s) in the backward")
        if self.ok:
            lines.append(f"  result: OK, losses and gradients of all {self.steps} steps "
                         "match eager")
        else:
            lines.append("  result: FAILED, compiled training does not match eager:")
            lines += [f"    - {p}" for p in self.problems]
        return "\n".join(lines)


def run_demo(steps: int = 10, threads: int | None = 1, dropout: bool = True,
             seed: int = 0) -> DemoReport:
    """Train eagerly and compiled with ``backend="aotkit"``, compare, and report.

    Both runs start from the same parameters and RNG seed and take turns step by step.
    ``threads`` is passed to ``torch.set_num_threads`` (``None`` leaves it as it is).

    Example::

        >>> report = run_demo(steps=3)  # doctest: +SKIP
        >>> print(report)  # doctest: +SKIP
    """
    if threads is not None:
        torch.set_num_threads(threads)
    cfg = TransformerConfig() if dropout else TransformerConfig(dropout=0.0)
    torch._dynamo.reset()
    aotkit.counters.reset()
    model = TinyTransformer.from_seed(seed, cfg)
    compiled = Trainer(model, torch.compile(model, backend="aotkit"), seed)
    eager_model = TinyTransformer.from_seed(seed, cfg)
    eager = Trainer(eager_model, eager_model, seed)
    problems = _take_turns(eager, compiled, steps)
    finished = not problems
    if finished:
        problems = compare(eager.result, compiled.result)
    explanation = aotkit.explain()
    partitions = {name: capture_graphs("transformer", partition_fn=fn,
                                       module=TinyTransformer.from_seed(seed, cfg))[0].gm.meta["partition"]
                  for name, fn in (("default", aotkit.default_partition),
                                   ("min_cut", aotkit.min_cut_rematerialization_partition))}
    return DemoReport(
        steps=steps, threads=torch.get_num_threads(), dropout=dropout, eager=eager.result,
        compiled=compiled.result if finished else None,
        counts=dict(explanation.counters.get("aot", {})),
        recompiles=[f"{d.what}: {d.why}" for d in explanation.of_kind("recompile")],
        other_decisions=[str(d) for d in explanation if d.kind != "recompile"],
        problems=problems,
        partitions=partitions,
    )


def _take_turns(eager: Trainer, compiled: Trainer, steps: int) -> list[str]:
    """Step both trainers in turns, so both runs' step times see the same machine load.
    Returns a problem line if either raised (the demo reports failures, not tracebacks)."""
    for step in range(steps):
        for name, trainer in (("compiled", compiled), ("eager", eager))[:: 1 if step % 2 else -1]:
            try:
                trainer.step()
            except Exception as exc:
                return [f"{name} training raised {type(exc).__name__} at step {step}: "
                        f"{_first_line(exc)}"]
    return []


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


@dataclass
class CapturedGraph:
    """One graph aotkit handed to a compiler: ``kind`` is forward, backward or inference."""

    kind: str
    gm: fx.GraphModule
    example_inputs: Sequence[Any]

    @property
    def op_counts(self) -> Counter[str]:
        """How often each operator is called, e.g. ``{"aten.mm.default": 4}``."""
        return Counter(_op_name(n.target) for n in self.gm.graph.nodes if n.op == "call_function")

    def summary(self) -> str:
        nodes = list(self.gm.graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        outputs = len(self.gm.graph.output_node().args[0])
        if self.kind == "compiled_backward":  # tensors arrive in one list: count their reads
            inputs = sum(1 for n in placeholders[0].users if n.target is operator.getitem)
        else:
            inputs = len(placeholders)
        ops = Counter({op: k for op, k in self.op_counts.items() if op != "getitem"})
        top = ", ".join(f"{op} x{k}" for op, k in ops.most_common(5))
        return (f"{self.kind}: {len(nodes)} nodes ({ops.total()} ops, {inputs} inputs, "
                f"{outputs} outputs); most used: {top}")


def capture_backward_graph(model: str = "transformer") -> list[CapturedGraph]:
    """The whole backward of one step of ``model`` ("transformer" or "mlp") as
    ``aotkit.compiled_autograd`` hands it to its compiler: one graph, lowered to ATen (Note
    [Lowering captured backwards]), with ``.grad`` accumulation as calls. The forward runs eagerly.

    Example::

        >>> [graph] = capture_backward_graph("mlp")
        >>> graph.kind, graph.op_counts["aten.mm.default"]
        ('compiled_backward', 7)
    """
    make_model, make_batch = MODELS[model]
    captured: list[CapturedGraph] = []

    def record(gm: fx.GraphModule) -> Callable[..., Any]:
        captured.append(CapturedGraph("compiled_backward", gm, []))
        return gm

    module = make_model()
    x, _ = make_batch(seed=0)
    loss = module(x).float().sum()
    with aotkit.compiled_autograd.enable(record):
        loss.backward()
    return captured


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


MODELS: dict[str, tuple[Callable[[], nn.Module], Batch]] = {
    "transformer": (TinyTransformer.from_seed, make_token_batch),
    "mlp": (MLP.from_seed, make_mlp_batch),
}


def capture_graphs(model: str = "transformer", training: bool = True,
                   partition_fn: Callable[..., Any] = aotkit.default_partition,
                   module: nn.Module | None = None) -> list[CapturedGraph]:
    """The graphs ``aotkit.aot_module`` produces for one step of ``model`` ("transformer" or
    "mlp"; ``module``, if given, is that model as built, else it is built from seed 0): forward
    and backward when ``training`` (split by ``partition_fn``), else the inference graph (the
    model in eval mode, under ``torch.no_grad``; its mode is put back afterwards).

    Example::

        >>> graphs = capture_graphs("mlp")
        >>> [g.kind for g in graphs]
        ['forward', 'backward']
        >>> graphs[0].op_counts["aten.addmm.default"]
        4
    """
    make_model, make_batch = MODELS[model]
    captured: list[CapturedGraph] = []

    def recorder(kind: str) -> Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]:
        def record(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            captured.append(CapturedGraph(kind, gm, list(example_inputs)))
            return gm.forward

        record.__name__ = f"record_{kind}"
        return record

    module = make_model() if module is None else module
    compiled = aotkit.aot_module(module, recorder("forward"), recorder("backward"),
                                 inference_compiler=recorder("inference"),
                                 partition_fn=partition_fn)
    x, _ = make_batch(seed=0)
    if training:
        out = compiled(x)
        out.float().sum().backward()
    else:
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                compiled(x)
        finally:
            module.train(was_training)
    return captured
