"""Small models run through a compiler: outputs and gradients (parameters included) against eager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tests.aot.eager_check import Compared, check_against_eager

from aotkit.models import (
    MLP,
    MLPConfig,
    TinyTransformer,
    TransformerConfig,
    make_mlp_batch,
    make_token_batch,
)

MLP_CFG = MLPConfig(width=16, depth=3, batch=4)
# No dropout here: these checks compare through aot_function, whose dropout of a non-contiguous
# tensor draws its mask in a different order from eager's; test_basic checks dropout through
# torch.compile instead.
TRANSFORMER_CFG = TransformerConfig(vocab=16, d_model=16, heads=2, layers=1, seq=6, batch=2,
                                    dropout=0.0)

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
