"""Input signatures: what a compiled entry is keyed on, and how two signatures differ."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree


def leaf_key(leaf: Any, dynamic: bool) -> tuple[Any, ...]:
    """What about one flattened argument decides the traced graph."""
    if isinstance(leaf, torch.Tensor):
        rg = leaf.requires_grad
        return (
            leaf.dtype,
            leaf.device,
            leaf.layout,
            rg,
            rg and leaf.is_leaf,
            leaf.dim() if dynamic else leaf.shape,
            None if dynamic else leaf.stride(),
        )
    try:
        hash(leaf)
    except TypeError:
        return (type(leaf), id(leaf))
    return (type(leaf), leaf)


def signature(spec: pytree.TreeSpec, leaves: Sequence[Any], dynamic: bool) -> tuple[Any, ...]:
    """The key of one call: pytree structure, every leaf, grad and autocast modes."""
    return (
        spec,
        tuple(leaf_key(x, dynamic) for x in leaves),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
    )


_FIELDS = ("dtype", "device", "layout", "requires_grad", "is_leaf", "shape", "stride")
_MODES = ("grad mode", "inference mode", "CPU autocast", "CUDA autocast")


def describe_change(old: tuple[Any, ...], new: tuple[Any, ...], names: Sequence[str]) -> str:
    """A sentence naming the first difference between two signatures."""
    if old[0] != new[0]:
        return f"the structure of the arguments changed: {old[0]} -> {new[0]}"
    if len(old[1]) != len(new[1]):
        return f"the number of arguments changed: {len(old[1])} -> {len(new[1])}"
    for name, a, b in zip(names, old[1], new[1], strict=True):
        if a == b:
            continue
        if len(a) == len(b) == len(_FIELDS):
            for field, x, y in zip(_FIELDS, a, b, strict=True):
                if x != y:
                    return f"{field} of {name} changed: {_show(x)} -> {_show(y)}"
        return f"{name} changed: {_show(a)} -> {_show(b)}"
    for mode, x, y in zip(_MODES, old[2:], new[2:], strict=True):
        if x != y:
            return f"{mode} changed: {x} -> {y}"
    return "the signature changed"


def _show(x: Any) -> str:
    if isinstance(x, torch.Size):
        return str(tuple(x))
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], type):
        return f"{x[0].__name__} {x[1]!r}"
    return repr(x)


def leaf_names(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """Readable names of the flattened arguments, e.g. ``x``, ``args[1]['w']``."""
    paths, _ = pytree.tree_flatten_with_path((args, kwargs))
    names = []
    for path, _leaf in paths:
        head, *rest = path
        prefix = "args" if getattr(head, "idx", 1) == 0 else "kwargs"
        names.append(prefix + "".join(str(k) for k in rest))
    return names
