"""torch.while_loop called directly inside aot_function: traced with dynamic=True (also when
differentiated), refused with a typed error that says so without it."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.while_loop import while_loop

import aotkit
from aotkit.errors import UnsupportedError


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


def test_while_loop_on_inputs_requiring_grad_matches_eager() -> None:
    """Its backward needs the trip count, a symbol read from data (Note [Data-dependent
    sizes]): one entry serves every count."""

    def loop(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return while_loop(lambda i, y: i < n, lambda i, y: (i + 1, y * 2 + 1),
                          (torch.tensor(0), x))[1]

    compiled = aotkit.aot_function(loop, aotkit.compilers.nop, dynamic=True)
    for size, n in ((4, 3), (4, 5), (6, 1)):
        x = torch.randn(size, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, expected = compiled(x, torch.tensor(n)), loop(x_eager, torch.tensor(n))
        torch.testing.assert_close(out, expected)
        weights = torch.arange(float(size))
        (out * weights).sum().backward()
        (expected * weights).sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad)
    assert compiled.num_entries == 1
