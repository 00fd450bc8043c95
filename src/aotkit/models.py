"""Small, deterministic models for tests, the demo and benchmarks (``torch.nn`` layers only).

Build a model and a batch from seeds, so two runs (eager and compiled) start from the same state::

    >>> import torch
    >>> from aotkit.models import TinyTransformer, make_token_batch
    >>> model = TinyTransformer.from_seed(0)
    >>> tokens, targets = make_token_batch(seed=1)
    >>> loss = model.loss(tokens, targets)
    >>> loss.shape
    torch.Size([])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP",
    "MLPConfig",
    "TinyTransformer",
    "TransformerConfig",
    "make_mlp_batch",
    "make_token_batch",
]


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of a :class:`TinyTransformer`; the defaults keep a training step cheap on CPU."""

    vocab: int = 64
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 16
    batch: int = 8
    ff_mult: int = 4
    dropout: float = 0.1


@dataclass(frozen=True)
class MLPConfig:
    """Sizes of an :class:`MLP`: ``depth`` Linear layers of ``width`` with GELU between them."""

    width: int = 256
    depth: int = 4
    batch: int = 32


class Block(nn.Module):
    """A pre-norm transformer encoder block: causal self-attention then a GELU feed-forward."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.heads, dropout=cfg.dropout,
                                          batch_first=True)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.ff = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.ff_mult * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.ff_mult * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        attended, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + self.drop(attended)
        return x + self.ff(self.norm2(x))


class TinyTransformer(nn.Module):
    """A decoder-style language model: token embedding + learned positions, ``cfg.layers``
    :class:`Block` s with a causal mask, a final LayerNorm and an LM head.

    Example::

        >>> import torch
        >>> from aotkit.models import TinyTransformer, make_token_batch
        >>> model = TinyTransformer.from_seed(0)
        >>> tokens, _ = make_token_batch(seed=0)
        >>> model(tokens).shape
        torch.Size([8, 16, 64])
    """

    def __init__(self, cfg: TransformerConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or TransformerConfig()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.d_model) * 0.02)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        causal = torch.triu(torch.full((cfg.seq, cfg.seq), float("-inf")), diagonal=1)
        self.register_buffer("mask", causal, persistent=False)

    @classmethod
    def from_seed(cls, seed: int = 0, cfg: TransformerConfig | None = None) -> TinyTransformer:
        """A model whose parameters depend only on ``seed`` (the global RNG is left as it was).

        Example::

            >>> import torch
            >>> a, b = TinyTransformer.from_seed(3), TinyTransformer.from_seed(3)
            >>> torch.equal(a.head.weight, b.head.weight)
            True
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for ``tokens`` of shape ``(batch, seq)``."""
        seq = tokens.shape[1]
        x = self.drop(self.embed(tokens) + self.pos[:seq])
        mask = self.mask[:seq, :seq]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``self(tokens)`` against ``targets``.

        Example::

            >>> model = TinyTransformer.from_seed(0).eval()
            >>> tokens, targets = make_token_batch(seed=0)
            >>> 3.0 < model.loss(tokens, targets).item() < 5.0
            True
        """
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class MLP(nn.Module):
    """``cfg.depth`` ``Linear(width, width)`` layers with GELU between them.

    Example::

        >>> import torch
        >>> from aotkit.models import MLP, make_mlp_batch
        >>> x, y = make_mlp_batch(seed=0)
        >>> MLP.from_seed(0)(x).shape
        torch.Size([32, 256])
    """

    def __init__(self, cfg: MLPConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or MLPConfig()
        layers: list[nn.Module] = []
        for i in range(cfg.depth):
            layers.append(nn.Linear(cfg.width, cfg.width))
            if i < cfg.depth - 1:
                layers.append(nn.GELU())
        self.net = nn.Sequential(*layers)

    @classmethod
    def from_seed(cls, seed: int = 0, cfg: MLPConfig | None = None) -> MLP:
        """A model whose parameters depend only on ``seed`` (the global RNG is left as it was).

        Example::

            >>> import torch
            >>> torch.equal(MLP.from_seed(1).net[0].bias, MLP.from_seed(1).net[0].bias)
            True
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean squared error of ``self(x)`` against ``target``.

        Example::

            >>> x, y = make_mlp_batch(seed=0)
            >>> MLP.from_seed(0).loss(x, y).ndim
            0
        """
        return F.mse_loss(self(x), target)


def make_token_batch(seed: int = 0, cfg: TransformerConfig | None = None,
                     batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)`` of shape ``(batch, seq)``; targets are tokens shifted by one.

    Depends only on ``seed`` (a private generator is used). ``batch`` overrides ``cfg.batch``.

    Example::

        >>> tokens, targets = make_token_batch(seed=0)
        >>> tokens.shape, tokens.dtype
        (torch.Size([8, 16]), torch.int64)
        >>> torch.equal(tokens[:, 1:], targets[:, :-1])
        True
    """
    cfg = cfg or TransformerConfig()
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, cfg.vocab, (batch or cfg.batch, cfg.seq + 1), generator=gen)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def make_mlp_batch(seed: int = 0, cfg: MLPConfig | None = None,
                   batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, target)`` of shape ``(batch, width)`` drawn from a private generator seeded by ``seed``.

    Example::

        >>> x, y = make_mlp_batch(seed=0, batch=4)
        >>> x.shape, torch.equal(x, make_mlp_batch(seed=0, batch=4)[0])
        (torch.Size([4, 256]), True)
    """
    cfg = cfg or MLPConfig()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch or cfg.batch, cfg.width, generator=gen)
    target = torch.randn(batch or cfg.batch, cfg.width, generator=gen)
    return x, target
