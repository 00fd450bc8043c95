"""What a trace reads besides its inputs: modules it calls and tensors it closes over. A compiled
entry holds them as the trace found them and is used only while they still are so.

Note [What a trace reads besides its inputs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A function may call a module it does not take as its compiled input (``aot_function(lambda x:
model(x))``, a frozen teacher handed to an ``aot_module``'s forward) and read tensors it closes
over (a mask, a global table, that module's frozen weights). The graph holds such tensors as
constants (later in-place changes show, Note [Closed-over tensors]) and the branches the
module's training flag took. Five changes would leave the graph silently stale:

* the module's training flag (``model.eval()``): dropout went on dropping out;
* its class or its submodules (``model.head = nn.Linear(...)``, ``layers.append(...)``, an
  activation's ``__class__`` swapped): the graph ran the old ones;
* its hooks, the global module hooks, or a forward set on the instance (a hook registered
  after compiling, a wrapper patched on), which the trace ran as they were; the hook objects
  count, not their handles (pruning again re-registers the same hook), and are held by weak
  reference, as a freed function's address may be reused by the next one;
* a parameter or buffer of the module replaced by a new tensor (``load_state_dict(...,
  assign=True)``, ``module.weight = nn.Parameter(...)``): the graph went on reading the old one;
* a constant made to require grad (a frozen feature extractor unfrozen after warm-up): its
  gradient was silently dropped, where tracing it that way is refused.

So each trace records the modules whose forward runs (a global forward pre-hook, in the tracing
thread only), and the containers between them it loops over without calling (a ModuleList),
with their classes, flags, hooks and children, and the constants it reads (Note [Closed-over tensors]),
among them the parameters and buffers of those modules (a teacher called under no_grad included;
not one ``torch.func.functional_call`` swapped in while tracing: an input), and an entry is used
only while every recorded module still alive is as recorded, still holds those tensors, and
no constant read where a gradient could flow requires grad (checked before every call: flat lists,
weak references to the modules, about 50-60 us for a closed-over 12-layer TransformerEncoder);
otherwise the function is traced again, with a recompile decision naming the change (a constant
that now requires grad is then refused, with the fix). A module the function switches itself
(``model.eval()`` inside; ``Module.train`` is watched while tracing) keeps no flag: its flag is the
function's doing, the same at every call. ``aot_module``'s own submodules are inputs, not reads:
its layout key holds them; Dynamo's graphs call no modules.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import enum
import functools
import gc
import logging
import numbers
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.hooks import RemovableHandle

from aotkit import compat, counters
from aotkit.aot.containers import scripted, with_containers
from aotkit.aot.hook_watch import (
    global_hook_ids,
    hooks_of,
    num_hooks,
    refs,
    same_objects,
)
from aotkit.aot.signature import collected, modules_in
from aotkit.aot.subclass import is_subclass, layout_of, parts
from aotkit.compat import FakeTensor, FunctionalTensor
from aotkit.errors import ArgumentError

_TRACING = (FakeTensor, FunctionalTensor)  # the values a trace leaves


@dataclass(slots=True)
class _Flag:
    """A module the function uses, as traced: its class, training flag (None: the function sets
    it or does not call the module), hooks and instance forward (see :func:`hooks_of`) and
    children. None of them held (a parametrized module's class holds the module; a child's
    hook may be a method of the model: held, a model rebound for the next fold was never
    freed): the class by id, the children by weak proxies compared in C at every call (as
    identity: a module's ``==`` is identity), or by ids where a child's class defines its own
    ``==`` (``by_id``); the weak references' callbacks set ``cls`` to 0, no class's id, once one
    is freed (an id may be reused; a dead proxy is never compared)."""

    module: weakref.ref[nn.Module]
    cls: int
    training: bool | None
    hooks: tuple[Callable[[], Any], ...]
    num_hooks: int  # Note [Hooks seen by counts]
    by_id: bool
    called: bool  # its hooks and instance forward matter: the function called it
    children: tuple[Any, ...] = ()
    refs: tuple[Any, ...] = ()  # the class's reference first, then the children's


def _flag(m: nn.Module, training: bool | None, called: bool) -> _Flag:
    children = list(m._modules.values())
    by_id = any(c is not None and type(c).__eq__ is not object.__eq__ for c in children)
    flag = _Flag(weakref.ref(m), id(m.__class__), training, refs(hooks_of(m) if called else ()),
                 num_hooks(m.__dict__), by_id, called)

    def freed(_: Any) -> None:
        flag.cls = 0

    held = [weakref.ref(m.__class__, freed), *(
        None if c is None else (weakref.ref if by_id else weakref.proxy)(c, freed)
        for c in children)]
    flag.refs = tuple(held)
    flag.children = tuple(map(id, children)) if by_id else tuple(held[1:])
    return flag


def _same_children(flag: _Flag, m: nn.Module) -> bool:
    """Whether ``m`` holds the children it was traced with."""
    now = m.__dict__["_modules"].values()
    try:
        return flag.cls != 0 and (tuple(map(id, now)) if flag.by_id else tuple(now)) == flag.children
    except Exception:  # as in Reads.hold
        return False


@dataclass(frozen=True)
class _Slot:
    """A parameter or buffer of a module the function calls, read by the graph as a constant."""

    table: dict[str, Any]  # the module's _parameters or _buffers
    name: str
    tensor: torch.Tensor
    where: str  # "the parameter 'weight' (4, 4) of Linear"


@dataclass
class Reads:
    """What one trace read besides its inputs. See Note [What a trace reads besides its inputs].
    Checked before every call of its entry, so kept as flat lists."""

    flags: list[_Flag] = field(default_factory=list)
    global_hooks: tuple[Any, ...] = ()  # their ids, when the trace called modules
    handles_seen: int = -1  # RemovableHandle.next_id when the hooks were last compared
    slots: list[_Slot] = field(default_factory=list)
    constants: list[torch.Tensor] = field(default_factory=list)  # read where grads could flow
    # The tensors watched (Note [Constants changed in place]), their names where known, their
    # layouts as traced, and a C++ check that they are still so.
    read: list[torch.Tensor] = field(default_factory=list)
    read_names: list[str | None] = field(default_factory=list)
    layouts: list[tuple[Any, ...]] = field(default_factory=list)
    plain: list[torch.Tensor] = field(default_factory=list)  # those the C++ check takes
    others: list[int] = field(default_factory=list)  # the rest, by position in ``read``
    layout_check: Any = None
    # Constants read after the function wrote some tensor in place (Note [Inputs sharing
    # memory with constants]).
    read_after_writes: list[torch.Tensor] = field(default_factory=list)

    def hold(self) -> bool:
        """Whether the graph is still what a trace would give."""
        handles = RemovableHandle.next_id  # before the comparisons: one may race with it
        fast = handles == self.handles_seen  # Note [Hooks seen by counts]
        for flag in self.flags:  # one __dict__ lookup per module: this runs at every call
            m = flag.module()
            if m is None:
                continue
            d = m.__dict__
            if id(m.__class__) != flag.cls or (flag.training is not None
                                               and m.training != flag.training):  # a property?
                return False
            children = d["_modules"]
            try:
                if (flag.children or children) and flag.children != (tuple(map(
                        id, children.values())) if flag.by_id else tuple(children.values())):
                    return False  # compared to proxies or ids: see _Flag
            except Exception:  # a new child's own ``==`` raised (it reads what others lack)
                return False
            if flag.called and (flag.hooks or d["_forward_pre_hooks"] or d["_forward_hooks"]
                                or "forward" in d or d["_backward_pre_hooks"]
                                or d["_backward_hooks"]) and not (
                        fast and flag.num_hooks == num_hooks(d) >= 0) \
                    and not same_objects(flag.hooks, hooks_of(m)):
                return False
        if self.flags and global_hook_ids() != self.global_hooks:
            return False
        self.handles_seen = handles
        return all(slot.table.get(slot.name) is slot.tensor for slot in self.slots) \
            and not any(t.requires_grad for t in self.constants) and self._same_layouts()

    def dead(self) -> bool:
        """Whether a module the trace used, still alive, lost a child, class or hook it was
        traced with for good (freed): no call matches this entry again."""
        return any(flag.module() is not None and (flag.cls == 0 or any(
            isinstance(r, weakref.ref) and r() is None for r in flag.hooks))
            for flag in self.flags)

    def _same_layouts(self) -> bool:
        # Dynamo's C++ tensor check answers at once for plain tensors when nothing changed (the
        # others, sparse, nested, subclasses, are compared in Python); it also compares
        # requires_grad and the thread's dispatch keys (off under autocast, inference_mode), so
        # where it says no, the layouts themselves decide.
        if not self.read or (self.layout_check.check(*self.plain) and all(
                _layout(self.read[k]) == self.layouts[k] for k in self.others)):
            return True
        if list(map(_layout, self.read)) != self.layouts:
            return False
        # requires_grad or the dispatch keys changed: checked as they are now from here on, or
        # each later call would compare every layout in Python
        self.layout_check = compat.tensor_layout_check(self.plain)
        return True

    def change(self) -> str | None:
        """What changed since the trace, if anything: every change, ``; ``-separated."""
        changes = []
        for flag in self.flags:
            if (m := flag.module()) is None:
                continue
            traced = flag.refs[0]()
            called = f"{(traced or type(m)).__name__} (a module the function uses)"
            if m.__class__ is not traced:
                changes.append(f"the class of {called} changed to {type(m).__name__}")
            if flag.training not in (None, m.training):
                changes.append(f"the training flag of {called}, traced with its flag, changed: "
                               f"{flag.training} -> {m.training}")
            if not _same_children(flag, m) and flag.called:
                changes.append(f"the submodules of {called} were replaced, added or removed")
            elif not _same_children(flag, m):  # a container, or a module holding the called
                changes.append(
                    f"the submodules of {(traced or type(m)).__name__} (on the way to modules "
                    "the function calls: a list it may loop over, or one it never reads, such "
                    "as a list kept for bookkeeping, which cannot be told apart) were "
                    "replaced, added or removed")
            if flag.called and not same_objects(flag.hooks, hooks_of(m)):
                changes.append(f"the hooks or the instance forward of {called} changed")
        if self.flags and global_hook_ids() != self.global_hooks:
            changes.append("global module hooks (register_module_forward_hook) were added or "
                           "removed; the function calls modules")
        changes += [f"{slot.where} (a module the function uses), which the graph reads as a "
                    "constant, was replaced"
                    for slot in self.slots if slot.table.get(slot.name) is not slot.tensor]
        changes += [f"a tensor of shape {tuple(t.shape)} the function reads as a constant (a "
                    "closed-over variable, a global or an attribute) now requires grad"
                    for t in self.constants if t.requires_grad]
        changes += [f"{name or _UNNAMED} changed in place from {_shown(old)} to {_shown(now)} "
                    "(t.data = ..., resize_)" if old[:6] != now[:6] else
                    f"the inner tensors of {name or _UNNAMED} were replaced (swap_tensors, as "
                    "module.to() or .double() does for tensor subclasses)"
                    for t, name, old in zip(self.read, self.read_names, self.layouts, strict=True)
                    if (now := _layout(t)) != old]
        return "; ".join(changes) or None

    def watch(self, named: Iterable[tuple[str | None, Any]],
              names: HeldTensors | None = None) -> None:
        """Watch the layouts of the tensors among these values too, as they are now, naming
        them (also from ``names``, by id) where known (Note [Constants changed in place])."""
        at = {id(t): k for k, t in enumerate(self.read)}
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                continue
            if id(t) not in at:
                at[id(t)] = len(self.read)
                self.read.append(t)
                self.read_names.append(name)
            elif name and self.read_names[at[id(t)]] is None:
                self.read_names[at[id(t)]] = name
        self.read_names = [n or (names or {}).get(id(t), (None,))[0] for t, n in
                           zip(self.read, self.read_names, strict=True)]
        self.layouts = list(map(_layout, self.read))
        self.others = [k for k, t in enumerate(self.read) if type(t) not in (
            torch.Tensor, nn.Parameter) or t.layout is not torch.strided or t.is_nested]
        others = set(self.others)
        self.plain = [t for k, t in enumerate(self.read) if k not in others]
        self.layout_check = compat.tensor_layout_check(self.plain)


# Note [Constants changed in place]
# A tensor the graph reads as a constant is the caller's object, so values written into it
# show (Note [Closed-over tensors]); but ``T.data = torch.ones(8)``, ``T.data = T.double()``
# or ``T.resize_(8)`` keep the object and change its dtype, size or strides, which the trace
# used: ``T.shape[0]`` became a number in the graph, ``T.float()`` was dropped as a no-op, a
# reshape was made for the old size, and Inductor's code read the new memory as the old dtype
# (garbage gradients, the backward reading a saved constant). So each entry keeps every
# constant's dtype, device, size and strides as traced (a tensor subclass's parts too, by the
# memory they view: ``swap_tensors`` replaces them in the same object), and one changed traces
# again, naming it. Watched with them, as the graph may not read them at all but for a size
# (``x * T.shape[0]``, ``x.to(self.table.dtype)``): the tensors among the values the function's
# code reads (Note [Values a function captures]) and the parameters and buffers of the modules
# it calls. Not a module's plain tensor attribute or a tensor in a list or dict read only for
# its size (README, known gaps): watching every tensor the walk meets held on to tensors the
# caller dropped, and cost milliseconds per call for thousands of them.
_UNNAMED = "a tensor the function reads as a constant (a closed-over variable, a global or an " \
    "attribute)"


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    # A subclass's parts by their memory: swapped for tensors viewing the same memory the same
    # way (a no-op module.to()), the graph's old parts read what the new ones would.
    parts = tuple((_memory(p), _layout(p)) if isinstance(p := getattr(t, n), torch.Tensor)
                  else id(p) for n in t.__tensor_flatten__()[0]) if is_subclass(t) else ()
    if t.layout is not torch.strided or t.is_nested:  # no strides (a nested one: no sizes)
        return t.dtype, t.device, None if t.is_nested else t.shape, t.layout, False, False, *parts
    return (t.dtype, t.device, t.shape, t.stride(), t.is_neg(), t.is_conj(), *parts)


def _memory(t: torch.Tensor) -> int:
    return t.data_ptr() if t.layout is torch.strided and not is_subclass(t) else id(t)


def _shown(layout: tuple[Any, ...]) -> str:
    dtype, device, shape, stride, neg, conj, *parts = layout
    shown = "nested" if shape is None else tuple(shape)
    where = f"strides {stride}" if isinstance(stride, tuple) else str(stride).split(".")[-1]
    return (f"{str(dtype).removeprefix('torch.')} {shown} ({where}) on {device}"
            + " with its negative bit" * neg + " with its conjugate bit" * conj
            + " (other parts)" * bool(parts))


# The constants read so far, those read where a gradient could flow, and those read after a
# write, by id.
_ACTIVE: contextvars.ContextVar[tuple[dict[int, torch.Tensor], ...] | None] = \
    contextvars.ContextVar("aotkit_constants_read", default=None)


def note_constant(t: torch.Tensor, grad: bool, after_write: bool) -> None:
    """Called by the tracing guard for every constant read; ``grad``: where a gradient could
    flow (under no_grad none does, and its requires_grad does not matter); ``after_write``: the
    function wrote a tensor in place before."""
    active = _ACTIVE.get()
    if active is not None:
        active[0].setdefault(id(t), t)
        if grad:
            active[1].setdefault(id(t), t)
        if after_write:
            active[2].setdefault(id(t), t)


@contextlib.contextmanager
def recording(own_modules: Callable[[], Iterable[tuple[str, nn.Module]]] | None = None,
              roots: Iterable[nn.Module] = ()) -> Iterator[Reads]:
    """Record what the traces inside the block read (Note [What a trace reads besides its
    inputs]); ``own_modules``: the compiled module's own submodules, which are inputs;
    ``roots``: modules the function holds (a ModuleList it loops over)."""
    reads = Reads()
    own = {id(m) for _, m in own_modules()} if own_modules is not None else set()
    thread = threading.get_ident()
    called: dict[int, nn.Module] = {}  # by id, in call order
    switched: set[int] = set()
    held: list[_Slot] = []  # every parameter and buffer of the modules called, when first called
    attributes: list[_Slot] = []  # and their plain tensor attributes (``self.mask``)
    constants: dict[int, torch.Tensor] = {}
    grad_constants: dict[int, torch.Tensor] = {}
    after_writes: dict[int, torch.Tensor] = {}
    original_train = nn.Module.train

    def record(module: nn.Module, args: object) -> None:
        # Dynamo inlines module hooks where it traces a module call (a torch.cond branch
        # inside our trace) and cannot trace get_ident: the modules such a branch calls stay
        # unrecorded.
        if torch.compiler.is_compiling() or threading.get_ident() != thread \
                or id(module) in own or id(module) in called or scripted(module):
            return
        if uninitialized(module):
            raise lazy_refusal("the compiled function", [type(module).__name__])
        called[id(module)] = module
        held.extend(_slots(module))
        attributes.extend(_attribute_slots(module))

    def train(module: nn.Module, mode: bool = True) -> nn.Module:
        if threading.get_ident() == thread:
            switched.add(id(module))
        return original_train(module, mode)

    record._aotkit_recording = True  # type: ignore[attr-defined]
    handle = nn.modules.module.register_module_forward_pre_hook(record)
    nn.Module.train = train  # type: ignore[method-assign]
    token = _ACTIVE.set((constants, grad_constants, after_writes))
    try:
        yield reads
    finally:
        _ACTIVE.reset(token)
        handle.remove()
        nn.Module.train = original_train  # type: ignore[method-assign]
        _put_back_tracing_tensors(held)
        # A module the function switches itself, or one it does not call, keeps no flag.
        reads.flags = [_flag(m, m.training if i in called and i not in switched else None,
                             i in called)
                       for i, m in with_containers(called, roots)]
        reads.global_hooks = global_hook_ids()
        # Only the tensors the graph holds: one functional_call swapped in while tracing, or
        # one the function never reads, may change freely.
        reads.slots = [slot for slot in (*held, *attributes) if _read(slot.tensor, constants)]
        reads.constants = list(grad_constants.values())
        reads.watch([*((None, t) for t in constants.values()), *(
            (slot.where, slot.tensor) for slot in held if not isinstance(slot.tensor, _TRACING))],
            {id(slot.tensor): (slot.where, slot.tensor) for slot in attributes})
        reads.read_after_writes = [p for t in after_writes.values()  # memory: a subclass's parts
                                   for p in (parts(t, layout_of(t)) if is_subclass(t) else [t])]


def _read(t: torch.Tensor, constants: dict[int, torch.Tensor]) -> bool:
    """Whether the trace read ``t``, or one of its parts (a quantized weight's ``w._data``)."""
    return constants.get(id(t)) is t or (is_subclass(t) and any(
        constants.get(id(p)) is p for p in parts(t, layout_of(t))))


def live_entries(entries: dict[Any, list[Any]], limit: int) -> tuple[dict[Any, list[Any]], int]:
    """The compiled entries (each with its ``reads`` and ``reused``) a call can still match:
    not those whose key holds a freed module (a model of an earlier fold), nor those whose
    trace lost a child or class for good (its replaced head); and how many were dropped where
    no later call ran any of them (a module made anew at every call: they count towards the
    recompile limit; a model evaluated on batches of two sizes, one of them once, does not).
    At ``limit`` entries, garbage is collected first where one holds a module: a model rebound
    is freed in a cycle where a hook is its own method."""
    def live() -> dict[Any, list[Any]]:
        return {k: kept for k, v in entries.items() if not collected(k)
                and (kept := [e for e in v if not e.reads.dead()])}

    before = [e for v in entries.values() for e in v]
    entries = live()
    if sum(map(len, entries.values())) >= limit and any(
            modules_in(k) or any(e.reads.flags for e in v) for k, v in entries.items()):
        gc.collect()
        entries = live()
    kept = {id(e) for v in entries.values() for e in v}
    dropped = [e for e in before if id(e) not in kept]  # a model's entries go together
    return entries, len(dropped) if not any(e.reused for e in dropped) else 0


def modules_held(values: Iterable[Any]) -> list[nn.Module]:
    """The modules among ``values`` (what a function holds: the object of a bound method), or
    among a plain object's attributes there (a trainer's model)."""
    found = []
    for v in values:
        if issubclass(type(v), nn.Module):
            found.append(v)
        elif not issubclass(type(v), type) and type(v) not in weakref.ProxyTypes:
            try:
                attributes = object.__getattribute__(v, "__dict__")
            except Exception:  # no __dict__
                continue
            if type(attributes) is dict:  # not one of its own making
                found += [a for a in attributes.values() if issubclass(type(a), nn.Module)]
    return [m for m in found if "_modules" in m.__dict__]  # not one whose __init__ never ran


def _put_back_tracing_tensors(held: Iterable[_Slot]) -> None:
    """A called module whose forward assigns a parameter or buffer (``self.ema = ...``) was
    left holding a tracing tensor, unusable outside the trace: its tensor from before is put
    back (the trace, which cannot return it, is refused or reads it as a constant)."""
    for slot in held:
        now = slot.table.get(slot.name)
        if now is not slot.tensor and isinstance(now, _TRACING):
            slot.table[slot.name] = slot.tensor


# Note [Values changed in argument objects]
# A function may also change a number its arguments hold (an optimizer step's ``state.step +=
# 1``, ``state["step"] += 1``). The graph does not make the change at each call, and tracing
# made it once per pass on an object (step 0 -> 2 at the first call, the graph holding the
# second pass's bias correction), or not at all on the caller's list or dict, which is rebuilt
# from its leaves for each trace (so the next call read the old value and ran the same graph):
# silently wrong from the first step. Such a change (a number of any type but bool or enum,
# numpy's too, made from another number, or from None in a rebuilt dict: ``(d["step"] or 0) +
# 1``; or a symbolic size left there) is put back and the trace refused, also on a module
# passed as an argument (a warm-up counter it reads: every call ran the second pass's
# graph). Other changes are let be: flags, modes and options set (``st.initialized = True``,
# ``opts["output_attentions"] = False``, ``st.label_smoothing = 0.1`` where it was True,
# ``st.lr = float(st.lr)``), values replaced, keys added, removed or reordered
# (``batch.pop("labels")``): the first trace's object keys what the function computes from
# them. The function's own object (``self.calls += 1`` in ``aot_function(model)``) is not
# an argument: README, known gaps.
# Note [Tracing tensors left in argument objects]
# A function may store what it computes in an object it is handed (a key/value cache's
# ``self.layers[i].keys = torch.cat(...)``). The graph cannot do that at each call, and the
# trace leaves the object holding a tracing tensor, unusable afterwards ("FunctionalTensor on
# its own"), also after the trace was refused for reading it in a later pass. So the plain
# objects, lists, dicts and deques reachable from the arguments, and from the globals and
# closed-over values the function's code reads (three levels, as Note [Objects as arguments]
# keys them; at most 1024 besides modules), and the attributes and buffers of a module the
# function runs as, is passed or reaches, with what it holds three levels down (a cache per
# layer; not a TorchScript module's), are copied shallowly before tracing; one left holding a
# tracing tensor it did not hold before (also inside a new object: a cache layer) is put back
# as it was, and a trace that otherwise succeeded is refused, naming where the tensor went.
# What a module holds (``self.last_attn = a.detach()`` in an ``aot_function(model)``, AWD-
# LSTM's WeightDrop setting its module's weight at every call, an LSTM's _flat_weights, a list
# of kept attention maps) gets a "fallback" decision instead, once the trace is not refused,
# naming aot_module where it sets such tensors after each call (attributes), and of a dict or
# an object only the tracing tensors are taken back (a flag set beside them stays set, as eager
# sets it; after a refusal, everything is, as eager never ran); a number
# changed there (a warm-up schedule's step) gets a "side_effect" decision. Each copy is
# compared with what it was copied from in C, and only what changed is looked into: a compile
# must not pay for the tables, datasets and models a function can reach but leaves alone. So a
# list or dict of up to 65536 items is copied (of those over 1024 items, 262144 items in all
# for one compile; past that a list keeps its length: what the trace appended is taken off
# again; a dict is not held), but only containers of up to 1024 are looked into, and at most
# 65536 items in all (a tensor counts among the arguments and the values the function reads,
# where it is named for messages); a long list's modules are held where it starts with one
# (a list of experts). At most 1024 containers are held for each module, and as many besides
# modules; a module met at the walk's last level or past it has what it holds directly held
# (whatever its count), and the modules in that met so (a chain of modules each keeping the
# next one in a list is followed to its end, each named from its class). These
# limits hold for each of the three walks of a compile: the arguments, the values the function
# reads (its globals and closed-over values, aot_module's forward's too) and the modules. A
# module's class and bases count with the module: the lists, dicts and deques they define.
# Lists and dicts of the user's own classes, whose length or items run the user's code (a lazy
# registry importing what it maps), are not looked into.
_MAX_HELD = 1024
_MAX_ITEMS = 1024
_MAX_COPIED = 65536  # a list or dict copied and compared at C speed, but not looked into
_MAX_COPIED_IN_ALL = 1 << 18  # items of long lists and dicts copied in one compile
_MAX_WALKED = 65536  # items looked into in one walk
# Copied with .copy(); a dict's keys are looked at too (reading ``opt.state[p]``, a defaultdict,
# inserts the tracing stand-in of p as a key).
_COPIED = (list, dict, collections.defaultdict, collections.OrderedDict, collections.deque)


def argument_containers(values: Iterable[tuple[str, Any]], tensors: HeldTensors | None = None
                        ) -> list[tuple[str, Any, Any]]:
    """``(where, container, shallow copy)`` for the plain objects' ``__dict__``, lists and
    dicts reachable from the named ``values``, ``(where, list, length)`` for long lists (Note
    [Tracing tensors left in argument objects]); ``tensors`` gets each tensor held in them
    (a module's tensor attributes too) and where it is, by id."""
    # type(), not isinstance: a global or closed-over proxy's __class__ may raise
    return _walk([(name, v, "") for name, v in values
                  if not issubclass(type(v), torch.Tensor)], 0, tensors)


def module_containers(modules: Iterable[tuple[str, torch.nn.Module]],
                      tensors: HeldTensors | None = None) -> list[tuple[str, Any, Any]]:
    """The lists, dicts, deques and plain objects the named modules hold besides nn.Module's
    own (an LSTM's _flat_weights, a list of kept attention maps, a cache per layer), three
    levels, with their copies (put back with a decision, not a refusal); what several hold
    (a config) once."""
    classes: dict[type, list[str]] = {}
    return _walk([item for where, m in modules if not scripted(m)
                  for item in _module_items(where, m, classes)], 0, tensors, classes)


def _module_items(where: str, m: torch.nn.Module, classes: dict[type, list[str]]
                  ) -> list[tuple[str, Any, str]]:
    """What a module holds besides nn.Module's own, and the lists, dicts and deques its class
    and bases define (``attn_maps = []`` in the class body, shared by every instance; their
    names by class in ``classes``)."""
    cls = type(m)
    if cls not in classes:
        classes[cls] = [k for c in cls.__mro__ if c not in _MODULE_BASES
                        for k, v in vars(c).items() if type(v) in _COPIED and k[:2] != "__"]
    return [(f"{where}.{k}", v, where) for k, v in m.__dict__.items() if k not in _MODULE_OWN] + \
        [(f"{where}.{k}", getattr(cls, k), where) for k in classes[cls]]


_MODULE_BASES = (torch.nn.Module, object)
HeldTensors = dict[int, tuple[str, torch.Tensor]]  # where a walk met each tensor, by id


def _walk(level: list[tuple[str, Any, str]], first: int, tensors: HeldTensors | None,
          classes: dict[type, list[str]] | None = None) -> list[tuple[str, Any, Any]]:
    # The walk makes many small containers that live until the trace ends: the garbage
    # collector's passes over them took as long as the walk (9000 modules: ~280 ms, ~100 ms
    # without).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _walked(level, first, tensors, classes)
    finally:
        if enabled:
            gc.enable()


def _walked(level: list[tuple[str, Any, str]], first: int, tensors: HeldTensors | None,
            classes: dict[type, list[str]] | None) -> list[tuple[str, Any, Any]]:
    """The containers reachable from ``level`` (where, value, and the module holding it: ""
    for none), from depth ``first`` to three (those at the third held, not looked into), and
    the tensors down to the third, with a module's tensor attributes; breadth first, so
    what is met shallowest is walked deepest. A module met at the last level or past it has
    what it holds held, and the modules in that followed so (a chain of modules each keeping
    the next one in a list), named from their class: a path would grow with the chain."""
    held: list[tuple[str, Any, Any]] = []
    seen: set[int] = set()
    plain: collections.Counter[str] = collections.Counter()  # held, by the module holding
    walked = 0  # items looked into (not tensors, only named where ``tensors`` asks)
    copied = 0  # items of big lists and dicts copied: a small container is always held
    classes = {} if classes is None else classes
    todo = [(where, v, owner, 3 - first) for where, v, owner in level]
    while todo:
        below: list[tuple[str, Any, str, int]] = []
        for where, v, owner, left in todo:
            kind = type(v)
            if issubclass(kind, torch.Tensor):
                if tensors is not None:
                    tensors.setdefault(id(v), (where, v))
                continue
            module = issubclass(kind, torch.nn.Module) and "_modules" in vars(v)
            if id(v) in seen or (plain[owner] >= _MAX_HELD and not module and left >= 0):
                continue  # modules always (a big one first left the next one unheld), and
                # what one met past the last level holds: no more than its attributes
            seen.add(id(v))
            if module:  # a module and its submodules' own attributes (not TorchScript's)
                prefix = where if left > 0 else type(v).__name__
                for sub, m in torch.nn.Module.named_modules(v, prefix=prefix):
                    if scripted(m) or (m is not v and id(m) in seen):
                        continue
                    seen.add(id(m))
                    held += [(sub, m.__dict__, _ModuleAttributes(m.__dict__, recomputed(m))),
                             (sub, m._buffers, _ModuleAttributes(m._buffers))]
                    below += [(*item, max(left - 1, 1) if left > 0 else -1)
                              for item in _module_items(sub, m, classes)]
                continue
            plain[owner] += 1
            items: list[tuple[str, Any, str]] = []
            if _safely_plain(v) and len(v.__dict__) <= _MAX_ITEMS:
                held.append((where, v.__dict__, _copy(v.__dict__, where, owner, ".")))
                items = [(f"{where}.{k}", x, owner) for k, x in v.__dict__.items()]
            elif kind in _COPIED:
                small = len(v) <= _MAX_ITEMS
                if small or (len(v) <= _MAX_COPIED and copied + len(v) <= _MAX_COPIED_IN_ALL):
                    copied += 0 if small else len(v)
                    held.append((where, v, _copy(v, where, owner, "[")))
                elif kind is list:  # its length: what the trace appended is taken off
                    held.append((where, v, _Length(len(v), where, owner)))
                if small and walked < _MAX_WALKED:
                    items = _items_below(where, v, owner)
                elif kind is list and v and issubclass(type(v[0]), torch.nn.Module):  # experts
                    items = [(f"{where}[{k}]", x, owner) for k, x in enumerate(v)
                             if issubclass(type(x), torch.nn.Module)]
            elif issubclass(kind, tuple) and _builtin_items(kind) and len(v) <= _MAX_ITEMS \
                    and walked < _MAX_WALKED:  # a table of tuples is not walked in full
                items = _items_below(where, v, owner)  # a namedtuple too
            if left <= 0:  # held, as a module met at the last level holds it: its modules only
                items = [i for i in items if issubclass(type(i[1]), torch.nn.Module)]
            elif tensors is None:
                items = [i for i in items if not issubclass(type(i[1]), torch.Tensor)]
            walked += len(items)
            below += [(*item, max(left - 1, -1)) for item in items]
        todo = below
    return held


def _items_below(where: str, container: Any, owner: str) -> list[tuple[str, Any, str]]:
    """A held list, tuple or dict's items to look into: not numbers or strings (a table of
    them is passed over in C)."""
    values = container.values() if isinstance(container, dict) else container
    if _SCALARS.issuperset(map(type, values)):
        return []
    items = container.items() if isinstance(container, dict) else enumerate(container)
    return [(f"{where}[{_shown_key(k)}]", x, owner) for k, x in items
            if type(x) not in _SCALARS]


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def _shown_key(key: Any) -> str:
    """A dict key as a message shows it: by repr where that is plain (a parameter's repr
    prints its values, a user's may raise)."""
    return repr(key) if type(key) in (str, int, float, bool, type(None)) \
        else f"<{type(key).__name__}>"


def _copy(container: Any, where: str, owner: str, joiner: str) -> Any:
    """The copy of a held ``__dict__`` (``joiner`` ".") or list or dict ("["): a module's
    ``owner`` makes it one put back with a decision (none for an RNN's weights cache, which
    setting a weight updates, Note [Attributes forward assigns])."""
    if owner:
        held_in = where[len(owner) + 1:]
        return _ModuleItems(container, held_in) \
            if isinstance(container, (list, collections.deque)) else \
            _ModuleAttributes(container, held_in=held_in, joiner=joiner)
    return _Attributes(container) if joiner == "." else container.copy()


class _Length(int):
    """The length of a held list too long to copy; what the trace appended is taken off."""

    def __new__(cls, n: int, where: str, owner: str) -> _Length:
        length = super().__new__(cls, n)
        length.held_in = where[len(owner) + 1:] if owner else ""  # type: ignore[attr-defined]
        return length


def _safely_plain(value: Any) -> bool:
    """:func:`aotkit.aot.signature._plain_object`, False for an object that raises when
    looked at (a proxy whose ``__class__`` raises)."""
    from aotkit.aot.signature import _plain_object

    try:
        return _plain_object(value)
    except Exception:
        return False


#: What every module holds in its __dict__ (parameters, buffers, submodules, hooks).
_MODULE_OWN = frozenset(torch.nn.Module().__dict__)


def put_back_containers(held: Iterable[tuple[str, Any, Any]],
                        decisions: list[tuple[str, list[str]]] | None = None) -> list[str]:
    """Put back every container left holding a tracing tensor; where each was (the innermost:
    an object whose list was put back is not named too). A module's are put back quietly, with
    ``(module, what was stored)`` added to ``decisions`` (:func:`note_module_stores`, once the
    trace is not refused)."""
    left = []
    for where, container, before in held:
        module = isinstance(before, (_ModuleAttributes, _ModuleItems)) or \
            getattr(before, "held_in", "")
        if isinstance(before, int):  # a long list: its length only
            if any(_tracing(x) for x in container[before:]):
                del container[before:]
                if module and decisions is not None:
                    decisions.append((where.removesuffix(f".{before.held_in}"),
                                      [f"{before.held_in}[{before}:]"]))
                elif not module:
                    left.append(where)
            continue
        if _unchanged(container, before):
            continue
        keys = isinstance(container, dict) and any(map(_tracing, container))
        now = container.items() if isinstance(container, dict) else enumerate(container)
        if keys or (stored := [k for k, x in now  # not one there before
                               if not (_in(before, k) and before[k] is x) and _tracing(x)]):
            decided = module and not keys  # put back with a decision, not refused
            names = before.stored(stored, container) if decided else []
            if decided and decisions is not None and isinstance(container, dict):
                _take_back(container, before, stored)  # a flag set beside stays, as in eager
            else:
                _restore(container, before)
            if decided:
                if decisions is not None and names:
                    decisions.append((where.removesuffix(f".{before.held_in}")
                                      if before.held_in else where, names))
                continue
            left.append(f"{where} as a key (a dict looked up by a tensor argument, such as "
                        "opt.state[p], finds its tracing stand-in, never the caller's tensor)"
                        if keys else where)
    return [w for w in left if not any(o.startswith((f"{w}.", f"{w}[")) for o in left)]


def _unchanged(container: Any, before: Any) -> bool:
    """Whether a held list or dict holds what its copy does, the same objects in the same
    order (looked at in C: a held table of 60,000 entries costs a compile ~1 ms)."""
    if isinstance(container, dict):
        return len(container) == len(before) and \
            all(map(operator.is_, container, before)) and \
            all(map(operator.is_, container.values(), before.values()))
    return len(container) == len(before) and all(map(operator.is_, container, before))


def symbolic_values(held: Iterable[tuple[str, Any, Any]]) -> list[str]:
    """Where a held container (of the function's own objects and the modules it calls too)
    was left holding a symbolic size; put back as it was."""
    return changed_values(held, numbers=False)


def changed_values(held: Iterable[tuple[str, Any, Any]], numbers: bool = True,
                   restore: bool = True) -> list[str]:
    """Where a held object's attribute, or a held list's or dict's item, holds a number other
    than before the trace (``state.step += 1``); the container is put back as it was where
    ``restore`` (Note [Values changed in argument objects])."""
    changed = []
    for where, container, before in held:
        if isinstance(before, int):  # a long list: only its length was kept
            continue
        if _unchanged(container, before):
            continue
        items = before.items() if isinstance(before, dict) else enumerate(before)
        now = container.items() if isinstance(container, dict) else enumerate(container)
        found = [k for k, old in items
                 if _in(container, k) and not same_value(old, container[k])] if numbers else []
        ids = set(map(id, found))  # by identity: a key may be a tensor
        found += [k for k, x in now if (not _in(before, k) or before[k] is not x)
                  and id(k) not in ids and _symbolic(x)]  # a size stored anew, appended
        if found and restore:
            _restore(container, before)
        attributes = isinstance(before, _Attributes) and getattr(before, "joiner", ".") == "."
        changed += [f"{where}.{k}" if attributes else f"{where}[{_shown_key(k)}]" for k in found]
    return changed


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _symbolic(value: Any) -> bool:
    """A symbolic size or a comparison of one (``x.shape[0] > 2``), alone or in a list, tuple
    (a ``torch.Size``) or dict, two levels: a dead trace's symbol, useless to the caller."""
    return _holds(value, _SYMBOLIC)


def _restore(container: Any, before: Any) -> None:
    """Put a held dict, list or deque back as its copy ``before`` has it."""
    if isinstance(container, dict):
        container.clear()
        container.update(before)
    elif isinstance(container, collections.deque):
        container.clear()
        container.extend(before)
    else:
        container[:] = before


def _take_back(container: dict[Any, Any], before: dict[Any, Any], keys: list[Any]) -> None:
    """Put back only what ``keys`` of a held dict (an object's attributes) hold now (tracing
    tensors); a list is put back whole (its items may have moved: a sliding window)."""
    for k in keys:
        if k in before:
            container[k] = before[k]
        else:
            del container[k]


def _in(container: Any, key: Any) -> bool:
    """Whether ``key`` is still there (not popped), without a defaultdict making it."""
    return key in container if isinstance(container, dict) else key < len(container)


def same_value(old: Any, new: Any, unset_counts: bool = False) -> bool:
    """Whether ``new`` keeps ``old`` as far as Note [Values changed in argument objects] goes:
    a number (numpy's too; not a bool or an enum) made from another number, or from None where
    ``unset_counts`` (a rebuilt dict's ``(d["step"] or 0) + 1``), and not equal to it, is a
    change (a counter, a step); a flag set, an option filled in, ``int`` made ``float``, any
    other value replaced are not. A symbolic size left there (``st.n = x.shape[0]``) is."""
    if old is new:
        return True
    if isinstance(new, (torch.SymInt, torch.SymFloat)):
        return False
    if not _number(new) or not (_number(old) or (unset_counts and old is None)):
        return True
    try:
        return bool(old == new) or (old != old and new != new) \
            or float(old) == float(new)  # NaN stays NaN; Fraction(1, 2) made 0.5
    except Exception:
        return False


def _number(value: Any) -> bool:
    """A number that may count (not a flag, not an enum member: a mode)."""
    return isinstance(value, numbers.Number) and not isinstance(value, (bool, enum.Enum))


class _Attributes(dict):  # type: ignore[type-arg]
    """The copy of an object's ``__dict__`` (told from a dict's copy in messages)."""


class _ModuleAttributes(_Attributes):
    """The copy of a module's ``__dict__`` or buffers, or of a dict it holds under
    ``held_in``: put back with a decision, not a refusal (Note [Tracing tensors left in
    argument objects]), and without one for the attributes a PyTorch pre-hook recomputes from
    the module's tensors at every call (a pruned ``weight``), which the graph computes itself."""

    def __init__(self, attributes: dict[str, Any], recomputed: frozenset[str] = frozenset(),
                 held_in: str = "", joiner: str = "[") -> None:
        super().__init__(attributes)
        self.recomputed = recomputed
        self.held_in = held_in
        self.joiner = joiner if held_in else "."  # "[": a dict's items, ".": an object's

    def stored(self, keys: Iterable[Any], now: dict[str, Any]) -> list[str]:
        """The names of what was stored under ``keys`` (``now`` holds it), for the decision;
        not a list or dict, whose own copy names what went into it."""
        if self.held_in:
            return [f"{self.held_in}.{k}" if self.joiner == "." else
                    f"{self.held_in}[{_shown_key(k)}]" for k in keys]
        return [k for k in keys if k not in self.recomputed
                and (type(now[k]) not in _COPIED or self.get(k) is not now[k])]


class _ModuleItems(list):  # type: ignore[type-arg]
    """The copy of a list a module holds under ``held_in``: as :class:`_ModuleAttributes`."""

    def __init__(self, items: list[Any], held_in: str) -> None:
        super().__init__(items)
        self.held_in = held_in
        self.quiet = held_in == "_flat_weights"  # an RNN's weights cache: see _copy

    def stored(self, keys: Iterable[Any], now: list[Any]) -> list[str]:
        return [] if self.quiet else [f"{self.held_in}[{k}]" for k in keys]


def note_module_stores(decisions: Iterable[tuple[str, list[str]]]) -> None:
    """The decisions :func:`put_back_containers` left, for a trace not refused: one for
    modules named alike (the links of a chain, named from their class)."""
    alike = collections.Counter((where, tuple(names)) for where, names in decisions)
    for (where, names), count in alike.items():
        items = any("[" in name or "." in name for name in names)  # aot_module sets neither
        counters.record("fallback", where if count == 1 else f"{where} ({count} modules)", (
            f"forward stores a tensor into {', '.join(names)} on the module (a cache, an "
            "attention map kept for plotting, a reassigned buffer): the compiled graph cannot "
            "store it at each call, so the module keeps what it held before the call. Fix: "
            + ("" if items else "compile the module with aot_module(model), which sets such "
               "tensors after each call, or ")
            + "torch.compile(model, backend='aotkit'), which replays such stores."),
            logger=logging.getLogger("aotkit.aot"), level=logging.WARNING)


def note_module_counts(name: str, changed: list[str]) -> None:
    """Numbers changed in what a module the function runs as holds (a warm-up schedule's
    step): eager changes them at each call, tracing did once per pass."""
    if changed:
        counters.record("side_effect", name, (
            f"forward changes {', '.join(changed)}, a number in a list, dict or object the "
            "module holds: tracing changed it once per pass and the graph never does, so "
            "anything computed from it keeps the traced value (a warm-up schedule's step) and "
            "the number stops counting. Fix: keep it in a buffer changed in place "
            "(self.register_buffer('step', torch.zeros(())); self.step.add_(1)), or use "
            "torch.compile(model, backend='aotkit'), which replays such changes."),
            logger=logging.getLogger("aotkit.aot"), level=logging.WARNING)


def recomputed(module: torch.nn.Module) -> frozenset[str]:
    """What pruning, weight_norm and spectral_norm's pre-hooks set on ``module``, and an RNN's
    weights cache ``_flat_weights``, which setting its weight updates (Note [Attributes forward
    assigns])."""
    caches = frozenset({"_flat_weights"}) if isinstance(module, nn.RNNBase) else frozenset()
    if not module._forward_pre_hooks:
        return caches
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return caches | frozenset(h._tensor_name if isinstance(h, BasePruningMethod) else h.name
                              for h in module._forward_pre_hooks.values()
                              if isinstance(h, (BasePruningMethod, SpectralNorm, WeightNorm)))


def _tracing(value: Any) -> bool:
    """A tracing tensor, or a list, tuple or dict (a namedtuple, an OrderedDict, a model
    output) holding one, two levels: ``{"l": [t]}``."""
    return _holds(value, _TRACING)


def _holds(value: Any, kinds: tuple[type, ...], depth: int = 2) -> bool:
    """Whether ``value`` is of ``kinds``, or a list, tuple, dict, deque of at most 1024 items
    or a plain object (a dataclass of a cache layer) holds one, ``depth`` levels down."""
    kind = type(value)  # not __class__: a dead weakref.proxy's raises
    if issubclass(kind, kinds):
        return True
    if depth and _builtin_items(kind) and len(value) <= _MAX_ITEMS:
        items = value.values() if issubclass(kind, dict) else value
        return any(_holds(x, kinds, depth - 1) for x in items)
    if depth and not issubclass(kind, (torch.Tensor, torch.nn.Module)) and _safely_plain(value):
        return any(_holds(x, kinds, depth - 1) for x in value.__dict__.values())
    return False


_BUILTIN_CONTAINERS = (collections.OrderedDict, dict, list, tuple, collections.deque)


@functools.cache
def _builtin_items(kind: type) -> bool:
    """A list, tuple, dict or deque (a namedtuple, an OrderedDict, a model output) whose length
    and items are the built-in ones: a subclass's own (a lazy mapping importing what it maps, a
    registry that raises) would run user code eager never ran."""
    base = next((b for b in kind.__mro__ if b in _BUILTIN_CONTAINERS), None)
    return base is not None and all(getattr(kind, name, None) is getattr(base, name, None)
                                    for name in ("__len__", "__iter__", "values"))


def uninitialized(module: nn.Module) -> bool:
    """A lazy module (``nn.LazyLinear``) that has not created its parameters yet."""
    return isinstance(module, LazyModuleMixin) and module.has_uninitialized_params()


def lazy_refusal(what: str, lazy: list[str]) -> ArgumentError:
    return ArgumentError(
        f"{what}: lazy modules {lazy} have not created their parameters yet; tracing would "
        "create them as tracing values.\nFix: run one eager forward first (e.g. "
        "model(example_input)), then compile.")


def _slots(module: nn.Module) -> list[_Slot]:
    return [_Slot(table, name, t, f"the {kind} {name!r} {tuple(t.shape)} of {type(module).__name__}")
            for kind, table in (("parameter", module._parameters), ("buffer", module._buffers))
            for name, t in table.items() if t is not None]


def _attribute_slots(module: nn.Module) -> list[_Slot]:
    """A called module's plain tensor attributes (``self.mask``), as its parameters' slots:
    the graph reads them as constants, or for their size."""
    # type(), not isinstance: a proxy's __class__ may raise
    return [_Slot(module.__dict__, name, t, f"the tensor attribute {name!r} {tuple(t.shape)} of "
                  f"{type(module).__name__}") for name, t in module.__dict__.items()
            if issubclass(type(t), torch.Tensor) and not issubclass(type(t), _TRACING)]
