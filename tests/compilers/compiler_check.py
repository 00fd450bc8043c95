"""Small models run through a compiler: outputs and gradients (parameters included) against eager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tests.aot.eager_check import Compared, check_against_eager
from torch import nn

from aotkit.models import (
    MLP,
    MLPConfig,
    TinyTransformer,
    TransformerConfig,
    make_mlp_batch,
    make_token_batch,
)

MLP_CFG = MLPConfig(width=16, depth=3, batch=4)
TRANSFORMER_CFG = TransformerConfig(vocab=16, d_model=16, heads=2, layers=1, seq=6, batch=2,
                                    dropout=0.1)

MODELS: dict[str, Callable[[], tuple[torch.nn.Module, torch.Tensor]]] = {
    "mlp": lambda: (MLP.from_seed(0, MLP_CFG), make_mlp_batch(0, MLP_CFG)[0]),
    "transformer": lambda: (TinyTransformer.from_seed(0, TRANSFORMER_CFG),
                            make_token_batch(0, TRANSFORMER_CFG)[0]),
}


def check_model(name: str, compiler: Callable[..., Any], calls: int = 1) -> Compared:
    """Compile ``MODELS[name]`` as a function of its parameters and input with ``compiler``; the
    forward (dropout included, same seed) and every gradient must equal eager's."""
    model, x = MODELS[name]()
    params = {n: p.detach().requires_grad_() for n, p in model.named_parameters()}

    def run(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,))

    return check_against_eager(run, params, x, compiler=compiler, seed=0, calls=calls)


def train_like_eager(make: Callable[[], nn.Module], wrap: Callable[[nn.Module], Any],
                     x: torch.Tensor, steps: int = 3) -> None:
    """A few SGD steps through ``wrap(model)`` and through an identical eager model, each step
    from the same seed (dropout draws the same masks): losses and weights must agree (to float32
    rounding: compiled kernels may sum in another order)."""
    torch.manual_seed(0)
    model, reference = make(), make()
    reference.load_state_dict(model.state_dict())
    compiled = wrap(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(steps):
        losses = []
        for run, opt in zip((compiled, reference), opts, strict=True):
            torch.manual_seed(step)
            loss = run(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
