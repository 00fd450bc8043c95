"""Every hook kind runs inside the captured graph, in eager's order, with eager's gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tests.compiled_autograd.helpers import counts, nop

import aotkit


def both(step: Callable[[list[str]], Any]) -> tuple[list[str], list[str], Any, Any]:
    """Run ``step(log)`` eagerly and compiled with fresh seeded state; returns logs and results."""
    torch.manual_seed(0)
    eager_log: list[str] = []
    expected = step(eager_log)
    torch.manual_seed(0)
    compiled_log: list[str] = []
    with aotkit.compiled_autograd.enable(nop):
        actual = step(compiled_log)
    return eager_log, compiled_log, expected, actual


def test_tensor_hooks_retain_grad_and_ordering() -> None:
    def step(log: list[str]) -> Any:
        w = torch.randn(4, requires_grad=True)
        a = w * 2
        b = a.sin()
        a.retain_grad()
        a.register_hook(lambda g: (log.append("a"), g * 3)[1])
        b.register_hook(lambda g: (log.append("b"), None)[0])
        w.register_hook(lambda g: (log.append("w"), g + 1)[1])
        b.sum().backward()
        return w.grad, a.grad

    eager_log, compiled_log, expected, actual = both(step)
    assert compiled_log == eager_log == ["b", "a", "w"]
    torch.testing.assert_close(actual, expected)
    assert counts() == (1, 1)


def test_node_pre_and_post_hooks() -> None:
    def step(log: list[str]) -> Any:
        w = torch.randn(3, requires_grad=True)
        y = w.exp()
        y.grad_fn.register_prehook(lambda gos: (log.append("pre"), (gos[0] * 2,))[1])
        y.grad_fn.register_hook(lambda gis, gos: (log.append("post"), None)[0])
        y.sum().backward()
        return w.grad

    eager_log, compiled_log, expected, actual = both(step)
    assert compiled_log == eager_log == ["pre", "post"]
    torch.testing.assert_close(actual, expected)


def test_module_full_backward_hooks() -> None:
    def step(log: list[str]) -> Any:
        lin = torch.nn.Linear(3, 2)
        lin.register_full_backward_pre_hook(lambda m, go: log.append("pre"))
        lin.register_full_backward_hook(
            lambda m, gi, go: (log.append("full"), (gi[0] * 2,))[1])
        x = torch.randn(4, 3, requires_grad=True)
        lin(x).pow(2).sum().backward()
        return x.grad, lin.weight.grad, lin.bias.grad

    eager_log, compiled_log, expected, actual = both(step)
    assert compiled_log == eager_log
    torch.testing.assert_close(actual, expected)


def test_post_accumulate_grad_hooks_order() -> None:
    def step(log: list[str]) -> Any:
        lin = torch.nn.Linear(3, 2)
        for name, p in lin.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, n=name: (log.append(n), p.grad.mul_(0.5))[0])
        lin(torch.randn(4, 3)).sum().backward()
        return lin.weight.grad, lin.bias.grad

    eager_log, compiled_log, expected, actual = both(step)
    assert compiled_log == eager_log and sorted(eager_log) == ["bias", "weight"]
    torch.testing.assert_close(actual, expected)


def test_saved_tensor_pack_unpack_hooks() -> None:
    def step(log: list[str]) -> Any:
        w = torch.randn(5, requires_grad=True)

        def pack(t: torch.Tensor) -> torch.Tensor:
            log.append("pack")
            return t * 1

        def unpack(t: torch.Tensor) -> torch.Tensor:
            log.append("unpack")
            return t * 2  # doubling the saved value changes the gradient: proves it ran

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = (w * w).sum()
        y.backward()
        return w.grad

    eager_log, compiled_log, expected, actual = both(step)
    assert compiled_log == eager_log
    torch.testing.assert_close(actual, expected)


def test_custom_function_saved_tensors_non_tensor_input_multiple_outputs() -> None:
    class ScaleAndShift(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, scale: float, y: torch.Tensor) -> Any:
            ctx.save_for_backward(x, y)
            ctx.scale = scale
            return x * scale * y, x + y

        @staticmethod
        def backward(ctx: Any, g_prod: torch.Tensor, g_sum: torch.Tensor) -> Any:
            x, y = ctx.saved_tensors
            return g_prod * ctx.scale * y + g_sum, None, g_prod * ctx.scale * x + g_sum

    def step(log: list[str]) -> Any:
        x = torch.randn(3, requires_grad=True)
        y = torch.randn(3, requires_grad=True)
        prod, total = ScaleAndShift.apply(x.sin(), 1.5, y)
        (prod.sum() + (total**2).sum()).backward()
        return x.grad, y.grad, prod.detach()

    _, _, expected, actual = both(step)
    torch.testing.assert_close(actual, expected)
    assert counts() == (1, 1)


def test_accumulate_into_existing_grads_and_retain_graph() -> None:
    def step(log: list[str]) -> Any:
        w = torch.randn(3, requires_grad=True)
        w.grad = torch.ones(3)
        loss = (w.tanh() * w).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return w.grad

    _, _, expected, actual = both(step)
    torch.testing.assert_close(actual, expected)
    assert counts() == (1, 1)  # both backwards share one structure: the second replays


def test_in_place_on_view_backward() -> None:
    def step(log: list[str]) -> Any:
        w = torch.randn(4, 3, requires_grad=True)
        base = w * 1
        base[1].mul_(3)
        base.sum().backward()
        return w.grad

    _, _, expected, actual = both(step)
    torch.testing.assert_close(actual, expected)


def test_hooks_on_parameter_grads_run_when_the_grad_is_ready() -> None:
    """A hook on a parameter's gradient, its accumulation and post-accumulate hooks run as soon
    as that gradient is ready (eager's order), not at the end of the captured backward."""

    def step(log: list[str]) -> Any:
        l1, l2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        l2.bias.register_hook(lambda g: (log.append("l2.bias hook"), g * 2)[1])
        l2.bias.register_post_accumulate_grad_hook(lambda p: log.append("l2.bias post-acc"))
        l1.weight.register_post_accumulate_grad_hook(lambda p: log.append("l1.weight post-acc"))
        l1.weight.retain_grad()  # a C++ tensor pre-hook on a leaf (a no-op there)
        x = torch.randn(2, 3, requires_grad=True)
        x.register_hook(lambda g: log.append(f"x hook sees l2.bias.grad={l2.bias.grad}"))
        l2(l1(x)).sum().backward()
        return [p.grad for p in (*l1.parameters(), *l2.parameters(), x)]

    eager_log, compiled_log, expected, actual = both(step)
    assert eager_log[:2] == ["l2.bias hook", "l2.bias post-acc"]
    assert compiled_log == eager_log
    torch.testing.assert_close(actual, expected)


def test_custom_function_backward_under_a_dynamo_compiler() -> None:
    """torch.compile traces a custom Function's backward replayed from the captured graph."""

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return g * 2 + x

    def compiler(gm: torch.fx.GraphModule) -> Any:
        return torch.compile(gm, backend="eager", fullgraph=True, dynamic=False)

    w = torch.randn(3, requires_grad=True)
    with aotkit.compiled_autograd.enable(compiler):
        Double.apply(w).sum().backward()
    torch.testing.assert_close(w.grad, 2 + w.detach())
