"""Graphs whose views sit at absolute storage offsets: which graphs, and the offsets their
entries are keyed on. See Note [Absolute storage offsets]."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

# Note [Absolute storage offsets]
# An entry serves inputs at any storage offset (``buf[1:5]`` and ``buf[2:6]``): views keep
# their place relative to the tensor they view. ``x.as_strided(size, stride, offset)`` does not:
# its offset counts from the start of x's memory, so its elements, the view the caller gets
# back and its gradient all move with x's own offset. A graph calling as_strided with an offset
# therefore serves only inputs at the storage offsets it was traced with; another offset traces
# again (a recompile naming it). Such a function is also traced a second time, with the fake
# mode's dispatch cache off: PyTorch's cache (2.13) handed a later trace of the same code, on
# an input at the same offset, a view at another offset, so the view the caller got back
# pointed at other elements. An as_strided on a tensor made inside (``fill_diagonal_`` of an
# intermediate) does not move with the inputs' offsets and keys nothing. A custom op writing a
# view of an input (``op_(y[::2])``) is handed the view rebuilt the same way, at the absolute
# offset the trace saw.
_AS_STRIDED = frozenset({torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default,
                         torch.ops.aten.as_strided_scatter.default})

#: A custom op writing views: the views are rebuilt from their bases by size, stride and
#: (absolute) storage offset, as as_strided does.
_AUTO_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized,
                        torch.ops.higher_order.auto_functionalized_v2)

#: Ops whose result is their first argument's memory, written: an input's new value.
_SCATTERS = frozenset({torch.ops.aten.as_strided_scatter.default,
                       torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default,
                       torch.ops.aten.diagonal_scatter.default})


def places_absolute_views(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls as_strided with a storage offset on an input, or on a view or new
    value of one, or a custom op writing a view of one (Note [Absolute storage offsets]); on a
    tensor made inside (``fill_diagonal_`` of an intermediate) the offset does not move with
    the inputs'."""
    for target in _AS_STRIDED:
        before_offset = 4 if target is torch.ops.aten.as_strided_scatter.default else 3
        if any(len(n.args) + len(n.kwargs) > before_offset and _of_an_input(n.args[0])
               for n in gm.graph.find_nodes(op="call_function", target=target)):
            return True
    return any(_writes_at_absolute_offsets(n) for target in _AUTO_FUNCTIONALIZED
               for n in gm.graph.find_nodes(op="call_function", target=target))


def _writes_at_absolute_offsets(node: fx.Node) -> bool:
    """Whether custom-op call ``node`` writes a view of an input placed by a storage offset
    (``op_(y[::2])``; a slice is placed relative to its base)."""
    offsets = any(k.endswith("_storage_offset") and v is not None
                  for k, v in node.kwargs.items())
    return offsets and any(map(_of_an_input, node.kwargs.get("_all_bases", ())))


def _of_an_input(node: Any) -> bool:
    """Whether ``node`` is a primal input, or a view or new value of one (a custom op's new
    values of its bases are taken for those of all of them)."""
    while isinstance(node, fx.Node) and isinstance(node.target, torch._ops.OpOverload) and (
            node.target.is_view or node.target in _SCATTERS):
        node = node.args[0]
    if isinstance(node, fx.Node) and node.target is operator.getitem \
            and getattr(node.args[0], "target", None) in _AUTO_FUNCTIONALIZED:
        return any(map(_of_an_input, node.args[0].kwargs.get("_all_bases", ())))
    return isinstance(node, fx.Node) and node.op == "placeholder" \
        and not str(node.target).startswith("tangents")


def traced_for_offsets(trace: Callable[[], tuple[Any, Any]], mode: Any) -> tuple[Any, Any, bool]:
    """``trace()``'s result and fallback, and whether its graph places absolute views; such a
    function is traced again with the fake mode's dispatch cache off."""
    traced, fallback = trace()
    absolute = places_absolute_views(traced[2])
    if absolute and getattr(mode, "cache_enabled", False):
        mode.cache_enabled = False
        traced, fallback = trace()
    return traced, fallback, absolute


def storage_offsets(tensors: Sequence[Any]) -> tuple[int, ...]:
    return tuple(t.storage_offset() if isinstance(t, torch.Tensor) else 0 for t in tensors)


def moved_offsets(offsets: tuple[int, ...] | None, positions: Sequence[int], leaves: Sequence[Any],
                  names: Sequence[str]) -> str | None:
    """The recompile reason of an entry keyed on ``offsets`` (of the leaves at ``positions``)
    that refused these ``leaves`` for their storage offsets, if it did."""
    if offsets is None:
        return None
    now = storage_offsets([leaves[i] for i in positions])
    moved = [f"{names[i]}: {old} -> {new}" for i, old, new in
             zip(positions, offsets, now, strict=True) if old != new]
    if not moved:
        return None
    return (f"storage offset of {', '.join(moved)}; the graph places a view at a storage "
            "offset (as_strided, or a custom op writing a view), which counts from the start of "
            "the input's memory (Note [Absolute storage offsets])")
