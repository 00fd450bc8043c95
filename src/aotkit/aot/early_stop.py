"""Which input writes eager repeats when ``torch.utils.checkpoint`` stops a recompute early.

See Note [Checkpoint's early stop].
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

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
# rise with each node) and the storages the op writes; the last node of the function's autograd
# graph that saves a tensor places eager's stop. A write before that node's op or in it (the
# results are saved after the kernel ran) is repeated at the stop: the forward keeps the
# values of the inputs it writes, and the early stop applies those. An input written both
# before and after the stop would need a value the graph never has: the stop is refused then,
# naming the fix. Saves outside the outputs' history (an unused intermediate) are not seen.


@dataclass
class WriteOrder:
    """Filled while the metadata pass runs (by aotkit.aot.trace's dispatch guard): per write,
    the autograd node last created and whether the writing op created it."""

    writes: list[tuple[int, bool, StorageWeakRef]] = field(default_factory=list)
    _last: int = -1

    def note(self, written: Iterable[torch.Tensor]) -> None:
        """An op is about to run, writing ``written``; autograd made its node already."""
        last = torch._C._autograd._get_sequence_nr() - 1
        created = last > self._last
        self._last = last
        self.writes += [(last, created, StorageWeakRef(t.untyped_storage())) for t in written]


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
    last = max((node._sequence_nr() for t in f_outs if isinstance(t, torch.Tensor)
                for node in nodes_below(t.grad_fn, stop) if _saves(node)), default=None)
    storages = {StorageWeakRef(f.untyped_storage()): i for i, f in enumerate(f_args)
                if isinstance(f, torch.Tensor)}
    sides: dict[int, set[bool]] = {}
    for seq, created, storage in order.writes:
        if (i := storages.get(storage)) is not None:
            repeated = last is not None and (seq < last or (seq == last and created))
            sides.setdefault(i, set()).add(repeated)
    return EarlyStop(frozenset(i for i, s in sides.items() if s == {True}),
                     frozenset(i for i, s in sides.items() if len(s) == 2))


_SAVED_NAMES: dict[type, list[str]] = {}


def _saves(node: Any) -> bool:
    """Whether an autograd node saved a tensor (packed it: what checkpoint counts)."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return bool(node._raw_saved_tensors)
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = [n for n in dir(node) if n.startswith("_saved_")]
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # written after it was saved: saved all the same
            return True
        if any(isinstance(v, torch.Tensor)
               for v in (value if isinstance(value, (tuple, list)) else (value,))):
            return True
    return False
