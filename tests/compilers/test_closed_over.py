"""A tensor the compiled function reads without taking it as an argument: changes made to it
in place show at the next call with every compiler (TorchScript's freezing and Inductor's
constant inlining and folding would bake in its value at compile time)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import aotkit
from aotkit.compilers import inductor, memory_efficient_fusion, nop, simple_ts_compile, ts_compile

MASK = torch.ones(4)  # small: Inductor inlined it by value
SCALE = torch.ones(4, 256)  # uniform: Inductor's joint-graph passes folded it to a `full`


def f(x: torch.Tensor) -> torch.Tensor:
    return (x * (MASK * 2) + MASK.sum()) * SCALE.mean(1) + (x.sin() * SCALE.T[:, :4]).sum(0)


MAKERS: dict[str, Callable[[], Any]] = {
    "nop": lambda: aotkit.aot_function(f, nop),
    "ts_compile": lambda: aotkit.aot_function(f, ts_compile),
    "simple_ts_compile": lambda: aotkit.aot_function(f, simple_ts_compile),
    "memory_efficient_fusion": lambda: memory_efficient_fusion(f),
    "inductor": lambda: aotkit.aot_function(f, inductor, decompositions=inductor.decompositions),
}


@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("compiler", list(MAKERS))
def test_in_place_changes_to_a_closed_over_tensor_show(compiler: str, requires_grad: bool) -> None:
    MASK.fill_(1.0), SCALE.fill_(1.0)
    compiled = MAKERS[compiler]()
    x = torch.linspace(-1, 1, 4, requires_grad=requires_grad)
    try:
        compiled(x)
        MASK.copy_(torch.tensor([3.0, -1.0, 0.5, 2.0]))
        SCALE.fill_(0.25)
        got, want = compiled(x), f(x)
        torch.testing.assert_close(got, want)
        if requires_grad:
            (grad,) = torch.autograd.grad(got.sum(), x)
            (expected,) = torch.autograd.grad(want.sum(), x)
            torch.testing.assert_close(grad, expected)
    finally:
        MASK.fill_(1.0), SCALE.fill_(1.0)


BUF = torch.zeros(6)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
def test_writing_an_argument_that_is_a_closed_over_tensor_is_refused(requires_grad: bool) -> None:
    def add_then_read(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return (x + BUF[:3]) * y  # eager reads BUF after the write when x is BUF's memory

    compiled = aotkit.aot_function(add_then_read, nop)
    y = torch.ones(3, requires_grad=requires_grad)
    fresh, reference = torch.zeros(3), torch.zeros(3)
    torch.testing.assert_close(compiled(fresh, y), add_then_read(reference, y))  # no sharing
    torch.testing.assert_close(fresh, reference)
    for shared in (BUF[:3], BUF[3:]):  # the memory, if not the elements, of the constant
        with pytest.raises(aotkit.errors.UnsupportedError,
                           match=r"writes args\[0\] in place, and args\[0\] shares memory with a "
                                 r"tensor of shape \(6,\) that the function reads as a constant"):
            compiled(shared, y)
    assert BUF.eq(0).all()  # refused before anything ran

    def passed_too(x: torch.Tensor, buf: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return (x + buf[:3]) * y

    buf, reference = torch.zeros(6), torch.zeros(6)
    out = aotkit.aot_function(passed_too, nop)(buf[:3], buf, y)  # the fix the error names
    torch.testing.assert_close(out, passed_too(reference[:3], reference, y))
    torch.testing.assert_close(buf, reference)

    def read_then_add(x: torch.Tensor) -> torch.Tensor:
        out = x * BUF[:3]
        x.add_(1)
        return out

    # A read before the write, or of elements the argument lacks: the graph's values are right.
    for arg, reads in ((BUF[:3], read_then_add), (BUF[3:], lambda x: x.add_(1) + HEAD)):
        BUF.zero_()
        expected = reads(arg)
        BUF.zero_()
        torch.testing.assert_close(aotkit.aot_function(reads, nop)(arg), expected)
    BUF.zero_()


HEAD = BUF[:3]


def test_a_constant_given_new_memory_after_tracing_is_checked_where_it_is_now() -> None:
    c = torch.arange(4.0)

    def add_then_read(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return c * 2

    compiled = aotkit.aot_function(add_then_read, nop)
    compiled(torch.zeros(4))
    c.data = torch.arange(4.0) + 10
    with pytest.raises(aotkit.errors.UnsupportedError, match="reads as a constant"):
        compiled(c)
