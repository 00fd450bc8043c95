"""Both partitioners on small programs: what crosses from forward to backward, what the
backward recomputes, gradients against eager, the memory budget, reports and CSE."""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from expecttest import assert_expected_inline
from tests.aot.eager_check import check_compiled
from torch import nn

import aotkit
from aotkit.partition import (
    PartitionReport,
    default_partition,
    min_cut_rematerialization_partition,
)
from aotkit.partition.cse import cse

PARTITIONERS = {"default": default_partition, "min_cut": min_cut_rematerialization_partition}


class Captured:
    """A partition_fn that keeps the graphs it made."""

    def __init__(self, partition_fn: Callable[..., Any]) -> None:
        self.partition_fn = partition_fn
        self.graphs: list[tuple[fx.GraphModule, fx.GraphModule]] = []

    def __call__(self, joint: fx.GraphModule, inputs: Any, *, num_fwd_outputs: int) -> Any:
        fw, bw = self.partition_fn(joint, inputs, num_fwd_outputs=num_fwd_outputs)
        self.graphs.append((fw, bw))
        return fw, bw

    @property
    def report(self) -> PartitionReport:
        return self.graphs[-1][0].meta["partition"]


def run_both(fn: Callable[..., Any], *args: torch.Tensor, partition: str,
             seed: int = 0) -> Captured:
    """Forward and backward of ``fn`` eagerly and through aotkit; outputs and grads must match."""
    captured = Captured(PARTITIONERS[partition])
    compiled = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=captured)
    eager_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    aot_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    torch.manual_seed(seed)
    expected = fn(*eager_args)
    torch.manual_seed(seed)
    actual = compiled(*aot_args)
    torch.testing.assert_close(actual, expected)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    actual.backward(grad)
    for a, e in zip(aot_args, eager_args, strict=True):
        torch.testing.assert_close(a.grad, e.grad)
    return captured


def targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def placeholders(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def test_cos_chain_min_cut_saves_the_input_and_recomputes() -> None:
    x = torch.randn(16, requires_grad=True)
    captured = run_both(lambda x: x.cos().cos().cos(), x, partition="min_cut")
    fw, bw = captured.graphs[0]
    report = captured.report
    assert (report.saved_tensors, report.saved_inputs, report.saved_bytes) == (1, 1, 0)
    assert report.recomputed == ("aten.cos.default", "aten.cos.default")
    assert placeholders(fw) == ["primals_1"]
    assert placeholders(bw) == ["primals_1", "tangents_1"]
    assert targets(bw).count("aten.cos.default") == 2
    assert len(fw.graph.output_node().args[0]) == 2  # the output and the saved input


def test_cos_chain_min_cut_golden_graphs() -> None:
    x = torch.randn(3, requires_grad=True)
    fw, bw = run_both(lambda x: x.cos().cos().cos(), x, partition="min_cut").graphs[0]
    assert_expected_inline(fw.code.strip(), """\
def forward(self, primals_1):
    cos = torch.ops.aten.cos.default(primals_1)
    cos_1 = torch.ops.aten.cos.default(cos);  cos = None
    cos_2 = torch.ops.aten.cos.default(cos_1);  cos_1 = None
    return [cos_2, primals_1]""")
    assert_expected_inline(bw.code.strip(), """\
def forward(self, primals_1, tangents_1):
    cos = torch.ops.aten.cos.default(primals_1)
    cos_1 = torch.ops.aten.cos.default(cos)
    sin = torch.ops.aten.sin.default(cos_1);  cos_1 = None
    neg = torch.ops.aten.neg.default(sin);  sin = None
    mul = torch.ops.aten.mul.Tensor(tangents_1, neg);  tangents_1 = neg = None
    sin_1 = torch.ops.aten.sin.default(cos);  cos = None
    neg_1 = torch.ops.aten.neg.default(sin_1);  sin_1 = None
    mul_1 = torch.ops.aten.mul.Tensor(mul, neg_1);  mul = neg_1 = None
    sin_2 = torch.ops.aten.sin.default(primals_1);  primals_1 = None
    neg_2 = torch.ops.aten.neg.default(sin_2);  sin_2 = None
    mul_2 = torch.ops.aten.mul.Tensor(mul_1, neg_2);  mul_1 = neg_2 = None
    return [mul_2]""")


def test_cos_chain_default_saves_the_intermediates() -> None:
    x = torch.randn(16, requires_grad=True)
    captured = run_both(lambda x: x.cos().cos().cos(), x, partition="default")
    report = captured.report
    assert (report.saved_tensors, report.saved_inputs, report.saved_bytes) == (3, 1, 2 * 16 * 4)
    assert report.recomputed == ()
    assert "aten.cos.default" not in targets(captured.graphs[0][1])


def test_gelu_of_matmul_saves_the_matmul_not_the_gelu() -> None:
    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(32, 64, requires_grad=True)
    captured = run_both(lambda x, w: F.gelu(x @ w), x, w, partition="min_cut")
    fw, bw = captured.graphs[0]
    saved = fw.graph.output_node().args[0][1:]
    assert [str(n.target) for n in saved if n.op != "placeholder"] == ["aten.mm.default"]
    assert captured.report.saved_bytes == 8 * 64 * 4
    assert "aten.mm.default" in targets(fw)
    assert targets(bw).count("aten.mm.default") == 2  # the two grads, never the forward mm


@pytest.mark.parametrize("partition", list(PARTITIONERS))
def test_layer_norm(partition: str) -> None:
    x = torch.randn(4, 8, 32, requires_grad=True)
    w, b = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)
    captured = run_both(lambda x, w, b: F.layer_norm(x, (32,), w, b).relu(), x, w, b,
                        partition=partition)
    report = captured.report
    # Free: the input, weight and bias. Paid: mean and rstd (4 x 8 each), and one (4, 8, 32)
    # tensor for relu's backward: the layer norm is not recomputable, so at equal bytes min-cut
    # saves the relu output like the default partition does, and recomputes nothing.
    assert (report.saved_inputs, report.saved_tensors) == (3, 6)
    assert report.saved_bytes == 2 * 4 * 8 * 4 + 4 * 8 * 32 * 4
    assert report.recomputed == ()


@pytest.mark.parametrize("partition", list(PARTITIONERS))
@pytest.mark.parametrize("fn", [
    lambda x: x / x.shape[-1] ** 0.5,
    lambda x: F.batch_norm(x, None, None, training=True),
    lambda x: x.std(-1),
], ids=["scale", "batch_norm", "std"])
def test_size_arithmetic_is_recomputed_not_saved(fn: Callable[..., Any], partition: str) -> None:
    """Note [Size arithmetic is recomputed]: the backward takes SymInts, never a SymFloat."""
    captured = Captured(PARTITIONERS[partition])
    compiled = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=captured, dynamic=True)
    for shape in [(4, 6, 3), (5, 7, 2)]:
        check_compiled(fn, compiled, torch.randn(shape, requires_grad=True))
    [(_, bw)] = captured.graphs
    inputs = [n.meta["val"] for n in bw.graph.find_nodes(op="placeholder")]
    assert not any(isinstance(v, (torch.SymFloat, torch.SymBool)) for v in inputs), inputs


@pytest.mark.parametrize("partition", list(PARTITIONERS))
def test_dropout_gradients_equal_eager(partition: str) -> None:
    x, w = torch.randn(16, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.dropout(F.gelu(x @ w), 0.3, training=True).tanh() * F.dropout(x, 0.5)

    captured = run_both(f, x, w, partition=partition, seed=3)
    bw = captured.graphs[0][1]
    random = [t for t in targets(bw)
              if t == "aten.native_dropout.default" or "rand" in t or "bernoulli" in t]
    assert random == []


class _InjectGrad(torch.autograd.Function):
    """A backward returning a tensor it saved as is (a synthetic gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, synthetic: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(synthetic)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.saved_tensors[0], None


@pytest.mark.parametrize("partition", list(PARTITIONERS))
def test_a_saved_input_the_backward_returns_as_is_is_saved(partition: str) -> None:
    """An input the backward returns without computing on it was not saved by the default
    partitioner (only values some backward op reads were): an internal AssertionError."""
    run_both(lambda x, s: _InjectGrad.apply(x, s) * 3, torch.randn(3, requires_grad=True),
             torch.full((3,), 7.0), partition=partition)


@pytest.mark.parametrize("name", ["default_partition", "min_cut_rematerialization_partition"])
def test_pytorchs_partitioners_split_where_the_trace_did(name: str) -> None:
    # Note [Partitioners from PyTorch]: PyTorch's default_partition reads node tags.
    import torch._functorch.partitioners as torch_partitioners

    PARTITIONERS["torch"] = getattr(torch_partitioners, name)
    try:
        x, w = torch.randn(16, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
        captured = run_both(lambda x, w: F.dropout((x @ w).sin(), 0.5).exp(), x, w,
                            partition="torch", seed=3)
    finally:
        del PARTITIONERS["torch"]
    fw, bw = captured.graphs[0]
    assert "aten.mm.default" in targets(fw)
    assert targets(bw).count("aten.mm.default") == 2  # the two gradients, no recomputed x @ w


def test_a_dead_draw_a_partitioner_leaves_in_the_backward_is_dropped() -> None:
    """PyTorch's default_partition left a dead recomputed dropout in this backward: backward()
    drew a second mask, so every later random number differed from eager's."""
    from torch._functorch.partitioners import default_partition as torch_default_partition

    def f(x, w):
        return F.dropout((x @ w).relu(), 0.2).sum(1)

    def next_draw(fn):
        x, w = torch.ones(4, 8, requires_grad=True), torch.ones(8, 8, requires_grad=True)
        torch.manual_seed(0)
        fn(x, w).sum().backward()
        return torch.rand(3), w.grad

    expected = next_draw(f)
    actual = next_draw(aotkit.aot_function(f, aotkit.compilers.nop,
                                           partition_fn=torch_default_partition))
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


def test_min_cut_never_recomputes_expensive_ops() -> None:
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    conv = nn.Conv2d(3, 4, 3).requires_grad_(False)  # closed over: a constant, no grad

    def f(x: torch.Tensor) -> torch.Tensor:
        h = conv(x).relu()
        q = h.flatten(2)
        att = F.scaled_dot_product_attention(q, q, q)
        return (att.sum(-1, keepdim=True) * att).sin()

    captured = run_both(f, x, partition="min_cut")
    expensive = {"aten.convolution.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
                 "aten.bmm.default", "aten.mm.default", "aten.sum.dim_IntList"}
    assert not expensive & set(captured.report.recomputed)


@pytest.mark.parametrize("dynamic", [False, True])
def test_min_cut_matches_eager_on_a_transformer_layer(dynamic: bool) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    captured = Captured(min_cut_rematerialization_partition)
    compiled = aotkit.aot_module(layer, aotkit.compilers.nop, partition_fn=captured,
                                 dynamic=dynamic)
    eager = __import__("copy").deepcopy(layer)
    x = torch.randn(2, 8, 32)
    for seed in (1, 2):
        torch.manual_seed(seed)
        expected = eager(x)
        torch.manual_seed(seed)
        actual = compiled(x)
        torch.testing.assert_close(actual, expected)
        actual.sum().backward()
        expected.sum().backward()
    for (name, p), q in zip(layer.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert captured.report.saved_symints >= (1 if dynamic else 0)


def mlp_step(budget: float) -> PartitionReport:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(),
                          nn.Linear(128, 64), nn.LayerNorm(64))
    captured = Captured(min_cut_rematerialization_partition)
    eager = __import__("copy").deepcopy(model)
    compiled = aotkit.aot_module(model, aotkit.compilers.nop, partition_fn=captured)
    x = torch.randn(32, 64)
    with aotkit.config.patch(activation_memory_budget=budget):
        compiled(x).square().sum().backward()
    eager(x).square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    return captured.report


def test_budget_saved_bytes_fall_monotonically() -> None:
    budgets = (1.0, 0.75, 0.5, 0.25, 0.0)
    saved = [mlp_step(b).saved_bytes for b in budgets]
    assert saved == sorted(saved, reverse=True), saved
    assert saved[-1] < saved[0]
    assert "aten.addmm.default" in mlp_step(0.0).recomputed
    assert "aten.addmm.default" not in mlp_step(1.0).recomputed


def _bytes_held(call: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> int:
    """Bytes of the storages autograd keeps for the backward of ``call()``, inputs' aside."""
    storages: dict[int, int] = {}
    skip = {t.untyped_storage().data_ptr() for t in inputs}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return sum(storages.values())


_PARTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "slice": lambda y: y[:, :32], "split chunk": lambda y: y.split(8, 1)[0],
    "unbind row": lambda y: y.unbind(0)[3], "split chunk of an input": lambda y: y,
}


@pytest.mark.parametrize("partition", list(PARTITIONERS))
@pytest.mark.parametrize("part", list(_PARTS))
def test_saved_bytes_count_a_saved_part_as_what_it_keeps(partition: str, part: str) -> None:
    """A saved ``y[:, :32]`` (or chunk of ``y.split``) keeps all of ``y``: it was counted at
    its own size; a chunk of an input keeps nothing new."""
    x, w = torch.randn(64, 16, requires_grad=True), torch.randn(16, 128, requires_grad=True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if part == "split chunk of an input":
            return (x @ w).sum() + x.split(4, 1)[0].sin().sum()
        return _PARTS[part](x @ w).sin().sum()

    captured = Captured(PARTITIONERS[partition])
    compiled = aotkit.aot_function(f, aotkit.compilers.nop, partition_fn=captured)
    held = _bytes_held(lambda: compiled(x, w), [x, w])
    assert captured.report.saved_bytes == held
    assert (held == 0) == (part == "split chunk of an input")


def test_a_budget_below_one_never_keeps_more_than_the_default() -> None:
    """A small slice of a large random tensor (pinned, so saved as the slice): the cut weighed
    the slice at its own size and, below budget 1, kept the whole random tensor alive."""
    def f(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = torch.rand(1000, 64)[:2]
        return ((s.t() @ s) * v).sin().sum() + (x @ w).tanh().sum()

    held = []
    for budget in (1.0, 0.75, 0.5, 0.0):
        captured = Captured(min_cut_rematerialization_partition)
        args = [torch.randn(8, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True),
                torch.randn(64, 64, requires_grad=True)]
        with aotkit.config.patch(activation_memory_budget=budget):
            compiled = aotkit.aot_function(f, aotkit.compilers.nop, partition_fn=captured)
            held.append(_bytes_held(functools.partial(compiled, *args), args))
        assert captured.report.saved_bytes == held[-1]
    assert held == sorted(held, reverse=True) and held[0] < 1000 * 64 * 4, held


def test_saved_bytes_count_a_saved_view_of_an_input_as_nothing() -> None:
    """Two checkpointed regions reading one weight: the backward gets ``weight.t()`` saved (a
    view of an input, which keeps nothing new); it was counted at the weight's size."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    lin = nn.Linear(256, 256)
    policy = functools.partial(create_selective_checkpoint_contexts,
                               lambda *a, **k: torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE)

    def f(x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = checkpoint(lambda h: F.gelu(lin(h)), x, use_reentrant=False, context_fn=policy)
        return x.tanh()

    captured = Captured(min_cut_rematerialization_partition)

    def backend(gm: fx.GraphModule, example: list[torch.Tensor]) -> Callable[..., Any]:
        return aotkit.aot_module_simplified(gm, example, aotkit.compilers.nop,
                                            partition_fn=captured)

    x = torch.randn(4, 256, requires_grad=True)
    compiled = torch.compile(f, backend=backend)
    held = _bytes_held(lambda: compiled(x), [x, lin.weight, lin.bias])
    saved = [n.name for n in captured.graphs[-1][0].graph.output_node().args[0]]
    assert any(name.startswith("t") and not name.startswith("tanh") for name in saved), saved
    assert captured.report.saved_bytes == held == 2 * 4 * 256 * 4  # gelu's and tanh's outputs


@pytest.mark.parametrize("budget", [1.5, -0.1, float("nan")])
def test_budget_outside_zero_one_is_a_config_error(budget: float) -> None:
    with pytest.raises(aotkit.errors.ConfigError, match=r"must lie in \[0.0, 1.0\]"):
        aotkit.config.activation_memory_budget = budget
    assert aotkit.config.activation_memory_budget == 1.0
    joint_x = torch.ones(2, requires_grad=True)
    f = aotkit.aot_function(torch.sin, aotkit.compilers.nop, partition_fn=functools.partial(
        min_cut_rematerialization_partition, activation_memory_budget=budget))
    with pytest.raises(aotkit.errors.ConfigError, match=r"a number in \[0, 1\]"):
        f(joint_x)


def test_budget_change_recompiles_with_a_reason() -> None:
    f = aotkit.aot_function(lambda x: x.sin().sin(), aotkit.compilers.nop,
                            partition_fn=min_cut_rematerialization_partition)
    x = torch.ones(2, requires_grad=True)
    f(x)
    with aotkit.config.patch(activation_memory_budget=0.5):
        f(x)
    [decision] = aotkit.explain().of_kind("recompile")
    assert "activation_memory_budget changed: 1.0 -> 0.5" in decision.why


@pytest.mark.parametrize(("partition", "saved"), [
    ("default", "saved 2 tensor(s) (0 of them inputs), 32 activation bytes, 0 symint(s)"),
    # The output exp(exp(x)), which its backward reads, is saved (Note [Min-cut partitioning]).
    ("min_cut", "saved 2 tensor(s) (1 of them inputs), 16 activation bytes, 0 symint(s); "
                "recomputed 1 op(s): aten.exp.default"),
])
def test_partition_is_reported_in_explain_and_the_log(partition: str, saved: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="aotkit.partition"):
        f = aotkit.aot_function(lambda x: x.exp().exp(), aotkit.compilers.nop,
                                partition_fn=PARTITIONERS[partition])
        f(torch.ones(4, requires_grad=True))
    name = PARTITIONERS[partition].__name__
    [decision] = aotkit.explain().of_kind("partition")
    assert decision.why == f"{name}: {saved}"
    assert any(decision.why in r.getMessage() for r in caplog.records)
    assert aotkit.counters.counters["partition"]["saved_bytes"] == (32 if partition == "default" else 16)


def test_user_partition_fn_is_described_from_its_forward_graph() -> None:
    def my_partition(joint: fx.GraphModule, inputs: Any, *, num_fwd_outputs: int) -> Any:
        return default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs)

    f = aotkit.aot_function(lambda x: x.exp(), aotkit.compilers.nop, partition_fn=my_partition)
    f(torch.ones(4, requires_grad=True))
    [decision] = aotkit.explain().of_kind("partition")
    assert decision.why.startswith("my_partition: saved 1 tensor(s) (0 of them inputs), 16")


def test_cse_merges_pure_duplicates_but_not_random_ops() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    aten = torch.ops.aten
    sins = [graph.call_function(aten.sin.default, (x,)) for _ in range(2)]
    drops = [graph.call_function(aten.rand_like.default, (x,)) for _ in range(2)]
    ints = [graph.call_function(aten.add.Tensor, (x, v)) for v in (1, 1.0, True, 0.0, -0.0)]
    graph.output([*sins, *drops, *ints])
    out = cse(fx.GraphModule({}, graph))
    assert targets(out).count("aten.sin.default") == 1
    assert targets(out).count("aten.rand_like.default") == 2
    assert targets(out).count("aten.add.Tensor") == 5  # 1, 1.0, True, 0.0, -0.0 all differ


def test_the_min_cut_partitioner_does_not_import_inductor() -> None:
    """Dynamo (which make_fx loads) brings the bare ``torch._inductor`` package; the partitioner
    must add nothing to it (PyTorch's imports Inductor's passes, ~0.7 s per first call)."""
    code = (
        "import sys, torch, aotkit\n"
        "def inductor(): return {m for m in sys.modules if m.startswith('torch._inductor')}\n"
        "f = aotkit.aot_function(lambda x: x.cos().cos(), aotkit.compilers.nop)\n"
        "f(torch.ones(3, requires_grad=True)).sum().backward()\n"
        "before = inductor()\n"
        "mc = aotkit.partition.min_cut_rematerialization_partition\n"
        "f = aotkit.aot_function(lambda x: x.sin().sin(), aotkit.compilers.nop, partition_fn=mc)\n"
        "f(torch.ones(3, requires_grad=True)).sum().backward()\n"
        "print(sorted(inductor() - before), 'torch._inductor.compile_fx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False"


def test_attention_without_dropout_is_recomputable_at_budget_zero() -> None:
    q = torch.randn(2, 2, 8, 16, requires_grad=True)

    def attend(q: torch.Tensor, p: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.tanh(), q, q, dropout_p=p, is_causal=True).sin()

    def recomputed(p: float) -> tuple[str, ...]:
        with aotkit.config.patch(activation_memory_budget=0.0):
            return run_both(lambda q: attend(q, p), q, partition="min_cut").report.recomputed

    assert any("scaled_dot_product" in op for op in recomputed(0.0))
    assert not any("scaled_dot_product" in op for op in recomputed(0.5))  # it draws the mask


@pytest.mark.parametrize("budget", [0.5, 0.0])
@pytest.mark.parametrize("branch", ["dropout", "rand_like", "pure"])
def test_a_cond_whose_branch_draws_is_never_recomputed(budget: float, branch: str) -> None:
    """Recomputing the torch.cond drew once more before the backward's own draws (eager's cond
    backward runs the branch again, drawing anew): gradients off silently."""
    bodies = {"dropout": lambda a: F.dropout(a, 0.5, training=True) * a,
              "rand_like": lambda a: a * torch.rand_like(a), "pure": lambda a: a.sin() * a}

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x @ w
        return torch.cond(y.sum() > -1e9, bodies[branch], lambda a: a * 2, (y,)).sin()

    def step(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        x, w = torch.randn(6, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        out = fn(x, w)
        out.sum().backward()  # draws, if the branch does, at the same point of the stream
        return [out, x.grad, w.grad]

    captured = Captured(min_cut_rematerialization_partition)
    with aotkit.config.patch(activation_memory_budget=budget):
        actual = step(aotkit.aot_function(f, aotkit.compilers.nop, partition_fn=captured))
    torch.testing.assert_close(actual, step(f))
    recomputed = " ".join(captured.report.recomputed)
    assert ("cond" in recomputed) == (branch == "pure"), recomputed


_drawn: list[torch.Tensor] = []


@torch.library.custom_op("aotkit_test::rand_mask_", mutates_args=("m",),
                         tags=(torch.Tag.nondeterministic_seeded,))
def _rand_mask_(m: torch.Tensor) -> None:
    m.copy_((torch.rand_like(m) > 0.5).to(m.dtype))
    _drawn.append(m.clone())


@_rand_mask_.register_fake
def _(m: torch.Tensor) -> None:
    return None


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.0])
def test_a_random_custom_op_writing_its_input_runs_once(budget: float) -> None:
    """Under ``auto_functionalized`` the op's random tag was not seen: below budget 1 the
    backward drew a second mask."""
    def f(x: torch.Tensor) -> torch.Tensor:
        m = torch.empty_like(x)
        _rand_mask_(m)
        return (x.exp() * m).sum()

    _drawn.clear()
    x = torch.randn(64, requires_grad=True)
    with aotkit.config.patch(activation_memory_budget=budget):
        aotkit.aot_function(f, aotkit.compilers.nop,
                            partition_fn=min_cut_rematerialization_partition)(x).backward()
    assert len(_drawn) == 1
    torch.testing.assert_close(x.grad, x.detach().exp() * _drawn[0])


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.0])
def test_lstm_trains_at_every_budget(budget: float) -> None:
    """oneDNN's LSTM kernel would hand its backward an undefined workspace: training graphs are
    traced with oneDNN off (Note [Python dispatcher]), so no partition sees that kernel."""
    torch.manual_seed(0)
    eager = nn.LSTM(6, 8, batch_first=True)
    model = __import__("copy").deepcopy(eager)
    captured = Captured(min_cut_rematerialization_partition)
    compiled = aotkit.aot_module(model, aotkit.compilers.nop, partition_fn=captured)
    x = torch.randn(3, 5, 6)
    with aotkit.config.patch(activation_memory_budget=budget):
        out, (h, c) = compiled(x)
        (out.sum() + h.sum() + c.sum()).backward()
        out_e, (h_e, c_e) = eager(x)
        (out_e.sum() + h_e.sum() + c_e.sum()).backward()
    fw, bw = captured.graphs[-1]
    assert "aten.mkldnn_rnn_layer.default" not in targets(fw) + targets(bw)
    assert bool(aotkit.explain().of_kind("retrace")) == torch.backends.mkldnn.is_available()
    torch.testing.assert_close((out, h, c), (out_e, h_e, c_e))
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_min_cut_keeps_higher_order_op_bodies_in_the_backward() -> None:
    """torch.cond branches are get_attr subgraphs: never saved (nested compile regions are
    inlined, Note [Nested compile regions are inlined])."""

    @torch.compiler.nested_compile_region
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).sin()

    def regions(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return block(block(x, w), w).sum(0)

    def cond(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda a, b: (a @ b).sin(), lambda a, b: (a @ b).cos(),
                          (x, w)).sum(0)

    for fn in (regions, cond):
        torch._dynamo.reset()
        x, w = torch.rand(3, 4), torch.randn(4, 4)
        a = [t.clone().requires_grad_() for t in (x, w)]
        e = [t.clone().requires_grad_() for t in (x, w)]
        compiled = torch.compile(fn, backend="aotkit", options={"partition": "min_cut"})
        out, expected = compiled(*a), fn(*e)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        for got, want in zip(a, e, strict=True):
            torch.testing.assert_close(got.grad, want.grad)


# --- activation checkpointing (Note [Activation checkpointing]) --------------------------------


def _checkpointed(fn: Callable[..., Any], *args: torch.Tensor, partition: str,
                  context_fn: Callable[..., Any] | None = None) -> Captured:
    """``fn`` with each of its blocks under torch.utils.checkpoint, through torch.compile and
    aotkit; outputs and grads must equal eager's (checkpointed too) bit for bit."""
    captured = Captured(PARTITIONERS[partition])

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return aotkit.aot_module_simplified(gm, example_inputs, aotkit.compilers.nop,
                                            partition_fn=captured)

    results = []
    for run in (fn, torch.compile(fn, backend=backend, fullgraph=True)):
        inputs = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        torch.manual_seed(0)
        out = run(*inputs, context_fn)
        out.backward(torch.ones_like(out))
        results.append((out, [a.grad for a in inputs]))
    (expected, expected_grads), (actual, grads) = results
    assert torch.equal(actual, expected)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    return captured


def _block(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return h + F.dropout((h @ w).relu().sin(), 0.3) @ w  # a residual block: ends in a cheap op


def _three_blocks(x: torch.Tensor, w: torch.Tensor, context_fn: Any) -> torch.Tensor:
    """Three checkpointed blocks, the second reading the first's output directly."""
    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    for k in range(3):
        x = torch.utils.checkpoint.checkpoint(_block, x.tanh() if k == 2 else x, w,
                                              use_reentrant=False, **kwargs)
    return x


def _three_plain_blocks(x: torch.Tensor, w: torch.Tensor, context_fn: Any) -> torch.Tensor:
    return _block(_block(_block(x, w), w).tanh(), w)


@pytest.mark.parametrize("partition", list(PARTITIONERS))
def test_checkpointed_regions_are_recomputed_with_eager_values(partition: str) -> None:
    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
    report = _checkpointed(_three_blocks, x, w, partition=partition).report
    # Each block's first matmul, relu and sin run again in the backward (the sin's gradient
    # reads the relu; the dropout's output is recomputed from its mask and the sin), once per
    # block; dropout's mask (random) is saved, and so are the blocks' outputs (eager holds
    # those; recomputing one would rerun the block before it).
    recomputed = [op for op in report.recomputed if "mm" in op or "relu" in op or "sin" in op]
    assert sorted(recomputed) == sorted(
        ["aten.mm.default", "aten.relu.default", "aten.sin.default"] * 3)
    assert not any("dropout" in op for op in report.recomputed)
    assert report.partitioner.startswith(
        "default_partition (checkpointed" if partition == "default" else "min_cut")
    plain = _checkpointed(_three_plain_blocks, x, w, partition=partition)
    assert report.saved_bytes < plain.report.saved_bytes


@pytest.mark.parametrize("partition", list(PARTITIONERS))
def test_a_checkpointed_dropout_saves_its_mask_not_its_output(partition: str) -> None:
    """Note [Dropout in checkpointed regions]: the region's dropout output (float) was saved
    beside its mask; now it is recomputed from the mask with eager's values."""
    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
    captured = _checkpointed(_three_blocks, x, w, partition=partition)
    fw, _ = captured.graphs[-1]
    saved = [n.meta["val"] for n in fw.graph.output_node().args[0][1:]]  # after the output
    assert sum(v.dtype is torch.bool for v in saved) == 3  # the masks
    # Two 8 x 32 float values (block outputs read outside their region) and the three bool
    # masks; the three dropout outputs (8 x 32 floats) were saved too.
    assert captured.report.saved_bytes == 2 * 8 * 32 * 4 + 3 * 8 * 32
    assert "aten.mul.Tensor" in captured.report.recomputed


@pytest.mark.parametrize(("dtype", "train"), [(torch.bfloat16, True), (torch.float16, True),
                                             (torch.float32, False)])
def test_a_checkpointed_dropout_keeps_eagers_values(dtype, train) -> None:
    """Note [Dropout in checkpointed regions]: x * mask * scale rounds otherwise than the CPU
    kernel in bfloat16 and float16, so those keep the kernel's output; with train=False the
    output is a copy (it was scaled by 1 / (1 - p))."""
    def fn(x):
        return torch.utils.checkpoint.checkpoint(
            lambda h: torch.native_dropout(h, 0.1, train)[0], x, use_reentrant=False)

    results = []
    for run in (fn, torch.compile(fn, backend="aotkit")):
        torch.manual_seed(0)
        x = torch.randn(256, dtype=dtype, requires_grad=True)
        out = run(x)
        (out * out).sum().backward()
        results.append((out, x.grad))
    assert torch.equal(results[1][0], results[0][0])
    assert torch.equal(results[1][1], results[0][1])


def test_an_in_place_op_on_a_saved_value_in_a_region_names_the_checkpoint() -> None:
    """Eager's checkpoint saves nothing inside its region, so ``h.relu_(); h.mul_(2)`` passes
    there; the traced region's saved relu output is checked, and the error says why."""
    lin = nn.Linear(16, 16)

    def region(a: torch.Tensor) -> torch.Tensor:
        h = lin(a)
        h.relu_()
        return h.mul_(2)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False).tanh()

    x = torch.randn(6, 16)
    f(x).sum().backward()  # eager runs
    out = torch.compile(f, backend="aotkit")(x)
    with pytest.raises(RuntimeError, match=r"(?s)modified by an inplace operation.*checkpoint "
                       r"region.*h = h.relu\(\)"):
        out.sum().backward()


def test_selective_checkpointing_policy_saves_what_it_names() -> None:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    report = _checkpointed(_three_blocks, x, w, partition="default",
                           context_fn=context_fn).report
    assert "aten.mm.default" not in report.recomputed
    assert "aten.relu.default" in report.recomputed


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_selective_checkpointing_does_not_save_what_a_saved_op_reads(partition: str) -> None:
    """Note [Activation checkpointing]: a MUST_SAVE node was taken for code outside its region,
    so its inputs there were saved as region outputs: cos(mm) besides sin, twice eager's bytes
    (more than without checkpointing on a four-block MLP)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.sin.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    def fn(x: torch.Tensor, w: torch.Tensor, context_fn: Any) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(
            lambda x, w: torch.mm(x, w).cos().sin().exp(), x, w, use_reentrant=False,
            context_fn=context_fn).sum()

    x, w = torch.randn(16, 8, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    report = _checkpointed(fn, x, w, partition=partition, context_fn=context_fn).report
    assert report.saved_bytes == 16 * 32 * 4  # sin's output alone, as eager saves


@pytest.mark.parametrize("fn", [
    lambda x, w: (x * w).exp(),
    lambda x, w: (x * w).sigmoid(),
    lambda x, w: torch.relu(x * w).t(),  # an output that is a view of what the backward reads
])
@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_an_output_the_backward_reads_is_saved(fn: Callable[..., Any], partition: str) -> None:
    """Note [Min-cut partitioning]: eager's exp saves its result, so changing the output in
    place before backward() raises, and a .data write changes the gradients. Min-cut recomputed
    the output from the inputs instead: no error, and the gradients of the value before."""
    f = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=PARTITIONERS[partition])
    x0, w0 = torch.randn(3, 3), torch.randn(3, 3)
    for call in (fn, f):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            call(x, w).add_(1).sum().backward()
    grads = []
    for call in (fn, f):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = call(x, w)
        y.data.add_(1)
        y.sum().backward()
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def _cos_of_sin(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.sin(), x.cos()  # sin's backward computes x.cos() again: CSE must leave it apart


@pytest.mark.parametrize("fn", [
    lambda x: (x * 2, (x * 2).exp().sum()),  # min-cut may not recompute exp from the output
    _cos_of_sin,
    lambda x: ((x * 2).t(), (x * 2).exp().sum()),  # an output that is a view
])
@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_an_output_the_backward_does_not_read_may_change_in_place(
        fn: Callable[..., Any], partition: str) -> None:
    """Note [Min-cut partitioning]: eager's backward holds no reference to these outputs, so
    zeroing one before backward() is allowed and leaves the gradients alone."""
    f = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=PARTITIONERS[partition])
    x0 = torch.randn(3, 3)
    grads = []
    for call in (fn, f):
        x = x0.clone().requires_grad_()
        changed, kept = call(x)
        with torch.no_grad():
            changed.zero_()
        kept.sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("partition", ["default", "min_cut"])
@pytest.mark.parametrize("fn", [lambda x: (x * 2, x * 2), lambda x: (x.clone(), x.clone()),
                                lambda x: (x.sin(), x.sin())])
def test_equal_outputs_stay_separate_tensors(fn: Callable[..., Any], partition: str) -> None:
    """Two outputs computing the same value are two tensors, as in eager: changing one in
    place (even under autograd) changes neither the other nor the gradients."""
    f = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=PARTITIONERS[partition])
    results = []
    for call in (fn, f):
        x = torch.linspace(-1, 1, 6).requires_grad_()
        a, b = call(x)
        assert a is not b and a.data_ptr() != b.data_ptr()
        a.mul_(3)
        b.sum().backward()
        results.append((a, b, x.grad))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def _checkpoint_returning_what_the_backward_reads(x: torch.Tensor, context_fn: Any,
                                                  ) -> torch.Tensor:
    def region(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = t.sin()
        return s, s * s  # mul's backward reads s, which the region also returns

    s, sq = torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False)
    return torch.stack([s, sq])


@pytest.mark.parametrize("partition", list(PARTITIONERS))
def test_a_checkpointed_region_output_the_backward_reads_is_saved(partition: str) -> None:
    x = torch.randn(4, 5, requires_grad=True)
    report = _checkpointed(_checkpoint_returning_what_the_backward_reads, x,
                           partition=partition).report
    assert "aten.sin.default" not in report.recomputed


def _returns_scaled(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = t * 2
    return s, s.exp().sum()


def _returns_dropped(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = F.dropout(t, 0.5)  # random: only saving it keeps its values
    return d, d.exp().sum()


@pytest.mark.parametrize("region", [_returns_scaled, _returns_dropped])
@pytest.mark.parametrize("partition", list(PARTITIONERS))
def test_a_checkpointed_region_output_the_backward_does_not_read(
        region: Callable[..., Any], partition: str) -> None:
    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return aotkit.aot_module_simplified(gm, example_inputs, aotkit.compilers.nop,
                                            partition_fn=PARTITIONERS[partition])

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False)

    grads = []
    for run in (fn, torch.compile(fn, backend=backend, fullgraph=True)):
        x = torch.linspace(-1, 1, 8).requires_grad_()
        torch.manual_seed(0)
        returned, loss = run(x)
        if region is _returns_scaled:  # eager keeps no reference to it: may change in place
            with torch.no_grad():
                returned.zero_()
        loss.backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


class _Gram(torch.autograd.Function):
    """A backward that needs ``x @ x.T``, which the forward never computes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.sum(1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return ((x @ x.t()) @ grad).unsqueeze(1).expand_as(x)


def test_min_cut_computes_what_only_the_backward_needs_in_the_backward() -> None:
    captured = run_both(_Gram.apply, torch.randn(64, 4, requires_grad=True), partition="min_cut")
    fw, bw = captured.graphs[-1]
    assert "aten.mm.default" not in targets(fw) and "aten.mm.default" in targets(bw)
    assert captured.report.saved_bytes == 0


def test_min_cut_recomputes_gathers() -> None:
    """``x.exp()[idx]`` is 8x larger than ``x``: the backward gathers again from the input
    instead of loading the gathered rows."""
    x, idx = torch.randn(16, 32, requires_grad=True), torch.randint(0, 16, (128,))
    captured = run_both(lambda x: x.exp()[idx].sin(), x, partition="min_cut")
    assert captured.report.saved_bytes == 0
    assert "aten.index.Tensor" in captured.report.recomputed


@pytest.mark.parametrize("partition", list(PARTITIONERS))
def test_an_output_a_backward_formula_reads_is_saved(partition: str) -> None:
    """sin's backward computes cos(y) from y: eager saves y, so changing y in place raises;
    min-cut saved the cos it computed in the forward instead, and gave the old value's grads."""
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ w
        return y, y.sin()

    f = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=PARTITIONERS[partition])
    for call in (fn, f):
        x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        y, s = call(x, w)
        with torch.no_grad():
            y.mul_(0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            s.sum().backward()


_TABLE = torch.randn(5)


@pytest.mark.parametrize("partition", list(PARTITIONERS))
def test_a_backward_reading_only_a_closed_over_tensor(partition: str) -> None:
    """The backward of ``x * T`` reads nothing of the forward but ``T``, an attribute of the
    graph: min-cut built a flow network without a sink ("node sink not in graph")."""
    run_both(lambda x: x * _TABLE, torch.randn(5, requires_grad=True), partition=partition)


_CLOSED_OVER = torch.linspace(-1, 1, 9).reshape(3, 3)


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_a_closed_over_tensor_changed_before_backward_raises_as_in_eager(partition: str) -> None:
    """Note [Constants the backward reads]: the backward read the closed-over tensor again, so a
    change between forward and backward gave gradients from the new value, without eager's
    error."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * constant).sin()  # mul saves the constant

    constant = _CLOSED_OVER.clone()
    f = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=PARTITIONERS[partition])
    for call in (fn, f):
        out = call(torch.ones(3, 3, requires_grad=True))
        with torch.no_grad():
            constant.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.parametrize("use", ["exp", "add"])
def test_a_value_of_a_closed_over_tensor_keeps_its_forward_value(use: str) -> None:
    """Eager saves ``C.exp()`` (``x + C``), not C; so does the default partitioner: the gradient
    is eager's after C changes. (Min-cut may recompute it from a saved C, which then raises,
    as for inputs: README; before, it recomputed from the new C, a wrong gradient.)"""
    constant = _CLOSED_OVER.clone()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * constant.exp()).sin() if use == "exp" else (x + constant).sin()

    f = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=default_partition)
    grads = []
    for call in (fn, f):
        constant.copy_(_CLOSED_OVER)
        x = torch.linspace(0, 1, 9).reshape(3, 3).requires_grad_()
        out = call(x)
        with torch.no_grad():
            constant.mul_(2)
        out.sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


class _ReadsConstantInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * _LIVE  # read when backward() runs, as eager reads it


_LIVE = torch.ones(3)


def _change_live_between(call: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    _LIVE.fill_(1)
    x = torch.ones(3, requires_grad=True)
    out = call(x)
    _LIVE.fill_(5)
    out.sum().backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_a_custom_backward_reads_a_closed_over_tensor_when_it_runs(partition: str) -> None:
    fn = _ReadsConstantInBackward.apply
    f = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=PARTITIONERS[partition])
    assert _change_live_between(fn).tolist() == [5.0] * 3
    torch.testing.assert_close(_change_live_between(f), _change_live_between(fn))


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_a_constant_saved_by_a_formula_and_read_by_a_custom_backward_raises_as_in_eager(
        partition: str) -> None:
    """Note [Constants the backward reads]: marking reads inside a custom backward live made
    mul's saved read of the same constant live too: a wrong gradient where eager raises."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return _ReadsConstantInBackward.apply(x) * _LIVE

    f = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=PARTITIONERS[partition])
    for call in (fn, f):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _change_live_between(call)


def test_a_closed_over_tensor_is_saved_as_an_input() -> None:
    constant = _CLOSED_OVER.clone()
    captured = run_both(lambda x: (x * constant).sin(), torch.randn(3, 3, requires_grad=True),
                        partition="min_cut")
    report = captured.report
    assert (report.saved_inputs, report.saved_bytes) == (2, 0)  # x and the constant
    _, bw = captured.graphs[-1]
    assert not bw.graph.find_nodes(op="get_attr")


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_a_mutated_input_is_not_free_to_save(partition: str) -> None:
    """Note [Saving inputs the function mutates]: min-cut saved the whole mutated buffer (which
    the runtime then copies) to recompute a small slice of it, and reported 0 bytes."""
    def fn(x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        buffer.add_(1)
        return (x * buffer[:1].sin()).sum()

    captured = Captured(PARTITIONERS[partition])
    f = aotkit.aot_function(fn, aotkit.compilers.nop, partition_fn=captured)
    buffers = [torch.randn(200, 100) for _ in range(2)]
    buffers[1].copy_(buffers[0])
    xs = [torch.randn(1, 100, requires_grad=True) for _ in range(2)]
    xs[1].data.copy_(xs[0])
    for call, x, buffer in zip((fn, f), xs, buffers, strict=True):
        call(x, buffer).backward()
    torch.testing.assert_close(buffers[1], buffers[0])
    torch.testing.assert_close(xs[1].grad, xs[0].grad)
    report = captured.report
    assert (report.saved_tensors, report.saved_inputs, report.saved_bytes) == (1, 0, 400)


class _NoisyGradient(torch.autograd.Function):
    """A stochastic gradient estimator: its backward draws random numbers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * x.cos() * (1 + torch.rand_like(x))


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_random_ops_of_a_backward_draw_when_backward_runs(partition: str) -> None:
    """Note [Effects of the backward]: the backward's rand_like ran in the forward call, so the
    caller's own draws between forward and backward, and the gradient, differed from eager."""
    f = aotkit.aot_function(_NoisyGradient.apply, aotkit.compilers.nop,
                            partition_fn=PARTITIONERS[partition])
    results = []
    for call in (_NoisyGradient.apply, f, f):
        torch.manual_seed(0)
        x = torch.randn(4, 3, requires_grad=True)
        out = call(x)
        between = torch.rand(3)
        out.sum().backward()
        results.append((between, x.grad))
    for between, grad in results[1:]:
        assert torch.equal(between, results[0][0])
        torch.testing.assert_close(grad, results[0][1])


def test_min_cut_keeps_equal_outputs_apart_through_unsafe_views() -> None:
    """CSE merged the two bmm's under matmul's _unsafe_view (which aliases without being marked
    a view), and the two outputs came back sharing memory."""
    def twice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ x.mT, x @ x.mT

    compiled = aotkit.aot_function(twice, aotkit.compilers.nop,
                                   partition_fn=min_cut_rematerialization_partition)
    a, b = compiled(torch.randn(2, 4, 3, requires_grad=True))
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    expected = b.detach().clone()
    a.detach().zero_()
    torch.testing.assert_close(b.detach(), expected)


class _SolveInBackward(torch.autograd.Function):
    """Its backward solves with ``m``: an error check of the backward's own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(m)
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (m,) = ctx.saved_tensors
        return torch.linalg.solve(m, grad), None


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_error_checks_run_where_eager_runs_them(partition: str) -> None:
    """Note [Effect tokens do not cross to the backward]: one token chain ran from the forward's
    check to the backward's, so the forward's check ran in backward() (a singular matrix gave
    NaNs from the forward and no error)."""

    def f(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return _SolveInBackward.apply(torch.linalg.inv(a), m)

    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        graphs.append(gm)
        return aotkit.compilers.nop(gm, example_inputs)

    compiled = aotkit.aot_function(f, keep, partition_fn=PARTITIONERS[partition])
    m = torch.eye(3) * 2
    compiled((torch.eye(3) * 4).requires_grad_(), m).sum().backward()
    saved = graphs[0].graph.output_node().args[0]  # merged with the forward's, min-cut saved
    assert not any(getattr(n, "target", None) is torch.ops.prims._make_token.default
                   for n in saved)  # the backward's token, which Inductor cannot take
    for fn in (f, compiled):
        a = (torch.eye(3) * 4).requires_grad_()
        fn(a, m).sum().backward()
        torch.testing.assert_close(a.grad, torch.full((3, 3), -1 / 32))
        with pytest.raises(torch.linalg.LinAlgError, match=r"linalg\.inv"):
            fn(torch.zeros(3, 3, requires_grad=True), m)
        out = fn(a, torch.zeros(3, 3))  # only the backward's check fails
        with pytest.raises(torch.linalg.LinAlgError, match=r"linalg\.solve"):
            out.sum().backward()


def test_a_report_counts_each_recomputed_op_once() -> None:
    report = PartitionReport("min_cut", 1, 4, 0, 0, ("aten.exp.default", "aten.mul.Tensor",
                                                   "aten.exp.default", "aten.exp.default"))
    assert str(report).endswith("recomputed 4 op(s): aten.exp.default x3, aten.mul.Tensor")


def test_a_selective_checkpoint_under_aot_function_is_not_reported_as_recomputed() -> None:
    """aot_function traces a selective checkpoint's policy tags without Dynamo's region ids:
    nothing is recomputed (README), but the default partitioner handed the graph to min-cut
    and the report said "checkpointed regions are recomputed"."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    recompute_all = functools.partial(create_selective_checkpoint_contexts,
                                      lambda ctx, op, *a, **k: CheckpointPolicy.MUST_RECOMPUTE)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(lambda x, w: torch.mm(x, w).tanh().sin(), x, w,
                                                 use_reentrant=False, context_fn=recompute_all)

    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    aotkit.aot_function(fn, aotkit.compilers.nop)(x, w).sum().backward()
    [decision] = aotkit.explain().of_kind("partition")
    assert decision.why.startswith("default_partition: ") and "recomputed" not in decision.why


@pytest.mark.parametrize("partition", ["default", "min_cut"])
@pytest.mark.parametrize("change", ["data", "in_place"])
def test_a_value_a_region_returns_is_recomputed_as_eager_does(partition: str, change: str) -> None:
    """Note [Activation checkpointing]: eager's checkpoint saves the region's inputs, not the
    exp it returns; saved, the output's in-place change raised in backward() where eager runs,
    and a .data change gave the gradient of the changed value, silently."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(lambda x: (x * 2).exp(), x, use_reentrant=False)

    grads = []
    for run in (fn, torch.compile(fn, backend="aotkit",
                                  options={"partition": partition})):
        x = torch.zeros(3, requires_grad=True)
        y = run(x)
        if change == "data":
            y.data.mul_(10)
        else:
            with torch.no_grad():
                y.mul_(2)
        y.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
