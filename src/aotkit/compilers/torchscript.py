"""TorchScript compilers and ``memory_efficient_fusion``."""

from __future__ import annotations

from typing import Any


def ts_compile(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("helper B")


def simple_ts_compile(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("helper B")


def nnc_jit(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("helper B")


def memory_efficient_fusion(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("helper B")


def default_decompositions(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("helper B")
