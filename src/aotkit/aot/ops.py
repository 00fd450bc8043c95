"""How particular ATen ops are traced: eager's checks that functionalization drops (writes to
overlapping memory, dtypes of results written in place), eager's random streams (dropout), and
ops FX cannot print. Used by :mod:`aotkit.aot.trace` while it traces."""

from __future__ import annotations

import bisect
import functools
import inspect
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._prims_common import (
    is_contiguous_for_memory_format_or_false,
    is_non_overlapping_and_dense_or_false,
    suggest_memory_format,
)
from torch.fx.experimental.symbolic_shapes import (
    guard_or_false,
    guard_or_true,
    statically_known_true,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _detect_infra_mode,
    _disable_current_modes,
)

from aotkit import compat
from aotkit.aot.frames import current_user_line
from aotkit.aot.simplify import known_equal
from aotkit.aot.subclass import is_subclass
from aotkit.errors import UnsupportedError


# Note [Writes to overlapping memory]
# A write through an expand()ed view (stride 0, size > 1) hits one element several times. Eager
# raises for most ops ("more than one element of the written-to tensor refers to a single memory
# location"), but not for fill_, zero_, index_put_ or masked_fill_. Functionalization turns any
# such write into a new value for the view and regenerates the base from it by summing over the
# expanded dimension: `x.expand(3).fill_(1)` leaves x == 3, where eager leaves 1. Both PyTorch's
# aot_function and ours gave that silently. A sliding window (``unfold``, ``as_strided`` with
# strides smaller than the rows they step over) is the same without a zero stride: eager writes
# it element by element, later elements landing on earlier ones, and never checks it; the
# graph's new value, copied back, left other values in the shared memory. Every write to a
# self-overlapping tensor is refused while tracing, with the fix eager's own warning suggests.
def is_expanded(t: torch.Tensor) -> bool:
    """Whether ``t`` has a dimension of stride 0 and size > 1 (an ``expand()``); with a size
    that cannot be told (unbacked), whether it may have."""
    return any(
        isinstance(stride, int) and stride == 0 and guard_or_true(size > 1)
        for size, stride in zip(t.shape, t.stride(), strict=True)
    ) and guard_or_true(t.numel() > 0)


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether several elements of ``t`` may share memory. With concrete sizes, dimensions in
    order of stride must each step past everything the smaller ones reach; a layout that
    interleaves without overlap (rare) counts as overlapping. Symbolic: expanded only."""
    if is_expanded(t):
        return True
    dims = [(st, sz) for sz, st in zip(t.shape, t.stride(), strict=True)]
    if not all(type(v) is int for dim in dims for v in dim) or t.numel() == 0:
        return False
    dims = sorted(dim for dim in dims if dim[1] != 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one storage share an element: first by the byte ranges they span,
    then, where those intersect (``kv[:, 0]`` and ``kv[:, 1]`` interleave), element by element
    for tensors of one element size and at most ``_EXACT_LIMIT`` elements."""
    return a.numel() != 0 and b.numel() != 0 and _meet(geometry(a), geometry(b))


_EXACT_LIMIT = 1 << 22


def bytes_spanned(t: torch.Tensor) -> tuple[Any, Any]:
    """The storage bytes from ``t``'s first element to one past its last (not empty)."""
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    start = t.storage_offset() * t.element_size()
    return start, start + extent * t.element_size()


def _geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.shape), t.stride(), t.storage_offset()


@functools.lru_cache(maxsize=256)
def _share_elements(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two strided layouts in one storage (same element size) address a common element;
    computed once per pair of layouts."""
    return bool(torch.isin(_offsets(a), _offsets(b)).any())


def _offsets(geometry: tuple[Any, ...]) -> torch.Tensor:
    """The storage offsets of a strided layout's elements, flat."""
    size, stride, offset = geometry
    index = torch.zeros((), dtype=torch.long)
    for n, st in zip(size, stride, strict=True):
        index = index.unsqueeze(-1) + torch.arange(n) * st
    return index.flatten() + offset


#: A strided layout in a storage: sizes, strides, offset and element size.
Geometry = tuple[tuple[int, ...], tuple[int, ...], int, int]


def geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.element_size()


@functools.lru_cache(maxsize=64)
def any_shared(layouts: tuple[Geometry, ...], roles: tuple[Any, ...],
               matters: Callable[[Any, Any], bool]) -> bool:
    """Whether two of ``layouts`` (of one storage, not empty) whose ``roles`` ``matters`` share
    an element. All at once, element by element, where they have one element size and at
    most ``_EXACT_LIMIT`` elements each (N interleaved columns: not N^2 pairs), else pair by
    pair; computed once per set of layouts (the same views at every call)."""
    sizes = [math.prod(g[0]) for g in layouts]
    if len({g[3] for g in layouts}) > 1 or max(sizes) > _EXACT_LIMIT:
        return any(matters(roles[i], roles[j]) and _meet(a, b)
                   for i, a in enumerate(layouts) for j, b in enumerate(layouts) if i < j)
    flat = torch.cat([_offsets(g[:3]) for g in layouts])
    owners = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
    flat, order = torch.sort(flat, stable=True)
    owners = owners[order]
    shared = (flat[1:] == flat[:-1]) & (owners[1:] != owners[:-1])
    keep = torch.isin(flat, flat[1:][shared])
    last, seen = None, set()
    for value, owner in zip(flat[keep].tolist(), owners[keep].tolist(), strict=True):
        if value != last:
            last, seen = value, set()
        if any(matters(roles[other], roles[owner]) for other in seen if other != owner):
            return True
        seen.add(owner)
    return False


def _meet(a: Geometry, b: Geometry) -> bool:
    """Whether two layouts may share an element: the bytes they span intersect, and, for one
    element size and at most ``_EXACT_LIMIT`` elements, an element is common."""
    (a0, a1), (b0, b1) = (_span(g) for g in (a, b))
    if not (a0 < b1 and b0 < a1):
        return False
    if a[3] != b[3] or max(math.prod(a[0]), math.prod(b[0])) > _EXACT_LIMIT:
        return True
    return _share_elements(a[:3], b[:3])


def _span(g: Geometry) -> tuple[int, int]:
    extent = sum((n - 1) * abs(s) for n, s in zip(g[0], g[1], strict=True)) + 1
    return g[2] * g[3], (g[2] + extent) * g[3]


# Note [Foreach writes to shared memory]
# An in-place foreach op (``torch._foreach_add_(params, grads)``, what optimizers' foreach
# implementations call) updates its list's tensors one after another in eager, so a tensor
# listed twice (a tied weight) or overlapping views get every update. Functionalized, each
# result is computed from the old values and the last write wins: one update, silently
# (PyTorch's AOT autograd too). The trace refuses such a call, but for ops whose results do
# not read the old values (``_foreach_zero_``, ``_foreach_copy_``: the writes back in order
# give eager's values); and a call reading a tensor it wrote at an earlier position (``_foreach_
# copy_([a, s], [s, a])``: eager reads the new value) is refused too. The exact check (interleaved
# views share no element) computes on real index tensors; with symbolic sizes only one view
# listed twice is told, without adding a guard, and a read is taken to share memory with an
# earlier write unless their byte spans are apart without a guard (``u[0]`` after ``u[1:]``).
# Only aten's foreach ops are checked for reads after writes: a custom op writing a list may
# read all its inputs first.
_OVERWRITING_FOREACH = (torch.ops.aten._foreach_zero_.default,
                        torch.ops.aten._foreach_copy_.default)


def check_foreach_writes(func: torch._ops.OpOverload, args: Sequence[Any],
                         written: Sequence[torch.Tensor], what: str) -> None:
    """Refuse an in-place op writing several tensors that eager's one-by-one updates would give
    other values than the functional graph (Note [Foreach writes to shared memory])."""
    if (pair := read_after_written(func, written, args)) is not None:
        i, j, single = pair
        read = f"as the one tensor it applies to every number, for number {j}" if single \
            else f"as number {j} of another list"
        raise UnsupportedError(
            f"{what} writes in place ({func}) tensor number {i} of a list and then reads "
            f"memory it shares (or, where symbolic sizes cannot tell, may share), {read}: eager "
            f"reads the new value, the functional graph the old one.\n  at {current_user_line()}\n"
            "Fix: pass a .clone() of the tensor read, or use separate calls.")
    if func not in _OVERWRITING_FOREACH and (pair := overlapping_members(written)) is not None:
        raise UnsupportedError(
            f"{what} writes in place ({func}) to two tensors that share memory (numbers "
            f"{pair[0]} and {pair[1]} of those it writes: one tensor listed twice, a tied "
            "weight, or overlapping views): eager applies each update in turn, the functional "
            f"graph only the last.\n  at {current_user_line()}\n"
            + ("Fix: list each tensor once (deduplicate an optimizer's parameters), or use "
               "foreach=False." if "_foreach_" in func.__name__ else
               "Fix: pass tensors that do not share memory (a .clone() of one), and copy the "
               "result back after the call if the caller needs it there."))


def read_after_written(func: torch._ops.OpOverload, written: Sequence[torch.Tensor],
                       args: Sequence[Any]) -> tuple[int, int, bool] | None:
    """Positions ``(i, j, single)`` where an in-place foreach op reads, at ``j``, a tensor
    sharing an element with the one it wrote at an earlier ``i`` (``_foreach_copy_([a, s], [s,
    a])``, or ``_foreach_mul_([a, b], a)``, whose one tensor, ``single``, is read at every
    position): eager reads the new value, the functional graph the old one. Where symbolic
    sizes cannot place the two, they are taken to share one. Other ops writing several tensors
    (a custom op) may read all their inputs first: not checked."""
    if not func._schema.name.startswith("aten::_foreach_"):
        return None
    by_storage: dict[Any, _Written] = {}
    for i, w in enumerate(written):
        by_storage.setdefault(compat.StorageWeakRef(w.untyped_storage()), _Written()).tensors[i] = w
    # The one tensor a foreach op applies at every position is its ``other`` (addcmul_'s
    # ``scalars`` tensor is read into numbers first).
    names = [a.name for a in func._schema.arguments[1:]] if isinstance(args[0], (list, tuple)) \
        else []
    for k, sources in enumerate(args[1:]):
        single = k < len(names) and names[k] == "other" and isinstance(sources, torch.Tensor)
        if single:  # read at every position: after the first write it shares memory with
            sources = [*[None] * (len(written) - 1), sources]
        elif not isinstance(sources, (list, tuple)):
            continue
        for j, r in enumerate(sources):
            group = by_storage.get(compat.StorageWeakRef(r.untyped_storage())) \
                if isinstance(r, torch.Tensor) else None
            if group is not None and (i := group.first_sharing(r, before=j)) is not None:
                return i, i + 1 if single else j, single
    return None


class _Written:
    """The tensors an op writes in one storage, by position, and their byte spans sorted."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self._spans: list[tuple[int, int, int]] | None = None  # (start, end, position)
        self._reach: list[int] = []  # the furthest end of the spans up to each
        self._static: bool | None = None

    def first_sharing(self, r: torch.Tensor, before: int) -> int | None:
        """The first position before ``before`` whose tensor shares an element with ``r``."""
        if self._static is None:
            self._static = _static(*self.tensors.values())
        if not (self._static and _static(r)):
            return next((i for i, w in self.tensors.items()
                         if i < before and not _apart(w, r)), None)
        if r.numel() == 0:
            return None
        spans = self._sorted()
        start, end = bytes_spanned(r)
        found = []
        k = bisect.bisect_left(spans, (end,)) - 1  # the last span starting before r ends
        while k >= 0 and self._reach[k] > start:
            if spans[k][1] > start and spans[k][2] < before:
                found.append(spans[k][2])
            k -= 1
        with _disable_current_modes():  # the exact check computes on real index tensors
            return min((i for i in found if may_overlap(self.tensors[i], r)), default=None)

    def _sorted(self) -> list[tuple[int, int, int]]:
        if self._spans is None:
            self._spans = sorted((*bytes_spanned(t), i) for i, t in self.tensors.items()
                                 if t.numel() != 0)
            self._reach = list(itertools.accumulate((end for _, end, _ in self._spans), max))
        return self._spans


def _apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of symbolic sizes span disjoint bytes: provably, or else for the
    sizes traced with, under a guard (``M[0]`` and ``M[-1]``: apart for every M of two rows or
    more, which the solver does not prove)."""
    (a0, a1), (b0, b1) = bytes_spanned(a), bytes_spanned(b)
    return statically_known_true(a1 <= b0) or statically_known_true(b1 <= a0) \
        or guard_or_false(a1 <= b0) or guard_or_false(b1 <= a0)


def _static(*tensors: torch.Tensor) -> bool:
    """Whether the layouts are plain ints, which the exact overlap check can compare."""
    return all(type(v) is int for t in tensors for g in [_geometry(t)]
               for v in (*g[0], *g[1], g[2]))


def overlapping_members(written: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """Two positions in ``written`` whose tensors share an element, if any. With symbolic sizes
    only one view listed twice is found (compared without adding guards)."""
    by_storage: dict[Any, list[int]] = {}
    for k, t in enumerate(written):
        by_storage.setdefault(compat.StorageWeakRef(t.untyped_storage()), []).append(k)
    for members in by_storage.values():
        if len(members) < 2:
            continue
        geometries = {k: _geometry(written[k]) for k in members}
        if _static(*(written[k] for k in members)):
            with _disable_current_modes():  # the exact check computes on real index tensors
                pair = _overlapping_pair([written[k] for k in members])
            if pair is not None:
                return members[pair[0]], members[pair[1]]
            continue
        for i, k in enumerate(members):
            for j in members[i + 1:]:
                if all(known_equal(a, b) for a, b in zip(
                        geometries[k][:2], geometries[j][:2], strict=True)) and \
                        statically_known_true(geometries[k][2] == geometries[j][2]):
                    return k, j
    return None


def _overlapping_pair(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """Positions of two of ``tensors`` (one storage, concrete sizes) sharing an element."""
    spans = sorted((*bytes_spanned(t), k) for k, t in enumerate(tensors) if t.numel() != 0)
    for i, (_, end, k) in enumerate(spans):
        for start, _, j in spans[i + 1:]:
            if start >= end:
                break
            if may_overlap(tensors[k], tensors[j]):
                return min(k, j), max(k, j)
    return None


# Note [Writes through unfold windows]
# Functionalization puts a write through ``y.unfold(dim, size, step)`` back into y with
# ``unfold_backward``, a gradient's formula, which writes zeros wherever no window reaches:
# ``y.unfold(0, 2, 2).mul_(10)`` of a y of 5 elements zeroed y[4], and steps longer than the
# windows zeroed every gap, where eager leaves those elements as they were (PyTorch's
# aot_function too). The tracing guard notes the length each unfold splits, and a write
# through a view made by an unfold of the same (dim, size, step) is refused if the windows
# leave elements of that length uncovered (a step longer than the windows, or a last window
# short of the end). Decided at the write, so an unfold only read adds no guard on symbolic
# lengths; with unbacked ones the windows are taken to leave gaps. Windows that tile their
# dimension are written through as in eager. Ops inside a higher-order op's body (a branch of
# torch.cond) are not seen by the guard, so such a write there is not refused.
UnfoldLengths = dict[tuple[Any, ...], list[Any]]


def note_unfold(args: Sequence[Any], lengths: UnfoldLengths) -> None:
    """Note the length an ``aten.unfold`` call splits (Note [Writes through unfold windows])."""
    t, dim, size, step = args[:4]
    lengths.setdefault((dim, size, step), []).append(t.shape[dim] if t.dim() else 1)


def through_unfold_gaps(t: torch.Tensor, lengths: UnfoldLengths) -> bool:
    """Whether ``t``, a functional tensor, is a view made by an unfold whose windows may leave
    elements uncovered (Note [Writes through unfold windows])."""
    if not lengths:
        return False
    for meta in torch._C._functionalization.get_view_meta_sequence(t.elem):
        if type(meta).__name__ != "unfold_ViewMeta":
            continue
        _, size, step = key = tuple(meta.as_tuple()[-3:])
        if any(guard_or_true(step > size) or guard_or_true((n - size) % step != 0)
               for n in lengths.get(key, ())):
            return True
    return False


def written_by(func: torch._ops.OpOverload, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors ``func`` writes to, from its schema (``Tensor(a!)``); ``native_batch_norm``
    in training writes its running statistics without saying so."""
    if func is torch.ops.aten.native_batch_norm.default and args[5]:
        return [t for t in args[3:5] if isinstance(t, torch.Tensor)]
    return tensors_in([args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
                       for i, name, kwarg_only in _written_arguments(func)])


@functools.cache
def _written_arguments(func: torch._ops.OpOverload) -> tuple[tuple[int, str, bool], ...]:
    """Position, name and keyword-onliness of each argument ``func`` writes (read once: a
    schema's argument list is made anew at every access)."""
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (tuples, lists and dicts of them), in
    order; per traced op, where pytree's general flattening took a tenth of a trace."""
    found: list[torch.Tensor] = []
    stack = [tree]
    containers = 0  # bounded: a list holding itself reaches an op (``x == L``), unread by it
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple, dict)) and (containers := containers + 1) < 65536:
            stack.extend(reversed(x.values() if isinstance(x, dict) else x))
    return found


# Note [Dtypes of out= arguments]
# Functionalization turns ``torch.mul(a, b, out=o)`` into ``mul`` and a copy into o, and a copy
# casts: an int64 ``o`` silently got float results truncated, where eager refuses ("result type
# Float can't be cast to the desired output type Long"). Before such an op is functionalized it
# runs on meta tensors of the same dtypes and ranks (one element per dimension), which raise
# eager's dtype errors; errors about anything else are left to the traced op. (Torch.compile's
# fake tensors run out= ops unfunctionalized, so Dynamo graphs never reach this.) In-place ops
# likewise: ``int_tensor.mul_(2.5)`` became ``mul`` and a truncating copy, ``bool.mul_(2)`` and
# ``half.mul_(1j)`` too, so an in-place op given an argument of another dtype (a float scalar
# for an integer tensor, a wider tensor) runs the same way, on one-element CPU tensors: meta
# kernels of in-place ops skip the cast check. Random ops are left out (they would draw).
def writes_out_argument(func: torch._ops.OpOverload) -> bool:
    return any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
               for a in func._schema.arguments)


def may_not_cast_in_place(func: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    """An in-place op whose other arguments have another dtype than ``self`` (a Python float
    for an integer tensor): its result may not cast back (Note [Dtypes of out= arguments])."""
    schema = func._schema.arguments
    if not (args and schema and schema[0].alias_info is not None and schema[0].alias_info.is_write
            and isinstance(args[0], torch.Tensor)) or torch.Tag.inplace_view in func.tags \
            or torch.Tag.nondeterministic_seeded in func.tags \
            or func.overloadpacket is torch.ops.aten.copy_:
        return False
    dtype = args[0].dtype
    return any(x.dtype != dtype if isinstance(x, torch.Tensor) else _wider_scalar(x, dtype)
               for x in (*args[1:], *kwargs.values()))


def _wider_scalar(x: Any, dtype: torch.dtype) -> bool:
    """A Python number of a kind ``dtype`` cannot hold (a float for an integer tensor)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return dtype is torch.bool
    if isinstance(x, float):
        return not (dtype.is_floating_point or dtype.is_complex)
    return isinstance(x, complex) and not dtype.is_complex


def check_out_dtype(func: torch._ops.OpOverload, args: Any, kwargs: Any, device: str) -> None:
    """See Note [Dtypes of out= arguments]."""
    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.zeros((1,) * x.dim(), dtype=x.dtype, device=device)
        return x

    with _disable_current_modes():
        try:
            func(*pytree.tree_map(meta, args), **pytree.tree_map(meta, kwargs))
        except (RuntimeError, TypeError) as exc:
            if "cast" in str(exc) or "dtype" in str(exc):
                raise RuntimeError(f"{exc}\n  at {current_user_line()}") from None
        except Exception:  # not a dtype error: the traced op reports it
            pass


class EagerOps(torch.overrides.TorchFunctionMode):
    """Ops traced to give eager's values: dropout, resize_ (Note [resize_ to the same size]),
    one_hot's layout, and the gradient of a whole-tensor max/min/median (Note [Gradients of a selected element]).

    Training-mode dropout: ``aten.native_dropout`` draws the same random numbers as eager's
    dropout, on a mask laid out like the input. Traced without the Python dispatcher, ``aten.dropout``'s C++ composite would
    draw them with a functional ``bernoulli`` laid out contiguously: for a non-contiguous input
    (a transposed attention output) they would land on other elements than in eager. Eager's
    CPU dropout multiplies the input by a noise tensor of the input's dtype (the mask divided
    by ``1 - p`` in that dtype) and its backward multiplies the gradient by that noise;
    native_dropout scales by ``1 / (1 - p)`` instead, which rounds differently (one float32
    ulp off for p = 0.15, 0.45, ...; more in bfloat16 and float16), so on CPU the noise is
    traced as eager makes it; at p = 1 eager multiplies by zero and draws nothing. Eval mode
    and p = 0 return the input itself, as eager does (the Python decomposition, which symbolic
    sizes trace with, returns a copy: a write into the result missed the input), and a call
    inside a torch.func transform (vmap, grad) keeps the composite: eager runs functorch's own
    dropout, a
    contiguous ``bernoulli`` draw: native_dropout's draws in the input's layout landed on
    other elements for a non-contiguous input.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout or func is torch.dropout:
            call = _DROPOUT_SIGNATURES[func].bind(*args, **kwargs).arguments
            p, train, x = call["p"], call.get("training", call.get("train")), call["input"]
            if not call.get("inplace") and 0 <= p <= 1 \
                    and torch._C._functorch.peek_interpreter_stack() is None:
                return _dropout(x, p) if train and p > 0 \
                    and not statically_known_true(x.numel() == 0) else x  # eager: x itself
        elif func in _RNNS and not kwargs and (torch._C._dispatch_tls_is_dispatch_key_included(
                torch._C.DispatchKey.PythonDispatcher) or torch.is_inference_mode_enabled()):
            if _layers_with_dropout(args):
                return _rnn_by_layer(func, args)
            out, *states = func(*args)  # torch 2.11's decomposition: (layers, directions, ...)
            return (out, *(s.flatten(0, -3) if s.dim() == 4 else s for s in states))
        elif func in _SELECTING and len(args) == 1 and not kwargs and _eager_cpu_select(args[0]):
            return _Selected.apply(args[0], func)
        elif func is torch.nn.functional.one_hot \
                and torch._C._functorch.peek_interpreter_stack() is None:  # (vmap: its own)
            return func(*args, **kwargs).contiguous()  # eager scatters into zeros; traced, it
            # compares the indices with an arange in their layout
        elif func is torch.Tensor.resize_ and kwargs.get("memory_format") is None \
                and not args[0].requires_grad \
                and tuple(args[0].shape) == requested_size(func, args, kwargs):
            return args[0]
        return func(*args, **kwargs)


# Note [Gradients of a selected element]
# The gradient of a whole-tensor max, min, median or nanmedian goes to the selected elements.
# Eager's CPU kernel fills zeros with it there; for tensor subclasses (the trace's functional
# tensors) and on CUDA the formula multiplies a mask by it instead, and 0 * inf is NaN: a
# non-finite gradient (``x.max().sqrt()`` at 0) made every element's gradient NaN where eager
# has one inf among zeros (PyTorch's aot_eager too). On CPU such calls are traced through
# _Selected, whose backward is eager's CPU formula (ties share the gradient; a NaN result
# selects the NaNs).
_SELECTING = frozenset({torch.max, torch.Tensor.max, torch.min, torch.Tensor.min, torch.median,
                        torch.Tensor.median, torch.nanmedian, torch.Tensor.nanmedian})


def _eager_cpu_select(x: torch.Tensor) -> bool:
    """Whether eager's CPU formula differentiates a selection of ``x`` (Note [Gradients of a
    selected element]): reverse mode only (_Selected has no forward-mode formula), outside
    torch.func transforms, not a subclass of the user's (whose eager formula is the mask's)."""
    return x.requires_grad and x.device.type == "cpu" and torch.is_grad_enabled() \
        and torch._VF._unpack_dual(x, 0).tangent is None and not is_subclass(x) \
        and torch._C._functorch.peek_interpreter_stack() is None


class _Selected(torch.autograd.Function):
    """``func(x)``, a whole-tensor selection, with eager's CPU gradient (Note [Gradients of a
    selected element])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, func: Any) -> torch.Tensor:  # type: ignore[override]
        out = func(x)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        x, out = ctx.saved_tensors
        selected = torch.where(out.isnan(), x.isnan(), x == out)
        return torch.where(selected, grad / selected.sum(), torch.zeros((), dtype=x.dtype)), None


def requested_size(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The size ``resize_`` or ``resize_as_`` is called with."""
    if func is torch.Tensor.resize_as_:
        other = args[1] if len(args) > 1 else kwargs["the_template"]
        return tuple(other.shape)
    sizes = args[1:] or (kwargs.get("size", ()),)
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):  # torch.Size is a tuple
        return tuple(sizes[0])
    return tuple(sizes)


# Note [resize_ to the same size]
# Eager's resize_ to the tensor's own size changes nothing, strides included: a transposed or
# stepped tensor stays as it is. Functionalization records it as a resize, after which the
# value is contiguous: the function went on computing with the elements read in storage order
# (``x.t().resize_(3, 2).sum(0)`` summed the wrong elements) and the caller's tensor was given
# contiguous strides (PyTorch's aot_function too). The call is dropped before it is traced. A
# resize to another size gives contiguous strides in eager as well, which the trace gets right.


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """See :class:`EagerOps`. At p = 1 eager multiplies by zero and draws nothing (native
    dropout would draw, moving the generator; its mask divided by 1 - p made NaNs)."""
    if p >= 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    out, mask = torch.ops.aten.native_dropout.default(x, p, True)
    if x.device.type == "cpu":
        return x * mask.to(x.dtype).div(1 - p)
    return out


# Note [Dropout between RNN layers]
# Traced with the Python dispatcher (symbolic sizes), or under inference_mode (no autograd key
# decomposes them in C++ first), ``aten.lstm``, ``gru`` and ``rnn_*`` run PyTorch's Python
# decomposition, whose test for dropout between layers is never true (2.13): a two-layer LSTM
# with dropout=0.5 trained as if in eval mode, silently (PyTorch's aot_module too). So a
# multi-layer call with dropout in training runs one layer at a time, as eager's kernel does,
# with eager's dropout on each layer's output but the last (the same draws, in the same order).
_RNNS = frozenset({torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu})


def _layers_with_dropout(args: Sequence[Any]) -> bool:
    """(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first),
    or packed: (data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, ...)."""
    num_layers, dropout, train = args[4:7] if _unpacked(args) else args[5:8]
    return bool(train) and dropout > 0 and num_layers > 1


def _unpacked(args: Sequence[Any]) -> bool:
    """Not the packed overload, whose second argument is the int64 batch sizes (never hx)."""
    return not (isinstance(args[1], torch.Tensor) and args[1].dtype == torch.int64)


def _rnn_by_layer(func: Any, args: Sequence[Any]) -> Any:
    """See Note [Dropout between RNN layers]."""
    unpacked = _unpacked(args)
    x, hx, params = (args[0], args[1], args[2]) if unpacked else (args[0], args[2], args[3])
    num_layers, dropout = (args[4], args[5]) if unpacked else (args[5], args[6])
    states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    directions = 2 if (args[7] if unpacked else args[8]) else 1
    per_layer = len(params) // num_layers
    finals: list[list[torch.Tensor]] = [[] for _ in states]
    for layer in range(num_layers):
        rows = slice(layer * directions, (layer + 1) * directions)
        state = [s[rows] for s in states]
        weights = params[layer * per_layer:(layer + 1) * per_layer]
        rest = (1, 0.0, *(args[6:] if unpacked else args[7:]))
        if unpacked:
            x, *new = func(x, tuple(state) if len(state) > 1 else state[0], weights, args[3], *rest)
        else:
            x, *new = func(x, args[1], tuple(state) if len(state) > 1 else state[0], weights,
                           args[4], *rest)
        for final, s in zip(finals, new, strict=True):
            # torch 2.11's oneDNN decomposition returns (layers, directions, batch, hidden)
            final.append(s.flatten(0, -3))
        if layer < num_layers - 1:
            x = _dropout(x, dropout)
    return (x, *(torch.cat(final) for final in finals))


def _dropout_signatures() -> dict[Any, inspect.Signature]:
    def vf_dropout(input: Any, p: float, train: bool) -> Any: ...

    return {torch.nn.functional.dropout: inspect.signature(torch.nn.functional.dropout),
            torch.dropout: inspect.signature(vf_dropout)}


_DROPOUT_SIGNATURES = _dropout_signatures()


# Note [Ops FX cannot print]
# FX prints an ATen call as ``torch.ops.aten.random.from(...)``, which is no Python when the
# overload's name is a keyword: ``x.random_(0, 10)`` failed to trace with a SyntaxError. Such an
# overload is decomposed into ops FX can print that draw the same numbers: ATen's kernel takes
# one draw modulo ``to - from`` (the same draw whatever the dtype), adds ``from`` in 64-bit
# integers and casts, so ``random.to`` on an int64 tensor laid out like ``x``, plus ``from``,
# cast to ``x``'s dtype, is eager's result bit for bit; eager's argument checks are repeated.
# A user's decomposition wins.
def _random_from(x: torch.Tensor, start: int, end: int | None, *,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    if end is None or end - start > torch.iinfo(torch.int64).max:
        raise UnsupportedError(
            f"random_({start}, {end}) cannot be traced: FX cannot print aten.random.from, and "
            "no other op draws a range this wide.\nFix: pass an upper bound less than 2**63 "
            "above the lower one.")
    _check_random_range(start, end, x.dtype)
    draws = torch.ops.aten.random.to(torch.empty_like(x, dtype=torch.int64), end - start,
                                     generator=generator)
    return (draws + start).to(x.dtype)


def _check_random_range(start: int, end: int, dtype: torch.dtype) -> None:
    """Eager's checks of ``random_(from, to)``; beyond the integers a floating dtype holds
    exactly, where eager only warns, its draws are not reproduced: refused."""
    if start >= end:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={start} "
                           f">= to={end}")
    if dtype.is_floating_point:
        digits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # 24 for float32
        if start < -(2**digits) or end - 1 > 2**digits:
            raise UnsupportedError(
                f"random_({start}, {end}) on a {dtype} tensor reaches beyond the integers "
                f"{dtype} holds exactly (±2**{digits}), where eager warns "
                "and its draws cannot be traced.\nFix: draw into an int64 tensor and convert, "
                "or use a narrower range.")
        return
    low, high = (0, 1) if dtype is torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if not low <= start <= high:
        raise RuntimeError(f"from is out of bounds for {dtype}")
    if not low <= end - 1 <= high:
        raise RuntimeError(f"to - 1 is out of bounds for {dtype}")


# Note [Kernels whose fake strides differ]
# A graph is traced on fake tensors and later ops are chosen from the strides the fake kernels
# give (``linear`` on a 3-d tensor becomes ``view`` + ``mm`` only where a view is possible). For
# inputs that are dense but laid out otherwise than contiguously, some fake kernels give other
# strides than the real CPU kernels: batch norm (forward and backward) keeps a transposed
# input's stride order where the real kernel returns the input's suggested memory format
# (``BatchNorm1d(h.transpose(1, 2))``, the usual way to feed it a (batch, time, channels)
# tensor); dropout's and activations' backwards of a transposed gradient, pads' backwards,
# channel_shuffle and roll of channels_last tensors, a few binary ops of mixed layouts, the
# other way round; inputs with gaps (``x[:, ::2]``) likewise. The graph's ``view`` then failed
# at run time ("view size is not compatible"), with PyTorch's aot_function and aot_eager too.
# (Found by comparing real and fake strides over every OpInfo sample in transposed, reversed
# and channels_last layouts, and by a fuzzer of random programs on such layouts.) These ops get
# their inputs made contiguous first (not expanded ones, which a copy would blow up), in the
# graph, in the memory format their real kernel returns (contiguous): fake and real results are
# then laid out alike. A copy, which most of these kernels make inside anyway. Batch norm's
# kernels reduce in an order that depends on the input's layout (a copy changed the last bits
# of its results and running statistics), so batch norm runs on its inputs as they are and its
# result is made contiguous in the input's suggested memory format after, where the fake
# kernel laid it out otherwise (``LAID_OUT_AFTER``). This happens in the tracing guard's dispatch
# (aotkit.aot.trace), so the metadata pass, which runs no decompositions, sees the layouts the
# graph will have, and in compiled autograd's lowering of backward formulas (``EagerLayouts``).
# The elementwise ones among them (_ONE_LAYOUT_AGREES) differ only for inputs of mixed layouts:
# inputs all in one dense layout (a channels_last CNN's activation backward) keep it, as in
# eager; copied, they cost a channels_last network two copies per activation, its outputs and
# gradients came back contiguous, and a view relying on eager's layout was refused.
# ``constant_pad_nd`` differs only under symbolic pads: eager trims (all pads <= 0, as a pad's
# backward always does) by a narrowed copy in the input's stride order, the fake kernel of a
# symbolic pad returns the input's suggested memory format (a permuted gradient of
# ``F.pad(x.view(...)).permute(...)`` then failed the view's backward under dynamic shapes).
def _relaid(t: Any, gaps: bool) -> bool:
    """A strided tensor whose elements do not overlap (a nested tensor has no strides to lay
    out; an expanded one would be copied whole), without gaps unless ``gaps``."""
    return isinstance(t, torch.Tensor) and not t.is_nested and t.layout == torch.strided \
        and not is_expanded(t) and (gaps or is_non_overlapping_and_dense_or_false(t))


def _laid_out(t: Any, layout: torch.memory_format, rank: int, gaps: bool) -> Any:
    if not _relaid(t, gaps):
        return t
    layout = layout if t.dim() == rank else torch.contiguous_format
    if is_contiguous_for_memory_format_or_false(t, memory_format=layout):
        return t
    return t.contiguous(memory_format=layout)


_aten = torch.ops.aten
#: Elementwise binary ops: their fake and real kernels agree on inputs with gaps (a copy made
#: their results contiguous where eager's keep the inputs' order); only dense inputs differ.
_DENSE_ONLY = frozenset([
    _aten.xlogy.Tensor, _aten.special_xlog1py.default, _aten.copysign.Tensor,
    _aten.floor_divide.default, _aten.div.Tensor_mode, _aten.heaviside.default,
    _aten.ldexp.Tensor, _aten.logaddexp.default, _aten.logical_and.default,
    _aten.logical_or.default, _aten.logical_xor.default])
#: Of the ops below, those whose fake and real kernels agree for inputs all of one dense layout
#: (channels_last, transposed, reversed; checked against the real kernels for each).
_ONE_LAYOUT_AGREES = _DENSE_ONLY | frozenset([
    _aten.binary_cross_entropy.default, _aten.binary_cross_entropy_backward.default,
    _aten.log_sigmoid_backward.default, _aten.elu_backward.default,
    _aten.hardswish_backward.default, _aten.hardsigmoid_backward.default,
    _aten.hardtanh_backward.default, _aten.softplus_backward.default,
    _aten.logit_backward.default])


def _one_dense_layout(args: tuple[Any, ...]) -> bool:
    """Whether the tensor arguments are all dense, of one shape and laid out alike (a 0-dim
    tensor among them broadcasts, where the kernels disagree again)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    first = tensors[0] if tensors else None
    return first is not None and _relaid(first, False) and all(  # no guard on symbolic sizes
        known_equal(t.shape, first.shape) and known_equal(t.stride(), first.stride())
        for t in tensors[1:])


def _pad_agrees(args: tuple[Any, ...]) -> bool:
    """Whether ``constant_pad_nd``'s fake kernel lays its result out as the real one: for a
    symbolic pad it returns the input's suggested memory format whatever the pads' values,
    where the real kernel's trim (all pads <= 0) keeps the input's stride order. They agree for
    plain integer pads (the fake kernel takes the real one's branch), a pad known positive (no
    trim), or an input whose stride order is its suggested format's (a channels_last crop, a
    slice of a contiguous tensor)."""
    x, pads = args[0], args[1]
    if all(isinstance(p, int) for p in pads) or any(statically_known_true(p > 0) for p in pads):
        return True
    if not isinstance(x, torch.Tensor) or suggest_memory_format(x) != torch.contiguous_format:
        return True  # channels_last order (or no strides to lay out)
    strides = [st for n, st in zip(x.shape, x.stride(), strict=True)
               if not statically_known_true(n == 1)]
    return all(statically_known_true(a >= b) for a, b in itertools.pairwise(strides))


#: Ops of the table below whose fake and real kernels agree for the arguments the predicate
#: accepts.
_AGREES_WHEN: dict[Any, Callable[[tuple[Any, ...]], bool]] = {
    **dict.fromkeys(_ONE_LAYOUT_AGREES, _one_dense_layout),
    _aten.constant_pad_nd.default: _pad_agrees,
}
#: Ops whose fake strides differ from the real kernel's, with the argument whose suggested
#: memory format the real kernel returns (None: contiguous). See the Note above.
_RELAID_OPS: dict[Any, int | None] = {
    **dict.fromkeys([
        _aten.native_layer_norm_backward.default, _aten._log_softmax_backward_data.default,
        _aten.log_sigmoid_forward.default, _aten.pow.Scalar, _aten.normal.Tensor_Tensor,
        _aten.mse_loss_backward.default, _aten.smooth_l1_loss_backward.default,
        _aten.huber_loss_backward.default, _aten.nll_loss2d_forward.default,
        _aten.native_dropout_backward.default, _aten.channel_shuffle.default,
        _aten.max_unpool2d.default, _aten.replication_pad2d_backward.default,
        _aten.reflection_pad2d_backward.default, _aten.binary_cross_entropy.default,
        *_DENSE_ONLY, _aten.log_sigmoid_backward.default,
        _aten.elu_backward.default, _aten.hardswish_backward.default,
        _aten.hardsigmoid_backward.default, _aten.hardtanh_backward.default,
        _aten.softplus_backward.default, _aten.binary_cross_entropy_backward.default,
        _aten.rrelu_with_noise.default, _aten.roll.default, _aten.reflection_pad3d.default,
        _aten.replication_pad3d.default, _aten.reflection_pad3d_backward.default,
        _aten.replication_pad3d_backward.default, _aten.logit_backward.default,
        _aten.glu_backward.default], None),
    _aten.constant_pad_nd.default: 0,  # symbolic pads only (_pad_agrees)
    # torch < 2.13: the pads' own fake kernels return channels_last inputs' results contiguous.
    **(dict.fromkeys([_aten.reflection_pad2d.default, _aten.replication_pad2d.default], None)
       if compat.TORCH_VERSION < (2, 13) else {}),
}


#: Batch norm's kernels reduce in an order that depends on the input's layout: a copy made
#: contiguous first changed the result's last bits (and the running statistics'). They run on
#: the inputs as they are, and their result is laid out afterwards as the real kernel lays it
#: out (the suggested memory format of the argument given here), where the fake one differs.
LAID_OUT_AFTER: dict[Any, int] = {
    **dict.fromkeys([_aten.native_batch_norm.default, _aten._native_batch_norm_legit.default,
                     _aten._native_batch_norm_legit.no_stats,
                     _aten._native_batch_norm_legit_functional.default,
                     _aten._native_batch_norm_legit_no_training.default,
                     _aten._batch_norm_with_update.default,
                     _aten._batch_norm_with_update_functional.default], 0),
    **dict.fromkeys([_aten.native_batch_norm_backward.default,  # (grad_out, input, ...)
                     _aten.batch_norm_backward.default], 1),
}


def out_in_eager_layout(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """``func``'s result with its first tensor laid out as the real kernel lays it out, for the
    ops of ``LAID_OUT_AFTER`` (Note [Kernels whose fake strides differ])."""
    by = LAID_OUT_AFTER.get(func)
    if by is None or not isinstance(out, tuple) or not isinstance(out[0], torch.Tensor):
        return out
    first, result = args[by], out[0]
    if not _relaid(first, True) or first.dim() != result.dim():
        return out
    layout = suggest_memory_format(first)
    if is_contiguous_for_memory_format_or_false(result, memory_format=layout):
        return out
    return (result.contiguous(memory_format=layout), *out[1:])


class EagerLayouts(TorchDispatchMode):
    """Runs the ops of Note [Kernels whose fake strides differ] on inputs in their real kernels'
    layouts, for traces outside AOT's tracing guard (compiled autograd's lowering)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return out_in_eager_layout(func, args, func(*in_eager_layout(func, args),
                                                    **(kwargs or {})))


def in_eager_layout(func: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``func``'s arguments, laid out so that its fake kernel gives the strides its real kernel
    gives (Note [Kernels whose fake strides differ])."""
    agrees = _AGREES_WHEN.get(func)
    if func not in _RELAID_OPS or (agrees is not None and agrees(args)):
        return args
    by, gaps = _RELAID_OPS[func], func not in _DENSE_ONLY
    first = args[by] if by is not None else None
    if _relaid(first, gaps):
        layout, rank = suggest_memory_format(first), first.dim()
    else:
        layout, rank = torch.contiguous_format, -1
    # Batch norm lays its result out by its input (and gradient) alone, and writes its running
    # statistics in place: a copy of those would take the update instead.
    read = by + 1 if by is not None else len(args)
    written = {id(t) for t in written_by(func, args, {})}
    return tuple(_laid_out(a, layout, rank, gaps) if i < read and id(a) not in written else a
                 for i, a in enumerate(args))


# Note [In-place Bernoulli draws]
# Eager's CPU ``x.bernoulli_(p)`` with a float ``p`` draws in the order x's elements lie in
# memory, gaps skipped; functionalization makes it ``bernoulli.p``, whose kernel draws in
# logical order: on a transposed or channels_last tensor (``nn.Dropout(inplace=True)``,
# ``nn.AlphaDropout``, whose composites draw into ``empty_like(x)``), or a slice of one, the
# mask landed on other elements than in eager, for the same seed (PyTorch's aot_function and
# aot_eager too). The tracing guard draws on x's view in memory order instead (into a fresh
# contiguous tensor copied there where that view has gaps), where the two orders are the same.
# PyTorch built with MKL draws on Intel CPUs through MKL in logical order, whatever the layout:
# which order this machine's kernel follows is asked of it once, on a small transposed tensor.
# Only on CPU, and for concrete strides (under symbolic ones the functional draw stays).
def run_as_eager(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 run: Callable[[Any, Any, Any], Any]) -> Any:
    """``run(func, args, kwargs)``, its result laid out and drawn as eager's kernel does (Note
    [Kernels whose fake strides differ], Note [In-place Bernoulli draws])."""
    drawn = _bernoulli_in_memory_order(func, args, kwargs)
    return drawn if drawn is not None else out_in_eager_layout(func, args, run(func, args, kwargs))


def _bernoulli_in_memory_order(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x.bernoulli_(p)`` drawn as eager draws it (Note [In-place Bernoulli draws]), or None
    where the op is another or needs nothing."""
    if func is not _aten.bernoulli_.float:
        return None
    x = args[0]
    if x.device.type != "cpu" or not all(type(s) is int for s in (*x.shape, *x.stride())) \
            or x.is_contiguous() or not _elements_apart(x) or not _CPU_DRAWS_IN_MEMORY_ORDER:
        return None
    in_memory = x.permute(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
    try:
        if in_memory.is_contiguous():
            in_memory.bernoulli_(*args[1:], **kwargs)
        else:  # gaps between its elements
            in_memory.copy_(torch.empty(in_memory.shape, dtype=x.dtype, device=x.device)
                            .bernoulli_(*args[1:], **kwargs))
    except RuntimeError:  # a write functionalization refuses (through as_strided): the op's
        return None  # own call raises it, named
    return x


def _elements_apart(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory (gaps allowed): each dimension, by stride,
    steps past everything the smaller ones reach."""
    reach = 0
    for stride, size in sorted((t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) > 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def _draws_in_memory_order() -> bool:
    """Whether this machine's CPU ``bernoulli_`` draws a transposed tensor in memory order
    (not through MKL on an Intel CPU: logical order); asked at import, outside any trace."""
    drawn = torch.zeros(16, 8).t().bernoulli_(0.5, generator=torch.Generator().manual_seed(0))
    in_order = torch.zeros(16, 8).bernoulli_(0.5, generator=torch.Generator().manual_seed(0))
    return torch.equal(drawn.t(), in_order)


_CPU_DRAWS_IN_MEMORY_ORDER = _draws_in_memory_order()


# Note [CPU device indices]
# Eager gives every CPU tensor the device ``cpu``, without an index, whatever a factory or
# ``.to()`` was asked for (``torch.zeros(3, device="cpu:0")``); fake tensors keep ``cpu:0``,
# and the next op mixing it with a ``cpu`` tensor failed to trace ("Unhandled
# FakeTensor Device Propagation ... cpu:0 and cpu!", PyTorch's aot_function too). The tracing
# guard hands such ops the device as eager's kernels make it.
def in_eager_devices(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with a CPU ``device`` index dropped (Note [CPU device indices])."""
    device = kwargs.get("device")
    if isinstance(device, torch.device) and device.type == "cpu" and device.index is not None:
        return {**kwargs, "device": torch.device("cpu")}
    return kwargs


# Note [Byte masks as indices]
# Eager takes a uint8 index tensor as a bool mask (deprecated, with a warning) and refuses an
# int8 one; the fake kernel of ``aten.index.Tensor`` does the opposite: it refuses uint8 and
# takes int8 as a mask. So ``x[byte_mask]``, which eager runs, failed to trace. The tracing
# guard hands ``aten.index.Tensor`` its uint8 indices as bool masks (a ``to(bool)`` in the
# graph: the same elements eager picks) and raises eager's IndexError for int8 ones.
def in_eager_indices(func: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``aten.index.Tensor``'s arguments as its real kernel reads them (Note [Byte masks as
    indices])."""
    if func is not _aten.index.Tensor or not any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.uint8, torch.int8) for i in args[1]):
        return args
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.int8 for i in args[1]):
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a dtype "
                  "torch.bool instead.", UserWarning, stacklevel=2)
    indices = [i.to(torch.bool) if isinstance(i, torch.Tensor) and i.dtype == torch.uint8 else i
               for i in args[1]]
    return (args[0], indices, *args[2:])


PRINTABLE_DECOMPOSITIONS = {getattr(_aten.random, "from"): _random_from}


# Note [Values computed from constants]
# Functionalization leaves an op whose tensor arguments are all outside tensors (Note
# [Closed-over tensors]) alone: its result (``c = TABLE * 2``, ``TABLE.clone()``) is a plain fake
# tensor, and an in-place write to it with a value the function computed (``c.add_(x)``; an
# InstanceNorm's running-stat update writing ``running_mean.repeat(n)``) mixed the two worlds:
# PyTorch's internal assert "mutating a non-functional tensor with a functional tensor". Such
# results are made functional tensors as they appear, as a factory's are, so their writes are
# functional ones like any other's. Views of outside tensors stay outside (writes to them are
# refused).
def functional_values(out: Any) -> Any:
    """``out``, its plain fake tensors made functional if functionalization is on (Note
    [Values computed from constants])."""
    if _detect_infra_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is None:
        return out
    return pytree.tree_map_only(compat.FakeTensor, compat.FunctionalTensor.to_functional, out)


@functools.cache
def takes_generator(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` takes a torch.Generator (read once per op)."""
    return any("Generator" in str(a.type) for a in func._schema.arguments)
