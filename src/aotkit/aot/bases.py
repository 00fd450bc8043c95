"""Inputs whose memory overlaps while the function mutates one of them: traced once more as
views of one base input per shared storage. See Note [Overlapping mutated inputs]."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from aotkit.aot.analysis import AotMeta
from aotkit.aot.ops import any_shared, bytes_spanned, geometry, is_expanded, overlaps_itself
from aotkit.aot.trace import FlatFn
from aotkit.errors import UnsupportedError

# Note [Overlapping mutated inputs]
# ``f(x[:3], x[1:])`` where f writes to its first argument: in eager the second argument sees the
# write, since they share memory (so does a backward's read after a write its backward makes,
# Note [Inputs the backward writes]; with ``f(s, s)`` one of two writes was lost), and so do the
# other windows of ``w = x.unfold(0, 3, 1)`` when f writes ``w[0]``, which a graph with
# autograd, computing on a copy of w, missed (without autograd the graph writes a copy laid out
# as w, overlaps included; such an input is taken as a storage of its own only where the graph
# copies). A graph
# traced for two separate inputs reads the old value and writes back each input on its own, so
# such a call cannot run the entry traced for it. The runtime notices the overlap at the call
# (the entry mutates inputs, so it checks their memory anyway) and runs an entry traced for its
# layout instead, a "recompile" decision saying why:
# - every tensor input in a storage where a mutated input overlaps another becomes a view of one
#   base input, the storage's first ``hi`` elements as a contiguous 1-D tensor (``hi``: the end
#   of the last of them), rebuilt inside with ``as_strided``; functionalization then sees one
#   input written through views and the others reading it, and the runtime writes that base
#   back, which every member sees. The base starts at the storage's first element so that the
#   graph's storage offsets are the members' own (functionalization of ``as_strided`` on an
#   input with a storage offset of its own is where PyTorch gets offsets wrong);
# - with autograd (grad mode on and a member requiring grad), the base is a view of the members'
#   common ``_base``, so gradients and the in-place history reach it as eager's do; members
#   with no common base are refused, as are members of different dtypes and members whose shape
#   the function changes in place (``t_()``), which a base cannot carry back;
# - the entry is keyed on the call's signature and every member's size, stride and offset:
#   other positions in the storage compile again;
# - an output that is a member itself comes back as the caller's tensor (``out is a``).
# The base is as long as the members' reach into their storage, and it is written back whole at
# each call: cheap for views of one tensor, costly for two views deep into a large flat buffer.


@dataclass(frozen=True)
class _Group:
    """The tensor inputs of one storage, and where each lies in it."""

    members: tuple[int, ...]
    views: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]  # size, stride, offset
    length: int  # elements of the base: the end of the members' reach


@dataclass(frozen=True)
class OverlapLayout:
    """How a call's overlapping inputs map onto bases: part of the key of the entry traced
    for them."""

    groups: tuple[_Group, ...]
    num_inputs: int

    @functools.cached_property
    def others(self) -> list[int]:
        grouped = {i for g in self.groups for i in g.members}
        return [i for i in range(self.num_inputs) if i not in grouped]

    def describe(self) -> str:
        return "; ".join(f"inputs {', '.join(map(str, g.members))} share memory"
                         if len(g.members) > 1 else f"input {g.members[0]} shares memory "
                         "between its own elements" for g in self.groups)

    def graph_args(self, args: Sequence[Any]) -> list[Any]:
        """The inputs of the entry traced for this layout: the other inputs, then the bases."""
        return [*(args[i] for i in self.others), *(self._base(g, args) for g in self.groups)]

    def _base(self, group: _Group, args: Sequence[Any]) -> torch.Tensor:
        members = [args[i] for i in group.members]
        root = _root(members)
        if root is not None:  # outputs that are views get eager's _base; in grad mode, a write
            # of a value requiring grad gives the root autograd history, as in eager
            return root.as_strided((group.length,), (1,), 0)
        return members[0].detach().as_strided((group.length,), (1,), 0)

    def wrap(self, flat_fn: FlatFn, returned: dict[int, int]) -> FlatFn:
        """``flat_fn`` as a function of :meth:`graph_args`; fills ``returned`` (output position
        -> input index) with the outputs that are members themselves."""

        def on_bases(*graph_args: Any) -> tuple[list[Any], pytree.TreeSpec]:
            full: list[Any] = [None] * self.num_inputs
            for i, a in zip(self.others, graph_args, strict=False):
                full[i] = a
            bases = graph_args[len(self.others):]
            # Views made in grad mode, as the caller's were: under a no_grad call, autograd
            # refuses a grad_fn to a written view made under no_grad (a raw error).
            with torch.enable_grad():
                for group, base in zip(self.groups, bases, strict=True):
                    for i, view in zip(group.members, group.views, strict=True):
                        full[i] = base.as_strided(*view)
            outs, spec = flat_fn(*full)
            members = {id(full[i]): i for g in self.groups for i in g.members}
            returned.update({k: members[id(o)] for k, o in enumerate(outs) if id(o) in members})
            return outs, spec

        return on_bases


def overlap_layout(name: str, meta: AotMeta, args: Sequence[Any],
                   written_by_backward: Collection[int] = (),
                   read_by_backward: Collection[int] = (),
                   copies: bool = False) -> OverlapLayout | None:
    """The layout of a call where an input the forward writes overlaps another, or itself (a
    window of ``unfold``) where the graph ``copies`` the inputs it writes (with autograd), or
    one the backward writes overlaps another the backward writes or reads, else None; raises
    for the cases Note [Overlapping mutated inputs] refuses. (An input the backward writes is
    written into the caller's memory after the forward ran: inputs only the forward read need
    no base.)"""
    backward = {*written_by_backward, *read_by_backward}

    def role(i: int) -> tuple[bool, bool, bool]:
        return meta.inputs[i].mutated, i in written_by_backward, i in backward

    by_storage: dict[int, list[int]] = {}
    self_overlapping: set[int] = set()
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.numel() != 0 \
                and (ptr := a.untyped_storage().data_ptr()) != 0:
            by_storage.setdefault(ptr, []).append(i)
            if meta.inputs[i].mutates_data and _overlaps_itself(name, i, a) and copies:
                self_overlapping.add(ptr)
    overlapping = [ptr for ptr, members in by_storage.items()
                   if ptr in self_overlapping
                   or (len(members) > 1 and _any_overlap(args, members, role))]
    if not overlapping:
        return None
    groups = tuple(_group(name, meta, args, by_storage[p]) for p in sorted(overlapping))
    return OverlapLayout(groups, len(args))


def _overlaps_itself(name: str, i: int, a: torch.Tensor) -> bool:
    """Whether the elements of input ``i``, which the function writes, may share memory with
    each other (the windows of ``x.unfold(0, 3, 1)``); raises for an ``expand``ed one, whose
    rows one element holds: a graph cannot write a row of it (eager writes the element)."""
    if a.is_contiguous() or not overlaps_itself(a):
        return False
    if is_expanded(a):
        raise UnsupportedError(
            f"{name}: input {i} is an expanded tensor (shape {tuple(a.shape)}, stride "
            f"{a.stride()}: several of its elements are one in memory) and the function writes "
            "into it through a view; aotkit cannot replay such a write.\nFix: "
            "pass the tensor before expand() and expand it inside the function, or pass "
            "x.expand(...).clone().")
    return True


def _any_overlap(args: Sequence[Any], members: list[int],
                 role: Callable[[int], tuple[bool, ...]]) -> bool:
    """Whether two of ``args`` at ``members`` (of one storage) share an element where a write
    of one may reach the other (their ``role``). Swept by the bytes they span: the many
    disjoint views of one flat buffer (a flat-parameter optimizer's) are not compared pair by
    pair at every call, and the runs of those whose spans intersect (interleaved columns) are
    compared element by element at once, once per set of layouts."""
    run: list[int] = []
    reach = -1
    for (start, end), i in [*sorted((bytes_spanned(args[i]), i) for i in members),
                            ((float("inf"), 0), -1)]:
        if start >= reach and len(run) > 1 and any_shared(
                tuple(geometry(args[k]) for k in run), tuple(map(role, run)), _matters):
            return True
        run = [*run, i] if start < reach else [i]
        reach = max(reach, end) if len(run) > 1 else end
    return False


def _matters(a: tuple[bool, ...], b: tuple[bool, ...]) -> bool:
    """Whether a write of one input (roles: mutated, written by the backward, in the backward)
    may reach the other."""
    return a[0] or b[0] or (a[1] and b[2]) or (b[1] and a[2])


def _group(name: str, meta: AotMeta, args: Sequence[Any], members: list[int]) -> _Group:
    tensors = [args[i] for i in members]
    single = len(members) == 1
    which, one = (f"input {members[0]} shares memory between its elements and", "it") \
        if single else (f"inputs {', '.join(map(str, members))} share memory and", "one of them")
    if len({t.dtype for t in tensors}) > 1:
        raise _refused(name, f"inputs {', '.join(map(str, members))} are views of one memory in "
                       "different dtypes", single)
    if any(t.is_conj() or t.is_neg() for t in tensors):  # as_strided would drop the bit
        raise _refused(name, f"{which} {one} is a conjugate or negative view (x.conj(), x.imag "
                       "of a conjugate)", single)
    if any(meta.inputs[i].mutates_metadata or meta.inputs[i].swaps_storage for i in members):
        raise _refused(name, f"{which} {one} has its shape, strides or memory changed in place "
                       "(t_(), as_strided_(), set_(), ...)", single)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and _root(tensors) is None:
        raise _refused(name, f"{which} some of them require grad (a tensor and its detach(), "
                       "say) and they are not views of one common tensor, through which their "
                       "gradients could flow", single)
    views = tuple((tuple(t.shape), t.stride(), t.storage_offset()) for t in tensors)
    length = max(_end(t) for t in tensors)
    return _Group(tuple(members), views, length)


def _root(tensors: Sequence[torch.Tensor]) -> Any:
    """The tensor all of ``tensors`` are views of (or are), if there is one."""
    roots = {id(r): r for r in (t if t._base is None else t._base for t in tensors)}
    return next(iter(roots.values())) if len(roots) == 1 else None


def _refused(name: str, what: str, single: bool) -> UnsupportedError:
    fix = "pass x.clone() for it" if single else (
        "pass separate tensors (e.g. .clone() one of them; under torch.compile, where the "
        "inputs are a graph break's locals, clone() the one written before writing it)")
    return UnsupportedError(
        f"{name}: {what}, and the function (or its backward) mutates "
        f"{'it' if single else 'one of them'} in place; aotkit cannot replay that mutation "
        f"exactly.\nFix: {fix}."
    )


def _end(t: torch.Tensor) -> int:
    """One past the last storage element ``t`` reaches (``t`` is not empty)."""
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1


