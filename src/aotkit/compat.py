"""The one place for PyTorch-version differences (CI runs 2.13; lent GPU machines run 2.11).

Everything here is a thin alias over a primitive; callers never test versions themselves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]

__all__ = [
    "TORCH_VERSION",
    "FakeTensor",
    "FakeTensorMode",
    "FunctionalTensor",
    "FunctionalTensorMode",
    "StorageWeakRef",
    "data_dependent_errors",
    "effect_tokens",
    "effect_types",
    "guard_globals",
    "mutations_hidden_from_autograd",
]


def effect_types() -> list[Any]:
    """Every kind of ordered side effect functionalization threads a token through."""
    from torch._higher_order_ops.effects import _EffectType

    return list(_EffectType)


def effect_tokens(mode: FunctionalTensorMode) -> dict[Any, torch.Tensor]:
    """The mode's effect-type -> token map (ordered side effects such as
    ``aten._linalg_check_errors`` chain through these tokens)."""
    return mode._tokens


def guard_globals() -> dict[str, Any]:
    """The names ShapeEnv's guard expressions refer to (Min, Max, math helpers...)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    return dict(SYMPY_INTERP)


def mutations_hidden_from_autograd(inner: torch.Tensor) -> bool:
    """Whether every mutation of a functional tensor ran under no_grad or inference mode."""
    return torch._functionalize_are_all_mutations_under_no_grad_or_inference_mode(inner)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """Exceptions fake-tensor tracing raises when Python control flow reads tensor data."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
