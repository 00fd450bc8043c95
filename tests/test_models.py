"""Whole-model tests: training the TinyTransformer through ``torch.compile(backend="aotkit")``
gives the losses and gradients eager PyTorch gives, step by step, dropout included."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import aotkit
from aotkit.models import (
    MLP,
    TinyTransformer,
    TransformerConfig,
    make_mlp_batch,
    make_token_batch,
)

STEPS = 4
SEED = 1234


def train(model: nn.Module, run: Callable[..., torch.Tensor], make_batch: Callable[..., tuple[torch.Tensor, torch.Tensor]],
          optimizer: str) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Train ``STEPS`` steps; ``run(x)`` is the (maybe compiled) model. Returns losses and grads."""
    params = list(model.parameters())
    opt = (torch.optim.AdamW(params, lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(params, lr=0.1, momentum=0.9))
    torch.manual_seed(SEED)
    losses, grads = [], []
    for step in range(STEPS):
        x, target = make_batch(seed=step)
        out = run(x)
        if out.dim() == 3:
            loss = nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())
        else:
            loss = nn.functional.mse_loss(out, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return losses, grads


def assert_same_training(eager: tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]],
                         compiled: tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]) -> None:
    eager_losses, eager_grads = eager
    compiled_losses, compiled_grads = compiled
    torch.testing.assert_close(torch.stack(compiled_losses), torch.stack(eager_losses))
    for step, (want, got) in enumerate(zip(eager_grads, compiled_grads, strict=True)):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=lambda m, s=step, n=name: f"step {s}, grad of {n}: {m}")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_transformer_training_with_dropout_matches_eager(optimizer: str) -> None:
    eager_model = TinyTransformer.from_seed(0)
    eager = train(eager_model, eager_model, make_token_batch, optimizer)

    model = TinyTransformer.from_seed(0)
    assert model.training and model.cfg.dropout > 0
    compiled = train(model, torch.compile(model, backend="aotkit"), make_token_batch, optimizer)

    assert_same_training(eager, compiled)
    assert aotkit.counters.counters["aot"]["bw_compiles"] >= 1
    for a, b in zip(model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_transformer_training_without_dropout_matches_eager() -> None:
    cfg = TransformerConfig(dropout=0.0)
    eager_model = TinyTransformer.from_seed(0, cfg)
    eager = train(eager_model, eager_model, make_token_batch, "adamw")
    model = TinyTransformer.from_seed(0, cfg)
    compiled = train(model, torch.compile(model, backend="aotkit"), make_token_batch, "adamw")
    assert_same_training(eager, compiled)


def test_dropout_makes_steps_differ() -> None:
    """Guards the test above: with dropout on, a different seed must change the loss, so a
    compiled model that ignored the RNG state could not pass by accident."""
    model = TinyTransformer.from_seed(0)
    tokens, targets = make_token_batch(seed=0)
    torch.manual_seed(SEED)
    first = model.loss(tokens, targets)
    torch.manual_seed(SEED + 1)
    second = model.loss(tokens, targets)
    assert not torch.allclose(first, second)


def test_mlp_training_matches_eager() -> None:
    eager_model = MLP.from_seed(0)
    eager = train(eager_model, eager_model, make_mlp_batch, "sgd")
    model = MLP.from_seed(0)
    compiled = train(model, torch.compile(model, backend="aotkit"), make_mlp_batch, "sgd")
    assert_same_training(eager, compiled)
    assert aotkit.counters.counters["aot"]["traces"] == 1


def test_models_are_deterministic() -> None:
    a, b = TinyTransformer.from_seed(5), TinyTransformer.from_seed(5)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(TinyTransformer.from_seed(6).head.weight, a.head.weight)
    assert torch.equal(make_token_batch(seed=2)[0], make_token_batch(seed=2)[0])
    assert torch.equal(make_mlp_batch(seed=2)[1], make_mlp_batch(seed=2)[1])
