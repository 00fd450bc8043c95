"""bind_aten_calls (Note [Binding ATen calls]): which ATen calls go through PyTorch's Python
bindings, which stay as traced, and that bound graphs compute what the traced ones do."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import aotkit
from aotkit.compilers.bind import bind_aten_calls

aten = torch.ops.aten


def _calls(gm: fx.GraphModule) -> dict[str, Any]:
    """Each call node's name -> its target."""
    return {n.name: n.target for n in gm.graph.nodes if n.op == "call_function"}


def _bound_and_traced(fn: Any, *inputs: Any, **trace_kwargs: Any) -> tuple[fx.GraphModule, ...]:
    gm = make_fx(fn, **trace_kwargs)(*inputs)
    return gm, bind_aten_calls(gm)


def test_calls_go_through_bindings_and_compute_the_same() -> None:
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    gm, bound = _bound_and_traced(lambda a, b: (a @ b).sum(0, keepdim=True).view(5, 1).t() + 1.5,
                                  a, b)
    assert _calls(bound) == {"mm": torch.mm, "sum_1": torch.sum, "view": torch.Tensor.view, "t": torch.t,
                             "add": torch.add}
    assert all(isinstance(t, torch._ops.OpOverload) for t in _calls(gm).values())  # untouched
    torch.testing.assert_close(bound(a, b), gm(a, b), rtol=0, atol=0)
    torch.testing.assert_close(bound(a, b), ((a @ b).sum(0, keepdim=True).view(5, 1).t() + 1.5))


def test_a_nan_argument_does_not_spoil_the_verdict_for_other_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Verdicts are cached per argument types; one taken with nan (nan != nan) kept every
    later float add from its binding."""
    from aotkit.compilers import bind

    monkeypatch.setattr(bind, "_VERIFIED", {})
    x = torch.randn(3)
    _, bound = _bound_and_traced(lambda x: x + float("nan"), x)
    assert _calls(bound)["add"] is torch.add
    _, bound = _bound_and_traced(lambda x: x + 1.5, x)
    assert _calls(bound)["add"] is torch.add


def test_a_binding_that_dispatches_another_overload_is_not_used() -> None:
    x = torch.randn(3)

    def f(x: torch.Tensor) -> torch.Tensor:
        # torch.mul(x, 2.0) would dispatch mul.Tensor; torch.split is a Python wrapper; gelu's
        # backward has no binding; add_ mutates: all four stay as traced
        y = aten.mul.Scalar(x, 2.0)
        first, _ = aten.split.Tensor(y, 2)
        z = aten.gelu_backward.default(y, x)
        return aten.add_.Tensor(z.clone(), first.sum())

    gm, bound = _bound_and_traced(f, x)
    calls = _calls(bound)
    assert calls["mul"] is aten.mul.Scalar and calls["split"] is aten.split.Tensor
    assert calls["gelu_backward"] is aten.gelu_backward.default and calls["add_"] is aten.add_.Tensor
    assert calls["clone"] is torch.clone and calls["sum_1"] is torch.sum
    torch.testing.assert_close(bound(x), gm(x), rtol=0, atol=0)


def test_tensor_methods_are_called_as_torch_tensor_functions() -> None:
    """A subclass overriding a method is not picked up: the bound call, like the traced one,
    runs the ATen op."""

    class Overrides(torch.Tensor):
        def view(self, *size: Any) -> torch.Tensor:
            raise AssertionError("the subclass's view ran")

    gm, bound = _bound_and_traced(lambda x: x.view(2, 3) * 2, torch.ones(6))
    assert _calls(bound)["view"] is torch.Tensor.view
    x = torch.arange(6.0).as_subclass(Overrides)
    torch.testing.assert_close(bound(x), gm(x), rtol=0, atol=0)


def test_factories_stay_as_traced_under_a_default_device() -> None:
    _, bound = _bound_and_traced(lambda x: x + torch.full((3,), 2.0), torch.ones(3))
    full = next(n for n in bound.graph.nodes if "full" in n.name)
    assert full.target is aten.full.default  # a device argument: the default device may rewrite
    x = torch.ones(3)
    with torch.device("meta"):
        out = bound(x)
    assert out.device.type == "cpu" and torch.equal(out, torch.full((3,), 3.0))


def test_overload_choice_follows_argument_types() -> None:
    """One overload, several argument types: each (overload, types) is verified on its own, and
    integer/float promotion and 0-dim tensors behave as traced."""
    i, f, s = torch.arange(4), torch.randn(4), torch.tensor(3.0)

    def fn(i: torch.Tensor, f: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (aten.add.Tensor(i, 2), aten.add.Tensor(i, 2.5), aten.add.Tensor(f, s),
                aten.div.Tensor_mode(i, 3, rounding_mode="floor"), aten.pow.Tensor_Tensor(f, s))

    gm, bound = _bound_and_traced(fn, i, f, s)
    for want, got in zip(gm(i, f, s), bound(i, f, s), strict=True):
        assert want.dtype == got.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_symbolic_sizes_become_plain_ints_when_the_graph_runs() -> None:
    x = torch.randn(4, 6)
    _, bound = _bound_and_traced(lambda x: x.view(x.shape[0] * 2, -1).sum(1), x,
                                 tracing_mode="symbolic")
    assert _calls(bound)["view"] is torch.Tensor.view
    for rows in (4, 7):
        y = torch.randn(rows, 6)
        torch.testing.assert_close(bound(y), y.view(rows * 2, -1).sum(1))


def test_option_off_returns_the_graph_itself() -> None:
    gm = make_fx(torch.sin)(torch.ones(2))
    with aotkit.config.patch(bind_aten_calls=False):
        assert bind_aten_calls(gm) is gm
    assert bind_aten_calls(gm) is not gm


def test_kept_calls_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    gm = make_fx(lambda x: aten.mul.Scalar(x, 2.0))(torch.ones(2))
    with caplog.at_level(logging.DEBUG, logger="aotkit.compilers"):
        bind_aten_calls(gm)
    assert "kept as traced" in caplog.text and "aten.mul.Scalar x1" in caplog.text


def test_nop_runs_the_bound_graph_and_matches_eager() -> None:
    """Forward and backward through nop give eager's values; the option is part of the compiled
    entry's key, so turning it off recompiles and says why."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    x = torch.randn(4, 8)
    compiled = aotkit.aot_module(model, aotkit.compilers.nop)
    compiled(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for want, got in zip((p.grad for p in model.parameters()), grads, strict=True):
        torch.testing.assert_close(got, want)
    with aotkit.config.patch(bind_aten_calls=False):
        torch.testing.assert_close(compiled(x), model(x))
    assert any("bind_aten_calls changed" in d.why for d in aotkit.explain().of_kind("recompile"))


def test_multi_output_ops_returned_whole_keep_their_container() -> None:
    """``unbind`` returns a list and ``max.dim`` a plain tuple; their bindings would return a tuple
    and a named tuple, so they are bound only where the graph takes items of them."""
    x = torch.randn(3, 4)
    traced_val = make_fx(lambda a: a)(x).graph.find_nodes(op="placeholder")[0].meta["val"]
    for op, args in ((aten.unbind.int, (0,)), (aten.max.dim, (1,))):
        graph = fx.Graph()
        a = graph.placeholder("a")
        a.meta["val"] = traced_val
        graph.output(graph.call_function(op, (a, *args)))
        gm = fx.GraphModule(torch.nn.Module(), graph)
        assert type(bind_aten_calls(gm)(x)) is type(gm(x))
    _, bound = _bound_and_traced(lambda a: a.max(1).values + a.unbind(1)[1], x)
    assert _calls(bound)["max_1"] is torch.max and _calls(bound)["unbind"] is torch.unbind


def test_integers_beyond_int64_are_never_bound() -> None:
    """Such a constant fails differently through the binding, whatever was verified before."""
    x = torch.randn(3, 4)
    bind_aten_calls(make_fx(lambda a: a.view(12))(x))  # verifies view with an int list
    gm = make_fx(lambda a: a.view(12))(x)
    view = next(n for n in gm.graph.nodes if n.target is aten.view.default)
    view.args = (view.args[0], [2**64])
    gm.recompile()
    assert _calls(bind_aten_calls(gm))["view"] is aten.view.default


def test_verification_is_not_seen_by_a_users_torch_function_mode() -> None:
    seen: list[Any] = []

    class Recording(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    gm = make_fx(lambda a: aten.addcmul.default(a, a, a, value=0.5))(torch.ones(2))
    with Recording():
        bound = bind_aten_calls(gm)
    assert _calls(bound)["addcmul"] is torch.addcmul and seen == []
