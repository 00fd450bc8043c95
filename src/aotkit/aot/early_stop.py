"""Which input writes eager repeats when ``torch.utils.checkpoint`` stops a recompute early.

See Note [Checkpoint's early stop].
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from aotkit.aot.ops import tensors_in
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
# nodes its outputs carry, or the nodes below them made since the calls before (a composite's
# bmm under its view node, a custom Function applied between calls), save a tensor (a branch
# kept nowhere, ``buf.copy_(y.pow(2).mean().detach())``, saved in eager all the same); the last
# saving node places eager's stop. A write before that node's op is repeated at the stop, and
# one by that op when it saves its result (saved after its kernel ran; ``addcmul_`` saves only
# its inputs, before). A custom Function saves when its forward has returned, so the writes in
# its forward (told by its apply on the Python stack) come before, and one right after it
# (``with no_grad(): steps += 1``) after; under Dynamo only what its save_for_backward saved
# counts (not what it stashed on ctx). A Python number an op was given (``y * 2.0``) is saved
# unpacked and does not count; a 0-dim tensor a torch call was given (a closed-over
# ``torch.tensor(3)``) is packed and does. The forward keeps the values of the inputs it writes,
# and the early stop applies those of the repeated writes. An input written both before and
# after the stop would need a value the graph never has: the stop is refused then, naming the
# fix. Saves eager makes outside the compiled function are not seen (README, known gaps).


@dataclass
class WriteOrder:
    """Filled while the metadata pass runs: per write (by aotkit.aot.trace's dispatch guard),
    the autograd node last created, whether the writing op created it and whether it runs in a
    custom Function's forward; the last node seen saving a tensor and the 0-dim tensors torch
    calls were given (by :class:`SaveWatch`)."""

    writes: list[tuple[int, bool, bool, StorageWeakRef]] = field(default_factory=list)
    last_save: _Save | None = None  # the saving node with the highest number seen
    given: dict[int, torch.Tensor] = field(default_factory=dict)  # held: ids stay unique
    _last: int = -1
    _seen_below: int = 0  # nodes numbered below were seen, or made before the pass
    _applies: int = 0  # custom Functions' applies on the stack when the pass began

    def note(self, written: Iterable[torch.Tensor]) -> None:
        """An op is about to run, writing ``written``; autograd made its node already."""
        last = torch._C._autograd._get_sequence_nr() - 1
        created = last > self._last
        self._last = last
        if written:
            inside = _function_applies() > self._applies
            self.writes += [(last, created, inside, StorageWeakRef(t.untyped_storage()))
                            for t in written]

    def saw(self, nodes: Iterable[Any]) -> None:
        """``nodes`` came out of a torch call: they and the nodes below made since those seen
        before (a composite's saving ops below its view, a custom Function applied between
        calls; not the nodes ops inside a custom Function's forward were made below)."""
        newest, made = self._seen_below, torch._C._autograd._get_sequence_nr()
        for node in nodes:
            for below in nodes_below(node, {}, numbered_from=self._seen_below):
                if _later(below, self.last_save) and _saves(below, self.given):
                    self.last_save = _Save.of(below)
                if below._sequence_nr() < made:  # not an AccumulateGrad (numbered last)
                    newest = max(newest, below._sequence_nr() + 1)
        self._seen_below = newest

    def begin(self) -> None:
        """The function starts (the inputs' histories are not its)."""
        self._seen_below = torch._C._autograd._get_sequence_nr()
        self._applies = _function_applies()


@dataclass(frozen=True)
class _Save:
    """A saving node, as much of it as the early stop reads: kept as numbers, since the node
    of a branch kept nowhere is freed before the stop is placed (torch 2.11 then refuses to
    read it)."""

    number: int
    custom: bool  # a custom Function's node
    saves_result: bool  # an op's node saving its result (after its kernel ran)

    @staticmethod
    def of(node: Any) -> _Save:
        custom = isinstance(node, torch.autograd.function.BackwardCFunction)
        return _Save(node._sequence_nr(), custom, not custom and any(
            name.startswith("_saved_result") for name in _saved_names(node)))


def _later(node: Any, than: _Save | None) -> bool:
    return than is None or node._sequence_nr() > than.number


def _function_applies() -> int:
    """How many custom Functions' apply calls the Python stack holds."""
    frame, count = sys._getframe(1), 0
    while frame is not None:
        count += frame.f_code is _APPLY_CODE
        frame = frame.f_back
    return count


_APPLY_CODE = torch.autograd.Function.apply.__func__.__code__


class SaveWatch(TorchFunctionMode):
    """Shows :class:`WriteOrder` the nodes every torch call's outputs carry."""

    def __init__(self, order: WriteOrder) -> None:
        super().__init__()
        self.order = order

    def __enter__(self) -> SaveWatch:
        self.order.begin()
        return super().__enter__()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch.compiler.is_dynamo_compiling():  # eager torch.cond's branches: Dynamo's trace
            return out
        with torch._C.DisableTorchFunction():  # reading grad_fn is a torch function too
            for t in tensors_in((args, kwargs)):
                if type(t) is torch.Tensor and t.dim() == 0:  # a constant, not a number
                    self.order.given[id(t)] = t
            self.order.saw(n for t in tensors_in(out) if (n := _grad_fn(t)) is not None)
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
    last = order.last_save
    for t in [*f_outs, *f_args]:
        for node in nodes_below(_grad_fn(t), stop):
            if _later(node, last) and _saves(node, order.given):
                last = _Save.of(node)
    storages = {StorageWeakRef(f.untyped_storage()): i for i, f in enumerate(f_args)
                if isinstance(f, torch.Tensor)}
    sides: dict[int, set[bool]] = {}
    for seq, created, inside, storage in order.writes:
        if (i := storages.get(storage)) is not None:
            sides.setdefault(i, set()).add(_before_stop(seq, created, inside, last))
    return EarlyStop(frozenset(i for i, s in sides.items() if s == {True}),
                     frozenset(i for i, s in sides.items() if len(s) == 2))


def _before_stop(seq: int, created: bool, inside: bool, last: _Save | None) -> bool:
    """Whether a write (see :meth:`WriteOrder.note`) comes before eager's stop at the save of
    ``last``: a write by the op that made ``last`` does when the op saves its result (saved
    after its kernel ran; inputs are saved before), one in a custom Function's forward when
    ``last`` is that Function's node (saved when its forward has returned)."""
    if last is None:
        return False
    if seq != last.number:
        return seq < last.number
    return inside if last.custom else created and last.saves_result


_SAVED_NAMES: dict[type, list[str]] = {}


def _saves(node: Any, given: Mapping[int, torch.Tensor]) -> bool:
    """Whether an autograd node saved a tensor (packed it: what checkpoint counts); ``given``
    are the 0-dim tensors torch calls were passed (see :func:`_wrapped_number`)."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        # A saved None (``ctx.save_for_backward(None)``) is not packed: its ``data`` is None,
        # read without unpacking (which would run checkpoint's recompute).
        return any(saved.data is not None for saved in node._raw_saved_tensors) \
            or _dynamo_function_saves(node)
    for name in _saved_names(node):
        try:
            value = getattr(node, name)
        except RuntimeError:  # written after it was saved: saved all the same
            return True
        if any(isinstance(v, torch.Tensor) and not _wrapped_number(v, given)
               for v in (value if isinstance(value, (tuple, list)) else (value,))):
            return True
    return False


def _saved_names(node: Any) -> list[str]:
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = [n for n in dir(node) if n.startswith("_saved_")]
    return names


def _wrapped_number(t: torch.Tensor, given: Mapping[int, torch.Tensor]) -> bool:
    """A Python number an op was given (``y * 2.0``'s other), which autograd saves without
    packing: the metadata pass's own values are functional tensors, a number wrapped by the
    op's argument parser is a plain 0-dim CPU tensor of a Python number's dtype that no torch
    call was given (a closed-over ``torch.tensor(3)`` is one, and is packed)."""
    return type(t) is torch.Tensor and t.dim() == 0 and t.device.type == "cpu" \
        and t.dtype in _NUMBER_DTYPES and given.get(id(t)) is not t


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
