"""Which input writes eager repeats when ``torch.utils.checkpoint`` stops a recompute early.

See Note [Checkpoint's early stop].
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from aotkit.aot.untraceable import nodes_below
from aotkit.compat import StorageWeakRef

# Note [Checkpoint's early stop]
# torch.utils.checkpoint (non-reentrant, early stop on: the default) recomputes a forward in
# the backward only until the last tensor the forward saved is saved again, then stops by
# raising from that save. For a compiled function the stop comes at the end of its
# CompiledFunction.apply, before the caller's tensors were written. Eager stops at its own last
# save inside the function, so it repeats the writes before that save (batch norm's running
# statistics: its kernel writes them, then its results are saved) and not those after it (a
# step counter, an EMA buffer updated after the last op that saves).
#
# The metadata pass records, for every op, the autograd node last created (sequence numbers
# rise with each node) and the storages the op writes, and, for every torch call, whether the
# nodes its outputs carry save a tensor (a branch kept nowhere, ``buf.copy_(y.pow(2).mean()
# .detach())``, saved in eager all the same); the last saving node places eager's stop. A write
# before that node's op or in it (the results are saved after the kernel ran) is repeated at
# the stop: the forward keeps the values of the inputs it writes, and the early stop applies
# those. A custom Function saves when its forward has returned, so every write inside its
# forward (made with grad mode off) comes before; under Dynamo only what its save_for_backward
# saved counts (not what it stashed on ctx). A Python number an op was given (``y * 2.0``) is
# saved unpacked and does not count. An input written both before and after the stop would
# need a value the graph never has: the stop is refused then, naming the fix.


@dataclass
class WriteOrder:
    """Filled while the metadata pass runs: per write (by aotkit.aot.trace's dispatch guard),
    the autograd node last created, whether the writing op created it and whether grad mode
    was on; and the last node seen saving a tensor (by :class:`SaveWatch`)."""

    writes: list[tuple[int, bool, bool, StorageWeakRef]] = field(default_factory=list)
    last_save: int = -1
    _last: int = -1

    def note(self, written: Iterable[torch.Tensor]) -> None:
        """An op is about to run, writing ``written``; autograd made its node already."""
        last = torch._C._autograd._get_sequence_nr() - 1
        created = last > self._last
        self._last = last
        grad = torch.is_grad_enabled()
        self.writes += [(last, created, grad, StorageWeakRef(t.untyped_storage()))
                        for t in written]

    def saw(self, node: Any) -> None:
        seq = node._sequence_nr()
        if seq > self.last_save and _saves(node):
            self.last_save = seq


class SaveWatch(TorchFunctionMode):
    """Shows :class:`WriteOrder` the nodes every torch call's outputs carry."""

    def __init__(self, order: WriteOrder) -> None:
        super().__init__()
        self.order = order

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch.compiler.is_dynamo_compiling():  # eager torch.cond's branches: Dynamo's trace
            return out
        with torch._C.DisableTorchFunction():  # reading grad_fn is a torch function too
            for t in pytree.tree_leaves(out):
                if (node := _grad_fn(t)) is not None:
                    self.order.saw(node)
        return out


def _grad_fn(t: Any) -> Any:
    if not (isinstance(t, torch.Tensor) and t.requires_grad):
        return None
    try:
        return t.grad_fn
    except RuntimeError:  # a view made under no_grad whose base was written since
        return None


@dataclass(frozen=True)
class EarlyStop:
    """The mutated inputs eager writes again at checkpoint's early stop (``repeated``), and
    those written both before and after its stop (``split``)."""

    repeated: frozenset[int] = frozenset()
    split: frozenset[int] = frozenset()


NO_EARLY_STOP = EarlyStop()


def early_stop(order: WriteOrder | None, f_args: Sequence[Any], f_outs: Sequence[Any],
               before: Sequence[Any]) -> EarlyStop:
    """Classify the written inputs among ``f_args``; ``before`` are their grad_fns before the
    function ran (the search stops there)."""
    if order is None or not order.writes:
        return NO_EARLY_STOP
    stop = {id(g): j for j, g in enumerate(before) if g is not None}
    saving = [node for t in [*f_outs, *f_args] for node in nodes_below(_grad_fn(t), stop)
              if _saves(node)]
    last_node = max(saving, key=lambda n: n._sequence_nr(), default=None)
    last = max(order.last_save, last_node._sequence_nr() if last_node is not None else -1)
    custom = last_node is not None and last_node._sequence_nr() == last and isinstance(
        last_node, torch.autograd.function.BackwardCFunction)
    storages = {StorageWeakRef(f.untyped_storage()): i for i, f in enumerate(f_args)
                if isinstance(f, torch.Tensor)}
    sides: dict[int, set[bool]] = {}
    for seq, created, grad, storage in order.writes:
        if (i := storages.get(storage)) is not None:
            repeated = seq < last or (seq == last and (created or (custom and not grad)))
            sides.setdefault(i, set()).add(repeated)
    return EarlyStop(frozenset(i for i, s in sides.items() if s == {True}),
                     frozenset(i for i, s in sides.items() if len(s) == 2))


_SAVED_NAMES: dict[type, list[str]] = {}


def _saves(node: Any) -> bool:
    """Whether an autograd node saved a tensor (packed it: what checkpoint counts)."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return bool(node._raw_saved_tensors) or _dynamo_function_saves(node)
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = [n for n in dir(node) if n.startswith("_saved_")]
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # written after it was saved: saved all the same
            return True
        if any(isinstance(v, torch.Tensor) and not _wrapped_number(v)
               for v in (value if isinstance(value, (tuple, list)) else (value,))):
            return True
    return False


def _wrapped_number(t: torch.Tensor) -> bool:
    """A Python number an op was given (``y * 2.0``'s other), which autograd saves without
    packing: the metadata pass's own values are functional tensors, a number wrapped by the
    op's argument parser is a plain 0-dim CPU tensor of a Python number's dtype."""
    return type(t) is torch.Tensor and t.dim() == 0 and t.device.type == "cpu" \
        and t.dtype in _NUMBER_DTYPES


_NUMBER_DTYPES = (torch.float64, torch.int64, torch.complex128, torch.bool)


def _dynamo_function_saves(node: Any) -> bool:
    """Dynamo's autograd_function_apply keeps a custom Function's saved values in a closure of
    its forward, with the positions of those it saved with ``save_for_backward`` (the others
    were stashed on ctx, which checkpoint does not count); unreadable: assumed saving."""
    cls = node._forward_cls
    if getattr(cls, "__module__", None) != "torch._functorch.autograd_function":
        return False
    forward = getattr(cls, "forward", None)
    cells = dict(zip(getattr(getattr(forward, "__code__", None), "co_freevars", ()),
                     getattr(forward, "__closure__", None) or (), strict=False))
    try:
        saved = cells["saved_values"].cell_contents or ()
        packed = set(cells["saved_for_backward_idx"].cell_contents)
    except (KeyError, ValueError, TypeError):
        return True
    return any(isinstance(v, torch.Tensor) for k, v in enumerate(saved) if k in packed)
