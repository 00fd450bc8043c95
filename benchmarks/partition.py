"""Saved activations and recomputation of aotkit's partitioners against PyTorch's min-cut.

For four models, the joint forward+backward graph is captured once through
``aotkit.aot_module`` (a ``partition_fn`` records it, then hands it to ``default_partition``),
and every partitioner runs on its own copy of that same joint graph:

- ``default``: ``aotkit.partition.default_partition``;
- ``min_cut``: ``aotkit.partition.min_cut_rematerialization_partition`` (ours);
- ``torch_min_cut``: ``torch._functorch.partitioners.min_cut_rematerialization_partition``
  (``compiler="inductor"``, its default op lists), with every graph input passed as a
  static-lifetime input, so it too saves inputs for free, as our metric counts them.

Models (fixed seeds, training mode, on CPU):

- ``mlp``: ``aotkit.models.MLP`` (4 x Linear(256) + GELU), input (32, 256);
- ``transformer``: one ``aotkit.models`` pre-norm block (LayerNorm, nn.MultiheadAttention with
  a causal mask, GELU feed-forward, dropout 0.1), d_model 64, 4 heads, input (8, 16, 64);
- ``cnn``: Conv(3->16)-BN-ReLU-MaxPool-Conv(16->32)-BN-ReLU-MaxPool-Linear(2048->10),
  input (16, 3, 32, 32);
- ``gpt``: a GPT-2 style decoder block (LayerNorm, causal ``scaled_dot_product_attention``,
  LayerNorm, GELU MLP, residuals), d_model 128, 4 heads, input (8, 64, 128);
- ``gpt_checkpointed``: two such blocks, each under ``torch.utils.checkpoint`` (non-reentrant).
  Only Dynamo turns a checkpoint into the recompute marks partitioners honour, so this model
  goes through ``torch.compile`` with a backend calling ``aotkit.aot_module_simplified``
  (capture and grads alike) instead of ``aot_module``.

The block inputs (transformer, gpt) require grad, as inside a stack of blocks; the data
inputs of the MLP and the CNN do not.

What is counted, the same way for every partitioner, from the graphs it returns:

- saved tensors: the forward's outputs after the user outputs that are tensors (inputs
  included); saved symints: those that are SymInts;
- saved bytes: numel x element size (``aotkit.partition.report.nbytes``) of the saved tensors
  that are not forward-graph inputs: the activation memory the partition holds;
- recomputed: ``call_function`` nodes other than ``getitem`` whose joint-graph node appears in
  both the forward and the backward graph (both partitioners keep the joint graph's node names),
  i.e. ops the forward computes and the backward computes again;
- time: median of ``--repeats`` partitioner calls after one warm-up call, each on a fresh copy
  of the joint graph (copying untimed). The import time of each partitioner module is measured
  once in a fresh process.
- grads: the model trained one step through ``aotkit.aot_module(..., partition_fn=...)``
  (``nop`` compiler) gives the same output and gradients as eager under the same seed
  (``torch.testing.assert_close``).

A second table runs our min-cut with ``activation_memory_budget`` 1.0, 0.75, 0.5, 0.25, 0.0:
saved bytes must not grow as the budget falls.

Run::

    .venv/bin/python benchmarks/partition.py                  # markdown tables on stdout
    .venv/bin/python benchmarks/partition.py --models mlp gpt --repeats 9
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import operator
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import aotkit
from aotkit.models import MLP, TransformerConfig, make_mlp_batch
from aotkit.models import Block as TransformerBlock
from aotkit.partition import default_partition, min_cut_rematerialization_partition
from aotkit.partition.graph import is_sym
from aotkit.partition.report import nbytes

BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)


class GPTBlock(nn.Module):
    """A GPT-2 style decoder block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CheckpointedGPT(nn.Module):
    """Two GPT blocks, each under torch.utils.checkpoint; compiled through Dynamo."""

    through_dynamo = True

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([GPTBlock(), GPTBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def compiled(model: nn.Module, partition_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``model`` through aotkit with ``partition_fn``: ``aot_module``, or for a model marked
    ``through_dynamo``, ``torch.compile`` with a backend calling ``aot_module_simplified``."""
    if not getattr(model, "through_dynamo", False):
        return aotkit.aot_module(model, aotkit.compilers.nop, partition_fn=partition_fn)
    torch._dynamo.reset()

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return aotkit.aot_module_simplified(gm, example_inputs, aotkit.compilers.nop,
                                            partition_fn=partition_fn)

    return torch.compile(model, backend=backend, fullgraph=True)


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return make()


def _input(*shape: int, requires_grad: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(*shape, generator=gen).requires_grad_(requires_grad)


def _transformer() -> tuple[nn.Module, tuple[Any, ...]]:
    cfg = TransformerConfig()
    mask = torch.triu(torch.full((cfg.seq, cfg.seq), float("-inf")), diagonal=1)
    x = _input(cfg.batch, cfg.seq, cfg.d_model, requires_grad=True)
    return _seeded(lambda: TransformerBlock(cfg)), (x, mask)


#: name -> () -> (model, inputs); the model is in training mode.
MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]] = {
    "mlp": lambda: (MLP.from_seed(0), (make_mlp_batch(seed=0)[0],)),
    "transformer": _transformer,
    "cnn": lambda: (_seeded(small_cnn), (_input(16, 3, 32, 32, requires_grad=False),)),
    "gpt": lambda: (_seeded(GPTBlock), (_input(8, 64, 128, requires_grad=True),)),
    "gpt_checkpointed": lambda: (_seeded(CheckpointedGPT),
                                 (_input(8, 64, 128, requires_grad=True),)),
}


@dataclass
class Joint:
    """One captured joint graph and what a partitioner is called with."""

    gm: fx.GraphModule
    inputs: list[Any]
    num_fwd_outputs: int

    def fresh(self) -> fx.GraphModule:
        # Graph deep copies keep node names and share node.meta values (fake tensors).
        return fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))


def capture(model: nn.Module, inputs: tuple[Any, ...]) -> Joint:
    """Trace one forward of ``model`` through ``aot_module`` and keep its joint graph."""
    seen: list[Joint] = []

    def record(joint_gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int):
        seen.append(Joint(fx.GraphModule(joint_gm, copy.deepcopy(joint_gm.graph)),
                          list(joint_inputs), num_fwd_outputs))
        return default_partition(joint_gm, joint_inputs, num_fwd_outputs=num_fwd_outputs)

    compiled(copy.deepcopy(model), record)(*inputs)
    assert len(seen) == 1, f"expected one joint graph, got {len(seen)}"
    return seen[0]


def torch_min_cut(joint_gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int):
    """PyTorch's min-cut partitioner, every primal treated as free to save like ours does."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition as theirs

    primals = [n for n in joint_gm.graph.find_nodes(op="placeholder")
               if "tangents" not in str(n.target)]
    # It reads the fake mode from the tracing context (for checkpointed random ops).
    fake_mode = torch._guards.detect_fake_mode(
        [n.meta.get("val") for n in joint_gm.graph.find_nodes(op="placeholder")])
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        return theirs(joint_gm, joint_inputs, compiler="inductor",
                      num_fwd_outputs=num_fwd_outputs,
                      static_lifetime_input_indices=list(range(len(primals))))


def ours_with_budget(budget: float) -> Callable[..., tuple[fx.GraphModule, fx.GraphModule]]:
    def partition(joint_gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int):
        return min_cut_rematerialization_partition(
            joint_gm, joint_inputs, num_fwd_outputs=num_fwd_outputs,
            activation_memory_budget=budget)

    partition.__name__ = f"min_cut_budget_{budget}"
    return partition


PARTITION_FNS: dict[str, Callable[..., tuple[fx.GraphModule, fx.GraphModule]]] = {
    "default": default_partition,
    "min_cut": min_cut_rematerialization_partition,
    "torch_min_cut": torch_min_cut,
}


@dataclass
class Stats:
    """What one partition saved and recomputed, counted the same way for every partitioner."""

    saved_tensors: int
    saved_bytes: int
    saved_symints: int
    recomputed: list[str]
    saved_names: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (op, bytes)


def _op(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket).removeprefix("aten.")
    return getattr(target, "__name__", str(target))


def stats(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, num_fwd_outputs: int) -> Stats:
    saved = [n for n in fw_gm.graph.output_node().args[0][num_fwd_outputs:]
             if isinstance(n, fx.Node)]
    syms = [n for n in saved if is_sym(n)]
    tensors = [n for n in saved if isinstance(n.meta.get("val"), torch.Tensor)]
    activations = [n for n in tensors if n.op != "placeholder"]

    def computed(gm: fx.GraphModule) -> dict[str, fx.Node]:
        return {n.name: n for n in gm.graph.nodes
                if n.op == "call_function" and n.target is not operator.getitem}

    fw_ops = computed(fw_gm)
    recomputed = [_op(n) for name, n in computed(bw_gm).items() if name in fw_ops]
    return Stats(
        saved_tensors=len(tensors),
        saved_bytes=sum(nbytes(n) for n in activations),
        saved_symints=len(syms),
        recomputed=recomputed,
        saved_names={n.name: (_op(n), nbytes(n)) for n in activations},
    )


def partition_time(fn: Callable[..., Any], joint: Joint, repeats: int) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls after a warm-up call; and the last result."""
    result = fn(joint.fresh(), joint.inputs, num_fwd_outputs=joint.num_fwd_outputs)
    times = []
    for _ in range(repeats):
        gm = joint.fresh()
        start = time.perf_counter()
        result = fn(gm, joint.inputs, num_fwd_outputs=joint.num_fwd_outputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _step(run: Callable[..., torch.Tensor], model: nn.Module, inputs: tuple[Any, ...]):
    """Output and gradients (parameters, then inputs that require grad) of one step."""
    torch.manual_seed(1234)
    inputs = tuple(x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
                   else x for x in inputs)
    out = run(*inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weight).sum().backward()
    grads = [p.grad for p in model.parameters()]
    grads += [x.grad for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    return out.detach(), grads, [b.clone() for b in model.buffers()]


@dataclass
class References:
    """What one step gives eagerly and through aotkit with ``default_partition``: a partition
    that differs from eager but matches the latter inherits a difference made before
    partitioning (tracing), not by the partitioner."""

    make: Callable[[], tuple[nn.Module, tuple[Any, ...]]]
    eager: Any = None
    default: Any = None

    def __post_init__(self) -> None:
        self.eager = self.step(None)
        self.default = self.step(default_partition)

    def step(self, partition_fn: Callable[..., Any] | None) -> Any:
        model, inputs = self.make()
        if partition_fn is None:
            return _step(model, model, inputs)
        return _step(compiled(model, partition_fn), model, inputs)


def check_grads(refs: References, partition_fn: Callable[..., Any]) -> str:
    """"OK" when a step through aot_module with ``partition_fn`` gives eager's output, grads
    and buffers; else how it differs."""
    try:
        actual = refs.step(partition_fn)
    except Exception as exc:
        return f"FAILED ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]})"
    if _close(actual, refs.eager):
        return "OK"
    diff = max((a - e).abs().max().item() for a, e in zip(
        [actual[0], *actual[1]], [refs.eager[0], *refs.eager[1]], strict=True))
    if _close(actual, refs.default):
        return f"differs from eager (max abs diff {diff:.2g}), equal to default's [^trace]"
    return f"FAILED (max abs diff {diff:.2g} from eager, differs from default's too)"


def _close(actual: Any, expected: Any) -> bool:
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError:
        return False
    return True


def import_time(module: str) -> tuple[float, bool]:
    """Seconds to import ``module`` in a fresh process that has already imported torch, and
    whether that imported Inductor."""
    code = ("import sys, time, json, torch; t = time.perf_counter(); "
            f"import {module}; print(json.dumps([time.perf_counter() - t, "
            "'torch._inductor' in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=300)
    seconds, inductor = json.loads(proc.stdout.strip().splitlines()[-1])
    return float(seconds), bool(inductor)


@dataclass
class Row:
    model: str
    partitioner: str
    stats: Stats
    seconds: float
    grads: str
    own_report: Any = None  # fw_gm.meta["partition"] where the partitioner describes itself


def run_model(name: str, repeats: int) -> tuple[list[Row], list[tuple[float, Stats, str]]]:
    make = MODELS[name]
    joint = capture(*make())
    refs = References(make)
    rows = []
    for partitioner, fn in PARTITION_FNS.items():
        try:
            seconds, (fw_gm, bw_gm) = partition_time(fn, joint, repeats)
        except Exception as exc:
            print(f"{name}/{partitioner} raised {type(exc).__name__}: {exc}", file=sys.stderr)
            raise
        rows.append(Row(name, partitioner, stats(fw_gm, bw_gm, joint.num_fwd_outputs), seconds,
                        check_grads(refs, fn), fw_gm.meta.get("partition")))
    budget_rows = []
    for budget in BUDGETS:
        fn = ours_with_budget(budget)
        fw_gm, bw_gm = fn(joint.fresh(), joint.inputs, num_fwd_outputs=joint.num_fwd_outputs)
        budget_rows.append((budget, stats(fw_gm, bw_gm, joint.num_fwd_outputs),
                            check_grads(refs, fn)))
    return rows, budget_rows


def table(rows: list[Row]) -> str:
    by = {(r.model, r.partitioner): r for r in rows}
    header = ("| model | partitioner | saved tensors | saved bytes | vs torch_min_cut | "
              "saved symints | recomputed ops | partition time (ms) | grads vs eager |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        ref = by[(r.model, "torch_min_cut")].stats.saved_bytes
        ratio = f"{r.stats.saved_bytes / ref:.2f}x" if ref else "-"
        lines.append(
            f"| {r.model} | {r.partitioner} | {r.stats.saved_tensors} | {r.stats.saved_bytes:,} | "
            f"{ratio} | {r.stats.saved_symints} | {len(r.stats.recomputed)} | "
            f"{r.seconds * 1e3:.2f} | {r.grads} |")
    return "\n".join(lines)


def budget_table(budget_rows: dict[str, list[tuple[float, Stats, str]]]) -> str:
    header = ("| model | " + " | ".join(f"bytes @ {b}" for b in BUDGETS) + " | "
              + " | ".join(f"recomputed @ {b}" for b in BUDGETS)
              + " | bytes monotone | grads vs eager |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for model, entries in budget_rows.items():
        sizes = [s.saved_bytes for _, s, _ in entries]
        monotone = all(a >= b for a, b in itertools.pairwise(sizes))
        lines.append(
            f"| {model} | " + " | ".join(f"{b:,}" for b in sizes) + " | "
            + " | ".join(str(len(s.recomputed)) for _, s, _ in entries)
            + f" | {'yes' if monotone else 'NO'} | "
            + _budget_grads(entries) + " |")
    return "\n".join(lines)


def _budget_grads(entries: list[tuple[float, Stats, str]]) -> str:
    if all(g == "OK" for _, _, g in entries):
        return "OK"
    if all("[^trace]" in g for _, _, g in entries):
        return "differs from eager, equal to default's, at every budget [^trace]"
    return "; ".join(f"{b}: {g}" for b, _, g in entries if g != "OK")


def verdicts(rows: list[Row]) -> list[str]:
    by = {(r.model, r.partitioner): r for r in rows}
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        ours, theirs = by[(model, "min_cut")].stats, by[(model, "torch_min_cut")].stats
        ok = ours.saved_bytes <= theirs.saved_bytes
        ratio = ours.saved_bytes / theirs.saved_bytes if theirs.saved_bytes else float("nan")
        lines.append(f"- {model}: min_cut saves {ours.saved_bytes:,} B, torch_min_cut "
                     f"{theirs.saved_bytes:,} B ({ratio:.2f}x): {'met' if ok else 'MISSED'}")
    return lines


def differences(rows: list[Row]) -> list[str]:
    """What one min-cut saves or recomputes that the other does not, per model."""
    by = {(r.model, r.partitioner): r for r in rows}
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        ours, theirs = by[(model, "min_cut")].stats, by[(model, "torch_min_cut")].stats

        def listing(names: set[str], saved: dict[str, tuple[str, int]]) -> str:
            return ", ".join(f"{n} ({saved[n][0]}, {saved[n][1]:,} B)" for n in sorted(names)) \
                or "nothing"

        only_ours = set(ours.saved_names) - set(theirs.saved_names)
        only_theirs = set(theirs.saved_names) - set(ours.saved_names)
        lines.append(f"- {model}: saved only by min_cut: {listing(only_ours, ours.saved_names)}; "
                     f"only by torch_min_cut: {listing(only_theirs, theirs.saved_names)}")
        lines.append(f"  recomputed by min_cut: {_counted(ours.recomputed)}; "
                     f"by torch_min_cut: {_counted(theirs.recomputed)}")
        own = by[(model, "min_cut")].own_report
        if own is not None:
            agrees = (own.saved_bytes, len(own.recomputed)) == \
                (ours.saved_bytes, len(ours.recomputed))
            lines.append(f"  min_cut's own report: {own.saved_bytes:,} B saved, "
                         f"{len(own.recomputed)} op(s) recomputed "
                         f"({'agrees' if agrees else 'DIFFERS from the counts above'})")
    return lines


def _counted(ops: list[str]) -> str:
    if not ops:
        return "nothing"
    counts: dict[str, int] = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(f"{op} x{c}" if c > 1 else op for op, c in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5,
                        help="partitioner calls (after one warm-up) to take the median of")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    imports = {m: import_time(m) for m in
               ("aotkit.partition", "torch._functorch.partitioners")}
    rows: list[Row] = []
    budgets: dict[str, list[tuple[float, Stats, str]]] = {}
    for model in args.models:
        model_rows, budgets[model] = run_model(model, args.repeats)
        rows += model_rows

    print(f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPU(s); "
          "one joint graph per model (aotkit.aot_module, training mode), every partitioner "
          f"on a copy of it; time = median of {args.repeats} calls after a warm-up call; "
          "saved bytes exclude graph inputs\n")
    print(table(rows))
    print("\nImport in a fresh process (after torch): " + ", ".join(
        f"`{m}` {s:.2f} s ({'imports' if ind else 'does not import'} Inductor)"
        for m, (s, ind) in imports.items()))
    print("\nTarget: min_cut saved bytes <= torch_min_cut's on every model")
    print("\n".join(verdicts(rows)))
    print("\nDifferences between the two min-cuts (saved activations by joint-graph node):")
    print("\n".join(differences(rows)))
    print("\nOur min_cut under activation_memory_budget (saved bytes must not grow as the "
          "budget falls):\n")
    print(budget_table(budgets))
    grads = [r.grads for r in rows] + [b[2] for entries in budgets.values() for b in entries]
    if any("[^trace]" in g for g in grads):
        print("\n[^trace]: this model's compiled step differs from eager under every "
              "partitioner, default_partition included, and each partition matches "
              "default_partition's result (assert_close): the difference is made before "
              "partitioning.")
    failed = [g for g in grads if g.startswith("FAILED")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
