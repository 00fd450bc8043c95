"""torch.while_loop called directly inside aot_function: traced with dynamic=True, refused with
a typed error that says so without it."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.while_loop import while_loop

import aotkit
from aotkit.errors import TraceError, UnsupportedError


def doubling(x: torch.Tensor) -> torch.Tensor:
    return while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2), (torch.tensor(0), x))[1]


def test_while_loop_with_dynamic_shapes_matches_eager() -> None:
    compiled = aotkit.aot_function(doubling, aotkit.compilers.nop, dynamic=True)
    for n in (4, 7):
        x = torch.randn(n)
        torch.testing.assert_close(compiled(x), doubling(x))


def test_while_loop_without_dynamic_says_to_pass_it() -> None:
    with pytest.raises(UnsupportedError, match="dynamic=True"):
        aotkit.aot_function(doubling, aotkit.compilers.nop)(torch.randn(4))


def test_while_loop_on_inputs_requiring_grad_says_why_it_cannot_be_traced() -> None:
    x = torch.randn(4, requires_grad=True)
    doubling(x).sum().backward()  # eager runs the loop
    with pytest.raises(TraceError, match=r"while_loop is differentiated by running its loop(.|\n)*"
                                         r"Fix: call it with inputs that do not require grad"):
        aotkit.aot_function(doubling, aotkit.compilers.nop, dynamic=True)(x)
