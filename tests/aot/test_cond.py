"""torch.cond called directly (no Dynamo) inside aot_function/aot_module: values and gradients
as eager, and eager torch.cond still works afterwards."""

from __future__ import annotations

import pytest
import torch

import aotkit
from aotkit.errors import UnsupportedError


def branchy(x: torch.Tensor) -> torch.Tensor:
    return torch.cond(x.sum() > 0, lambda t: t.sin() * 2, lambda t: t.cos(), (x,))


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["true_branch", "false_branch"])
def test_aot_function_differentiates_cond_like_eager(sign: float) -> None:
    x = (torch.rand(4) + 0.1) * sign
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = aotkit.aot_function(branchy, aotkit.compilers.nop)(ours)
    expected = branchy(theirs)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad)


class CondModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: self.linear(t).sin(), lambda t: t.cos() * 3,
                          (x,))


def test_aot_module_differentiates_cond_branches_using_parameters() -> None:
    torch.manual_seed(0)
    model = CondModule()
    compiled = aotkit.aot_module(model, aotkit.compilers.nop)
    for x in (torch.rand(2, 4), -torch.rand(2, 4)):
        compiled(x).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).sum().backward()
        for got, want in zip(grads, (p.grad for p in model.parameters()), strict=True):
            torch.testing.assert_close(got, want)
        model.zero_grad()


def test_eager_cond_still_works_after_a_traced_one() -> None:
    x = torch.rand(3, requires_grad=True)
    aotkit.aot_function(branchy, aotkit.compilers.nop)(x.detach())
    out = branchy(x)  # eager: used to fail once tracing had made Dynamo skip cond's wrapper
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


def test_a_closed_over_tensor_requiring_grad_in_a_branch_is_refused() -> None:
    """Its gradient would be lost (w.grad stayed None); outside cond the guard refuses it too."""
    w = torch.randn(3, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: t * w, lambda t: t + w, (x,))

    with pytest.raises(UnsupportedError, match=r"requires grad \(read by a higher-order op(.|\n)*"
                                               r"Fix: pass it as an argument"):
        aotkit.aot_function(f, aotkit.compilers.nop)(torch.ones(3, requires_grad=True))
    with torch.no_grad():  # no gradient to lose
        torch.testing.assert_close(aotkit.aot_function(f, aotkit.compilers.nop)(torch.ones(3)),
                                   f(torch.ones(3)))


def test_a_branch_reading_a_closed_over_parameter_is_refused_naming_the_fix() -> None:
    w = torch.nn.Parameter(torch.randn(3, 3))

    def branches(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch.cond(p.sum() > 0, lambda x: x @ w, lambda x: x @ w * 2, (x,))

    with pytest.raises(aotkit.errors.UnsupportedError,
                       match=r"(?s)higher-order op.*Fix: pass such tensors in the op's operands"):
        aotkit.aot_function(branches, aotkit.compilers.nop)(torch.randn(4, 3, requires_grad=True),
                                                            torch.ones(2))
