"""Lowering captured backwards to ATen: what the compiler sees, the size guard, and fallbacks.

See Note [Lowering captured backwards]."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.compiled_autograd.helpers import assert_same_grads, check_module, counts, grads
from torch import fx, nn

import aotkit
from aotkit.compiled_autograd import runtime, session


class Keep:
    """A compiler that keeps every graph it is given and runs it unchanged."""

    def __init__(self) -> None:
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule) -> Callable[..., Any]:
        self.graphs.append(gm)
        return gm


def _formula_calls(gm: fx.GraphModule) -> list[str]:
    return [n.target.__name__ for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, runtime.Op)]


def _aten_calls(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload)]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _train_step(model: nn.Module, x: torch.Tensor, compiler: Callable[..., Any] | None,
                dynamic: bool = True) -> None:
    model.zero_grad(set_to_none=True)
    if compiler is None:
        model(x).pow(2).mean().backward()
        return
    with aotkit.compiled_autograd.enable(compiler, dynamic=dynamic):
        model(x).pow(2).mean().backward()


def _compare(model: nn.Module, batches: tuple[int, ...], compiler: Callable[..., Any],
             dynamic: bool = True) -> None:
    eager = copy.deepcopy(model)
    for b in batches:
        x = torch.randn(b, _in_features(model))
        _train_step(eager, x, None)
        _train_step(model, x, compiler, dynamic)
        assert_same_grads(grads(eager), grads(model))


def _in_features(model: nn.Module) -> int:
    return next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features


def test_compiler_gets_the_formulas_aten_ops() -> None:
    keep = Keep()
    _compare(_mlp(), (5,), keep)
    (gm,) = keep.graphs
    assert _formula_calls(gm) == []  # AddmmBackward0, validate_outputs... are all lowered
    assert "aten.mm.default" in _aten_calls(gm)
    assert "aten.gelu_backward.default" in _aten_calls(gm)
    assert not aotkit.explain().of_kind("fallback")


def test_option_off_gives_the_captured_graph() -> None:
    keep = Keep()
    with aotkit.config.patch(compiled_autograd_lower=False):
        _compare(_mlp(), (5, 7), keep)
    (gm,) = keep.graphs
    assert "AddmmBackward0" in _formula_calls(gm)
    assert _aten_calls(gm) == []
    assert not aotkit.explain().of_kind("fallback")  # the user asked for it: not a fallback


def test_turning_the_option_off_between_blocks_captures_again() -> None:
    """The engine kept replaying the lowered graph once captured, so the compiler never got
    the captured graph the option asks for; now the change drops the cache, recorded."""
    keep, model = Keep(), _mlp()
    for lower in (True, False, False, True):
        with aotkit.config.patch(compiled_autograd_lower=lower):
            _compare(model, (5,), keep)
    assert [_aten_calls(gm) != [] for gm in keep.graphs] == [True, False, True]
    clears = aotkit.explain().of_kind("cache_clear")
    assert len(clears) == 2 and "compiled_autograd_lower" in clears[0].why


def test_nop_compiler_binds_the_lowered_graph() -> None:
    _compare(_mlp(), (5, 5), aotkit.compiled_autograd.nop)
    assert counts() == (1, 1)


def test_dynamic_sizes_outside_the_guard_run_the_captured_graph() -> None:
    keep = Keep()
    _compare(_mlp(), (5, 6, 9, 5), keep)
    assert counts() == (1, 2)  # the lowered graph for batch 5, the captured one for the others
    assert _formula_calls(keep.graphs[0]) == []
    assert "AddmmBackward0" in _formula_calls(keep.graphs[1])
    (fallback,) = aotkit.explain().of_kind("fallback")
    assert "sizes[0] is 24, lowered for 20" in fallback.why  # 6 x 4 outputs, not 5 x 4
    assert "dynamic=True" in fallback.why


def test_static_sizes_outside_the_guard_are_lowered_again_with_the_reason() -> None:
    keep = Keep()
    # Batch 6 makes the engine capture again and treat the batch size as dynamic; the engine
    # then replays that capture for batches 9 and 11, each lowered for its sizes.
    _compare(_mlp(), (5, 6, 9, 11), keep, dynamic=False)
    assert counts() == (2, 4)
    recompiles = [d.why for d in aotkit.explain().of_kind("recompile")]
    assert len(recompiles) == 2
    assert "is 36, lowered for 24" in recompiles[0] and "lowering it again" in recompiles[0]
    assert all(_formula_calls(gm) == [] for gm in keep.graphs)


def test_past_the_recompile_limit_the_captured_graph_runs() -> None:
    keep = Keep()
    with aotkit.config.patch(recompile_limit=1):
        _compare(_mlp(), (5, 6, 9), keep, dynamic=False)
    assert len(keep.graphs) == 3
    assert "AddmmBackward0" in _formula_calls(keep.graphs[2])
    (fallback,) = aotkit.explain().of_kind("fallback")
    assert "recompile_limit=1" in fallback.why and "opaquely" in fallback.why


def test_a_lowering_failure_is_recorded_and_the_captured_graph_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any) -> Any:
        raise RuntimeError("no fake kernel for this formula")

    monkeypatch.setattr(session, "lower", fail)
    keep = Keep()
    _compare(_mlp(), (5,), keep)
    assert "AddmmBackward0" in _formula_calls(keep.graphs[0])
    (fallback,) = aotkit.explain().of_kind("fallback")
    assert "no fake kernel for this formula" in fallback.why


def test_a_fake_kernel_failing_in_lowering_logs_no_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    """``_embedding_bag_backward``'s meta kernel fails for sparse weights with per-sample
    weights (PyTorch's bug): the fallback decision says so, without the fake mode's ERROR."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(10, 4, mode="sum", sparse=True)
    reference = copy.deepcopy(bag)
    index, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    weights = torch.rand(8, requires_grad=True)
    reference_weights = weights.detach().clone().requires_grad_()
    reference(index, offsets, per_sample_weights=reference_weights).pow(2).sum().backward()
    with caplog.at_level("ERROR", logger="torch._subclasses.fake_tensor"), \
            aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):
        bag(index, offsets, per_sample_weights=weights).pow(2).sum().backward()
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses.fake_tensor")]
    (fallback,) = aotkit.explain().of_kind("fallback")
    assert "lowering to ATen failed" in fallback.why
    torch.testing.assert_close(weights.grad, reference_weights.grad)
    torch.testing.assert_close(bag.weight.grad.to_dense(), reference.weight.grad.to_dense())


class TransposeGrad(nn.Module):
    """A module whose output gradient a hook replaces by one of other strides."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda g: g.t().contiguous().t() * 2)  # same sizes, column-major
        return self.b(h.relu()).view(-1)


def test_formulas_after_a_hook_stay_calls_and_match_eager() -> None:
    keep = Keep()
    torch.manual_seed(0)
    check_module(TransposeGrad(), [torch.randn(6, 6)], steps=2, compiler=keep)
    assert keep.graphs
    for gm in keep.graphs:
        # Before the hook: lowered; after it (Linear a's formulas): called as captured.
        assert "aten.mm.default" in _aten_calls(gm)
        assert "AddmmBackward0" in _formula_calls(gm)


@pytest.mark.parametrize("keep_grad", [False, True], ids=["plain", "hook-keeps-grad"])
def test_grad_aliasing_matches_eager(keep_grad: bool) -> None:
    """Accumulation steals a gradient into an empty .grad exactly where eager does: a gradient
    a hook kept is copied, not aliased."""

    def run(compiler: Callable[..., Any] | None) -> tuple[bool, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        kept: list[torch.Tensor] = []
        if keep_grad:
            model.weight.register_hook(kept.append)
        x = torch.randn(5, 4)
        _train_step(model, x, compiler)
        shares = bool(kept) and kept[0].data_ptr() == model.weight.grad.data_ptr()
        return shares, model.weight.grad

    eager_shares, eager_grad = run(None)
    compiled_shares, compiled_grad = run(aotkit.compiled_autograd.nop)
    assert compiled_shares == eager_shares
    torch.testing.assert_close(compiled_grad, eager_grad)


def test_view_chains_that_undo_themselves_are_dropped() -> None:
    """A Linear weight's gradient is traced as ``t(t(mm))`` (the formula's transpose, then
    TBackward0's): the lowered graph accumulates the ``mm`` itself, stolen like eager's."""
    keep = Keep()
    _compare(_mlp(), (5,), keep)
    (gm,) = keep.graphs
    transposed_twice = [n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.t.default)
                        if getattr(n.args[0], "target", None) is torch.ops.aten.t.default]
    assert transposed_twice == []
    weight_grads = [n.args[1] for n in _accumulations(gm) if n.args[1].meta["val"].dim() == 2]
    assert [g.target for g in weight_grads] == [torch.ops.aten.mm.default] * 2
    assert all(n.kwargs.get("stealable", False) for n in _accumulations(gm))


def _accumulations(gm: fx.GraphModule) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=runtime.call_accumulate_grad))


def test_outputs_of_multi_output_formulas_are_stolen_like_eager() -> None:
    """LayerNorm's backward returns three gradients; its weight and bias gradients become
    .grad without a copy, as in eager (which never copies a gradient only it holds)."""

    def run(compiler: Callable[..., Any] | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
        _train_step(model, torch.randn(4, 6), compiler)
        return [p.grad for p in model.parameters()]

    keep = Keep()
    eager = run(None)
    compiled = run(lambda gm: keep(aotkit.compiled_autograd.nop(gm)))
    (gm,) = keep.graphs
    assert [n.kwargs.get("stealable", False) for n in _accumulations(gm)] == [True] * 4
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want)


class _Branches(nn.Module):
    """One activation read by three nodes: the engine sums three gradients for it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h.sin() * h.cos() + h


def test_gradient_sums_run_in_place_and_match_eager() -> None:
    keep = Keep()
    _compare_module(_Branches(), torch.randn(5, 6), keep)
    (gm,) = keep.graphs
    sums = [str(n.target) for n in gm.graph.nodes if "aten.add" in str(n.target)]
    assert sums == ["aten.add_.Tensor", "aten.add_.Tensor"]


def test_gradient_sums_never_write_into_the_callers_gradients() -> None:
    """Gradients the caller passes to backward() are graph inputs: a sum of views of them
    makes a new tensor, and the caller's tensors keep their values."""
    keep = Keep()
    x = torch.randn(4, requires_grad=True)
    g1, g2 = torch.randn(4), torch.randn(2, 2)
    before = (g1.clone(), g2.clone())
    with aotkit.compiled_autograd.enable(keep):
        torch.autograd.backward([x.view(4), x.view(2, 2)], [g1, g2])
    (gm,) = keep.graphs
    assert "aten.add.Tensor" in _aten_calls(gm)
    torch.testing.assert_close((g1, g2), before)
    torch.testing.assert_close(x.grad, g1 + g2.view(4))


def _compare_module(model: nn.Module, x: torch.Tensor, compiler: Callable[..., Any]) -> None:
    eager = copy.deepcopy(model)
    for m, c in ((eager, None), (model, compiler)):
        m.zero_grad(set_to_none=True)
        if c is None:
            m(x).pow(2).mean().backward()
        else:
            with aotkit.compiled_autograd.enable(c):
                m(x).pow(2).mean().backward()
    assert_same_grads(grads(eager), grads(model))


def test_size_guard_names_the_first_input_that_differs() -> None:
    from aotkit.compiled_autograd.lower import Example, SizeGuard

    inputs = [torch.randn(4, 3), torch.randn(3, 4).t()]
    guard = SizeGuard(Example(inputs, [4, 3], []))
    assert guard.accepts(Example([torch.randn(4, 3), torch.randn(3, 4).t()], [4, 3], []))
    cases = {
        "inputs[1]' stride mismatch": [inputs[0], torch.randn(4, 3)],
        "inputs[0]' size mismatch": [torch.randn(5, 3), inputs[1]],
        "inputs[0]' dtype mismatch": [inputs[0].double(), inputs[1]],
        "inputs[1]' requires_grad mismatch": [inputs[0], inputs[1].requires_grad_()],
        "inputs has 1 values, lowered for 2": inputs[:1],
    }
    for why, changed in cases.items():
        example = Example(changed, [4, 3], [])
        assert not guard.accepts(example)
        assert why in guard.why_not(example)
    assert guard.why_not(Example(inputs, [4, 2], [])) == "sizes[1] is 2, lowered for 3"


def _autocast_step(model: nn.Module, dtype: torch.dtype | None,
                   compiler: Callable[..., Any] | None) -> list[Any]:
    """One backward with ``backward()`` under CPU autocast to ``dtype`` (None: no autocast)."""
    model.zero_grad(set_to_none=True)
    loss = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(0))).sum()
    autocast = contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)
    with autocast:
        if compiler is None:
            loss.backward()
        else:
            with aotkit.compiled_autograd.enable(compiler):
                loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize(("first", "then", "why"), [
    (None, torch.bfloat16, "autocast is bfloat16 on cpu, lowered with autocast off"),
    (torch.bfloat16, None, "autocast is off, lowered with autocast bfloat16 on cpu"),
    # The dispatch keys say only that autocast is on: the float16 backward replayed the graph
    # lowered with bfloat16 casts (wrong gradients, or oneDNN's reorder error).
    (torch.bfloat16, torch.float16,
     "autocast is float16 on cpu, lowered with autocast bfloat16 on cpu"),
])
def test_backward_under_autocast_is_not_replayed_under_another(
        first: torch.dtype | None, then: torch.dtype | None, why: str) -> None:
    """Autocast around backward() changes eager's gradients (the formulas' ops are cast). A
    graph lowered under autocast has those casts in it, one lowered outside has none: the guard
    tells them apart, and each backward matches eager's in its context."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    eager = copy.deepcopy(model)
    for dtype in (first, then, first):
        want = _autocast_step(eager, dtype, None)
        got = _autocast_step(model, dtype, aotkit.compiled_autograd.nop)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert why in aotkit.explain().of_kind("fallback")[0].why


class _TimeMajorLayerNorm(nn.Module):
    """LayerNorm and dropout of a transposed view, then a flat output: their backward formulas
    meet gradients that are dense but transposed (Note [Kernels whose fake strides differ])."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = nn.functional.dropout(self.norm(h.view(h.shape[0], 8, 5).transpose(1, 2)), 0.3)
        return y.transpose(1, 2).reshape(h.shape[0], -1)


def test_formulas_given_transposed_gradients_are_lowered_on_real_layouts() -> None:
    """The lowered graph's view of layer norm's gradient failed at run time: its fake kernel
    keeps the gradient's stride order, the real one returns it contiguous."""
    model = _TimeMajorLayerNorm()
    eager = copy.deepcopy(model)
    keep = Keep()
    for batch in (3, 5):
        h = torch.randn(batch, 40, requires_grad=True)
        h2 = h.detach().clone().requires_grad_()
        torch.manual_seed(batch)
        eager(h2).square().sum().backward()
        torch.manual_seed(batch)
        with aotkit.compiled_autograd.enable(keep):
            model(h).square().sum().backward()
        torch.testing.assert_close(h.grad, h2.grad)
    assert_same_grads(grads(eager), grads(model))
    assert all(_aten_calls(gm) for gm in keep.graphs)  # lowered, not the captured fallback


@pytest.mark.parametrize("log_graphs", [False, True])
def test_the_lowered_graph_is_logged_at_info_only_with_log_graphs(
        log_graphs: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The captured graph is logged at INFO (the issue asks for it); its lowered form doubled
    that for every capture."""
    aotkit.compiled_autograd.reset()
    w = torch.ones(3, requires_grad=True)
    with caplog.at_level("INFO", logger="aotkit.compiled_autograd"), \
            aotkit.config.patch(log_graphs=log_graphs), \
            aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):
        (w * 2).sum().backward()
    messages = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert any(m.startswith("captured backward graph") for m in messages)
    assert any(m.startswith("lowered ") for m in messages) == log_graphs


@pytest.mark.parametrize("act", [F.relu6, F.elu, F.hardswish])
def test_a_hook_on_a_channels_last_activation_gets_eagers_layout(act: Callable[..., Any]) -> None:
    """The lowering copied the activation backward's inputs contiguous (Note [Kernels whose
    fake strides differ] applies to mixed layouts only): a hook's NHWC view of the gradient
    raised "view size is not compatible", where eager's runs."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)

    def step(compiled: bool) -> tuple[tuple[int, ...], torch.Tensor]:
        seen: dict[str, Any] = {}

        def hook(grad: torch.Tensor) -> None:
            seen["stride"], seen["nhwc"] = grad.stride(), grad.permute(0, 2, 3, 1).view(-1, 4)

        h = conv(x)
        h.register_hook(hook)
        loss = act(h).pow(2).sum()
        with aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop) if compiled \
                else contextlib.nullcontext():
            loss.backward()
        return seen["stride"], seen["nhwc"]

    (want_stride, want), (got_stride, got) = step(False), step(True)
    assert got_stride == want_stride
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _selections(x: torch.Tensor, a: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Gradients reaching whole-tensor selections are infinite or NaN; ormqr's gradient is
    laid out column-major."""
    q = torch.ormqr(a, tau, torch.ones(4, 4, dtype=torch.float64), left=True, transpose=True)
    return x.max().sqrt() + x.min().mul(float("inf")) + x.median() * float("nan") \
        + x.nanmedian().sqrt() + q.sum()


def test_formulas_taking_another_path_for_traced_tensors_stay_calls() -> None:
    """Note [Gradients of a selected element]: lowered, max/min/median gave NaN to every
    element for a non-finite gradient; ormqr's gradient was laid out row-major."""
    a, tau = torch.geqrf(torch.randn(4, 4, dtype=torch.float64,
                                     generator=torch.Generator().manual_seed(0)))
    results = []
    compiler = Keep()
    for context in (contextlib.nullcontext, lambda: aotkit.compiled_autograd.enable(compiler)):
        x = torch.tensor([-1.0, 0.0, -2.0, 3.0], requires_grad=True)
        leaf = a.clone().requires_grad_()
        with context():
            results.append(torch.autograd.grad(_selections(x, leaf, tau), (x, leaf)))
    (x_eager, a_eager), (x_grad, a_grad) = results
    assert torch.equal(x_grad.nan_to_num(7.0), x_eager.nan_to_num(7.0))
    assert torch.equal(a_grad, a_eager) and a_grad.stride() == a_eager.stride()
    assert {"MaxBackward1", "MinBackward1", "MedianBackward0", "NanmedianBackward0",
            "OrmqrBackward0"} <= set(_formula_calls(compiler.graphs[-1]))
