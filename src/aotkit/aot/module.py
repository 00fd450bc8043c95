"""``aot_module``: an ``nn.Module`` compiled with its parameters and buffers as graph inputs."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import sys
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from aotkit import config, counters
from aotkit.aot.api import AotFunction, AotOptions, Partitioner
from aotkit.aot.arguments import leaf_names
from aotkit.aot.boxing import Compiler
from aotkit.aot.hook_watch import global_hook_tables, hook_identity, hook_tables, hooks_of
from aotkit.aot.reads import lazy_refusal, uninitialized
from aotkit.aot.signature import class_forward
from aotkit.aot.trace import tracing_active
from aotkit.errors import ArgumentError, RecompileLimitError, UnsupportedError
from aotkit.locks import new_lock
from aotkit.partition.default import default_partition

log = logging.getLogger("aotkit.aot")


# Note [Module state as graph inputs]
# Parameters and buffers are read from the module at every call and passed to the compiled
# function as its leading inputs, in named_parameters/named_buffers order without repeats (tied
# weights once). Which tensor sits in which slot is the module's layout: every submodule (by
# identity, in module order), its training flag, and its parameter and buffer names. A layout
# seen for the first time is traced and compiled; ``explain()`` says what changed (a training
# flag, a layer added, replaced or re-registered, a parameter set to None, weights untied), so a
# compiled graph never receives one parameter in another's place.
#
# While tracing, each slot (a module's ``_parameters`` or ``_buffers`` entry) is pointed at its
# fake input and restored afterwards. Slots, not names: a submodule registered under two names
# (``self.head = self.body[-1]``) has one slot per tensor, and tied weights fill every slot
# they occupy. A buffer or plain tensor attribute that forward assigns anew (``self.ema = 0.9 *
# self.ema + x``, ``self.cache = ...``) is put back after tracing (a tracing value must not stay
# on the module), returned by the graph, and assigned to the module after each call, as eager
# assigns it. A plain attribute is read while tracing, a constant of the graph; once forward is
# seen assigning it a tensor (a running average, a cache, a hidden state carried to the next
# call, an activation a hook keeps; absent or None before), it becomes state like a buffer (a
# slot in its module's ``__dict__``, an input read at every call), so the next call reads what
# the last one assigned. That layout is compiled at the next call, with a recompile decision
# naming the attributes. So does one replaced from outside between calls (``model.scale =
# ...``: the layout lists the modules' tensor attributes, and every call checks they are still
# there; one forward never reads costs a recompile), and one that requires grad when a layout
# is compiled (``self.w = hyper(z)`` before the first call: a constant requiring grad would be
# refused). One that requires grad ties each call's
# graph to the last one's where forward reads it, as eager's does (a hidden state carried
# without ``.detach()``: its gradient flows into the last call's graph); an input the graph
# does not read gets no gradient edge. Whether forward reads an attribute cannot be told
# (``self.__dict__.get``, ``vars(self)`` and a class default read it without the module
# knowing), so one it only writes (an activation a hook keeps) is an input too, and its shape
# joins the signature: one entry per shape it comes in.
# Before, such tensors stayed constants: the graph went on reading the value it was traced
# from, or the branch it took for an absent attribute, silently.

@dataclasses.dataclass(frozen=True)
class _Slot:
    table: dict[str, Any]   # a module's _parameters or _buffers
    key: str
    index: int              # which state tensor fills it
    name: str               # qualified name, e.g. "encoder.0.norm.running_mean"
    is_buffer: bool
    is_attribute: bool = False  # a plain tensor attribute forward assigns (in ``__dict__``)


@dataclasses.dataclass
class _Layout:
    modes: list[tuple[str, bool]]   # (module name, training)
    classes: list[type]             # each module's, in the same order
    names: list[str]                # state tensor names, in input order
    slots: list[_Slot]
    attributes: list[tuple[str, dict[str, Any]]]  # every module's name and __dict__
    hooks: list[tuple[str, str, Any]]  # (module name or "every module", kind, hook)
    # Plain tensor attributes read while tracing, constants of the graph: qualified name ->
    # (the module's __dict__, key, the tensor read). See Note [Module state as graph inputs].
    constants: dict[str, tuple[dict[str, Any], str, torch.Tensor]] = dataclasses.field(
        default_factory=dict)
    # ``__dict__`` ids of modules PyTorch defines (their caches: Note [Attributes forward
    # assigns]).
    pytorch_modules: set[int] = dataclasses.field(default_factory=set)
    # Plain values forward changes, as the graph was traced from (Note [Attributes forward
    # assigns]); filled while tracing with the others it assigns, and those it computes from
    # symbolic sizes (each call's own value, never guarded).
    guarded_values: dict[str, Any] = dataclasses.field(default_factory=dict)
    values_traced_from: dict[str, Any] = dataclasses.field(default_factory=dict)
    symbolic_values: set[str] = dataclasses.field(default_factory=set)
    # Attributes read as state, as the graph was traced: "a tensor", "None", "a float", ...
    attribute_kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    # Modules whose forward is set on the instance (a wrapper patched on), by name; and every
    # module's class and its forward (``Net.forward = ...`` patched on the class).
    forwards: dict[str, Any] = dataclasses.field(default_factory=dict)
    class_forwards: dict[str, tuple[type, Any]] = dataclasses.field(default_factory=dict)

    @property
    def tables(self) -> list[dict[str, Any]]:
        """Every module's ``_parameters`` and ``_buffers``."""
        return [d[k] for _, d in self.attributes for k in ("_parameters", "_buffers")]


@dataclasses.dataclass
class _Compiled:
    fn: AotFunction
    layout: _Layout
    watchers: list[weakref.ref[nn.Module]] = dataclasses.field(default_factory=list)
    # The hook tables forward changed in the last tracing pass, as it left them: set after the
    # first call (Note [Module hooks]).
    registered: list[tuple[dict[int, Any], dict[int, Any]]] = dataclasses.field(
        default_factory=list)
    reused: bool = False  # whether a call after the first ran it


class AotModule(nn.Module):
    """An ``nn.Module`` whose forward runs ``aot_function`` over the original module's forward,
    with parameters and buffers as leading inputs, read fresh at every call.

    The module's layout (every submodule's ``training`` flag, which parameters and buffers it
    holds) selects the compiled function; see Note [Module state as graph inputs].
    """

    def __init__(self, module: nn.Module, options: AotOptions) -> None:
        super().__init__()
        _refuse_scripted(module)
        self.orig_module = module
        self._options = options
        self._compiled: dict[Hashable, _Compiled] = {}
        self._last: _Compiled | None = None
        # Plain tensor attributes forward assigns, by module id (Note [Module state as graph
        # inputs]).
        self._attributes: dict[int, tuple[str, ...]] = {}
        # Plain Python attributes forward changes, part of the layout key (Note [Attributes
        # forward assigns]), by module id.
        self._guarded: dict[int, tuple[str, ...]] = {}
        # Layouts compiled so far, freed ones included (a layout per step is a runaway).
        self._once = 0  # layouts of freed submodules that ran one call only
        # Buffers forward assigns anew, (id of the module's _buffers, name): their sizes are
        # symbolic under dynamic=True (Note [Static parameters]).
        self._reassigned_buffers: set[tuple[int, str]] = set()
        # The hooks (ids) its own and global hooks were last reported for (in _call_impl).
        self._hooks_told: tuple[Any, ...] = ()

    # The wrapper reads as the module it compiles, as torch.compile's does: its training flag
    # (``model.eval()`` on the original shows here) and the public attributes it lacks itself
    # (``compiled.encoder``), which are also written there (``compiled.scale = 2.0``). Private
    # and special names stay the wrapper's: a parametrized module's ``__deepcopy__`` would copy
    # the original alone, and torch.compile's lazy-module check would find its hooks.
    @property  # type: ignore[override]
    def training(self) -> bool:
        modules = self.__dict__.get("_modules")
        return True if not modules or "orig_module" not in modules else modules["orig_module"].training

    @training.setter
    def training(self, mode: bool) -> None:
        modules = self.__dict__.get("_modules")
        if modules and "orig_module" in modules:  # nn.Module.__init__ sets it before
            modules["orig_module"].training = mode

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self._original_having(name)
            if original is None:
                raise
            return getattr(original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        original = self._original_having(name)
        if original is not None and name not in self.__dict__:
            try:
                setattr(original, name, value)
            except TypeError as exc:
                if not (isinstance(value, torch.Tensor) and name in original._parameters):
                    raise
                raise ArgumentError(  # functional_call's unprefixed top-level names land here
                    f"{exc} (set through the aot_module wrapper, which passes {name!r} on to "
                    f"the module it wraps).\nFix: give torch.func.functional_call the wrapper's "
                    f"name for it, 'orig_module.{name}' (as in its state_dict()), or call "
                    "functional_call on the original module; to replace the parameter, assign "
                    "an nn.Parameter.") from exc
        else:
            super().__setattr__(name, value)

    def _original_having(self, name: str) -> nn.Module | None:
        """The original module, where ``name`` is a public attribute of it."""
        modules = self.__dict__.get("_modules")
        if name.startswith("_") or not modules or "orig_module" not in modules \
                or name == "orig_module" or not hasattr(modules["orig_module"], name):
            return None
        return modules["orig_module"]

    @property
    def num_entries(self) -> int:
        """How many (layout, input signature) pairs have been traced and compiled."""
        return sum(c.fn.num_entries for c in self._compiled.values())

    # Global module hooks (register_module_forward_hook) ran in the trace on the original's
    # modules; on the wrapper they would run a second time, on its call.
    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        if any(own := hook_tables(self)):  # its own hooks, which run with the global ones
            hooks = (*map(tuple, own), *map(tuple, every := global_hook_tables()))
            if any(every) and hooks != self._hooks_told:  # once per set of hooks
                self._hooks_told = hooks
                counters.record("hook", f"aot_module({type(self.orig_module).__name__})", (
                    "the compiled module has hooks of its own and global module hooks are set "
                    "(torch.nn.modules.module.register_module_*_hook): the global ones run on "
                    "the original's modules in the graph and once more on the compiled module. "
                    "Fix: register the hooks on the original module before aot_module."),
                    logger=log, level=logging.WARNING)
            return super()._call_impl(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if tracing_active():  # Note [Calls inside other traces]: part of that graph
            return self.orig_module(*args, **kwargs)
        # A trace in another thread points its modules' slots (this module's too, where they
        # share submodules) at tracing values until it ends: read them under the lock the trace
        # holds meanwhile (in ``call``).
        with _SLOTS_LOCK:
            compiled, state = self._compiled_and_state()
        self._last = compiled
        out, assigned = compiled.fn(*state, *args, **kwargs)
        for table, after in compiled.registered:  # after the trace only
            table.clear()
            table.update(after)
        compiled.registered.clear()
        for name, value in assigned.items():
            module, attribute = _assign(self.orig_module, name, value)
            if not isinstance(value, torch.Tensor):
                self._guard(compiled, name, module, attribute)
                continue
            if attribute in module._buffers:  # its size may change: Note [Static parameters]
                if (id(module._buffers), attribute) not in self._reassigned_buffers:
                    self._reassigned_buffers.add((id(module._buffers), attribute))
                    slots = [s.index for s in compiled.layout.slots
                             if s.table is module._buffers and s.key == attribute]
                    compiled.fn.static_sizes = compiled.fn.static_sizes.difference(slots)
                continue
            # An input from the next layout on: not watched as a constant (holding it would
            # keep its graph alive).
            compiled.layout.constants.pop(name, None)
            if attribute not in self._attributes.get(id(module), ()):
                self._attributes[id(module)] = (*self._attributes.get(id(module), ()), attribute)
        return out

    def _compiled_and_state(self) -> tuple[_Compiled, list[torch.Tensor]]:
        """The compiled function for the module's layout (compiled now if new), and its state."""
        key, state = _collect(self.orig_module, self._attributes, self._guarded)
        compiled = self._compiled.get(key)
        if compiled is not None and compiled.layout.constants and self._read_replaced(compiled):
            key, state = _collect(self.orig_module, self._attributes, self._guarded)
            compiled = self._compiled.get(key)
        if compiled is None and self._read_attributes_requiring_grad():
            key, state = _collect(self.orig_module, self._attributes, self._guarded)
            compiled = self._compiled.get(key)
        if compiled is None:
            return self._compile_for(key), state
        compiled.reused = True
        return compiled, state

    def _guard(self, compiled: _Compiled, name: str, module: nn.Module, attribute: str) -> None:
        """A plain value forward assigned that differs from the one the graph was traced from
        makes the attribute part of the layout key (Note [Attributes forward assigns])."""
        traced = compiled.layout.values_traced_from.get(name, _MISSING)
        if name in compiled.layout.symbolic_values or attribute in self._guarded.get(
                id(module), ()) or _same(traced, module.__dict__[attribute]):
            return
        self._guarded[id(module)] = (*self._guarded.get(id(module), ()), attribute)

    def _read_replaced(self, compiled: _Compiled) -> bool:
        """Plain tensor attributes replaced since the last call (``model.scale = ...``), or set
        to require grad, which the graph holds as constants, are read as inputs from now on
        (Note [Module state as graph inputs]); whether there were any."""
        constants = compiled.layout.constants
        replaced = []
        for name, (d, key, value) in constants.items():
            # else a tensor, None, a number, or deleted; or one whose gradient is wanted now
            if d.get(key, _MISSING) is value and not value.requires_grad:
                continue
            module = self.orig_module.get_submodule(name.rpartition(".")[0])
            self._attributes[id(module)] = (*self._attributes.get(id(module), ()), key)
            replaced.append(name)
        return bool(replaced)

    def _read_attributes_requiring_grad(self) -> bool:
        """Plain tensor attributes that require grad (``self.w = hyper(z)``) are read as inputs,
        whose gradient flows back as in eager, not as constants, which the trace refuses (Note
        [Module state as graph inputs]); whether there were new ones."""
        found = False
        for m in self.orig_module.modules():
            read = self._attributes.get(id(m), ())
            new = tuple(k for k, v in m.__dict__.items()
                        if isinstance(v, torch.Tensor) and v.requires_grad and k not in read)
            if new:
                self._attributes[id(m)] = (*read, *new)
                found = True
        return found

    def _compile_for(self, key: Hashable) -> _Compiled:
        module = self.orig_module
        _refuse_uninitialized(module)
        layout = _layout(module, self._attributes, self._guarded)
        name = f"aot_module({type(module).__name__})"
        if self._last is not None:
            why = _describe(self._last.layout, layout)
            if (held := self._layouts_held()) >= config.recompile_limit:
                raise RecompileLimitError(
                    f"{name} has been compiled for {held} module layouts "
                    "(aotkit.config.recompile_limit; layouts of submodules since freed count "
                    f"where they ran one call only); this call would compile another ({why}).\n"
                    "Fix: keep the module's layout stable (replace a submodule's parameters in "
                    "place instead of the submodule, keep training flags, keep a Python value "
                    "forward changes at every call, such as a step counter, in a buffer; "
                    "register hooks once, not at every step), or raise the limit with "
                    "aotkit.config.patch(recompile_limit=...)."
                )
            counters.record("recompile", name, why, logger=log)
        _record_hooks(name, layout.hooks)
        names = layout.names

        registered: list[tuple[dict[int, Any], dict[int, Any]]] = []

        def call(*flat: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
            with _SLOTS_LOCK, _filled(layout, flat[: len(names)], registered) as assigned:
                out = module(*flat[len(names):], **kwargs)
            return out, assigned

        def leaf_namer(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
            return [*names, *leaf_names(args[len(names):], kwargs)]

        options = dataclasses.replace(self._options, num_params_buffers=len(names))
        static = {s.index for s in layout.slots  # Note [Static parameters]
                  if not s.is_attribute and (id(s.table), s.key) not in self._reassigned_buffers}
        compiled = _Compiled(AotFunction(call, options, name, leaf_namer,
                                         checked=(module.forward, len(names)),
                                         own_modules=module.named_modules, static_sizes=static),
                             layout, registered=registered)
        self._compiled[key] = compiled
        # The key names submodules by id, which Python reuses once a module is freed: an entry
        # dies with any of its modules, so a new module never finds an old module's graph.
        forget = _forgetter(weakref.ref(self), key)
        compiled.watchers = [weakref.ref(m, forget) for m in module.modules()]
        return compiled

    def _layouts_held(self) -> int:
        """The layouts compiled that count towards the recompile limit: those whose modules
        are alive (a task's head replaced is freed with its graph), and those of freed ones
        that ran one call only (a submodule made anew at every call)."""
        if len(self._compiled) + self._once >= config.recompile_limit:
            gc.collect()  # a head freed in a cycle
        return len(self._compiled) + self._once

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the compiled entries (compiler state, closures over this module's
        submodules): a copy or an unpickled module is compiled anew on its first call, with its
        training flag, hooks and attributes as they were."""
        state = super().__getstate__()
        state = {**state, "_compiled": {}, "_last": None, "_attributes": {}, "_guarded": {},
                 "_once": 0}
        return state


# Held while a tracing pass points modules' slots at tracing values, and while a call reads a
# module's state: calls in other threads wait for aot_module's tracing passes (not for
# compilers, nor for other traces).
_SLOTS_LOCK = new_lock(reentrant=True)


def _forgetter(owner: weakref.ref[AotModule], key: Hashable) -> Callable[[Any], None]:
    def forget(_: Any) -> None:
        module = owner()
        if module is not None and (gone := module._compiled.pop(key, None)) is not None:
            module._once += not gone.reused

    return forget


def _collect(root: nn.Module, attributes: Mapping[int, tuple[str, ...]],
             guarded: Mapping[int, tuple[str, ...]]) -> tuple[Hashable, list[torch.Tensor]]:
    """The module's layout key and its state tensors, in one walk (this runs at every call).
    ``attributes``: plain tensor attributes read as state, ``guarded``: plain values the key
    holds, by module id."""
    key: list[Any] = []
    params: list[Any] = []
    buffers: list[Any] = []
    values: list[Any] = []
    for m in root.modules():
        p, b = m._parameters, m._buffers
        cls = m.__class__
        children = m._modules  # by name and by which module each holds (one may be shared)
        key.append((id(m), cls, class_forward(cls), m.training, *p, None, *b, None, *children,
                    None, *map(id, children.values())))
        if m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks:
            # The hook objects, which the entry's layout holds, not their handles: pruning
            # again re-registers the same hook under a new handle. How each is called too:
            # with_kwargs, and a backward hook's kind (the same function registered again so
            # ran a stale graph).
            key.append((*map(hook_identity, hooks_of(m)), m._is_full_backward_hook))
        if "forward" in m.__dict__:  # set on the instance
            key.append(("forward", id(m.__dict__["forward"])))
        params.extend(p.values())
        buffers.extend(b.values())
        if attributes and (read := attributes.get(id(m))):
            names = _tensor_attributes(m, attributes)
            others = [(n, _kind_of(m.__dict__.get(n, _MISSING))) for n in read if n not in names]
            key.append(("attributes", *names, None, *others))  # None, a float, unset: a constant
            values.extend(m.__dict__[n] for n in names)
        if guarded and (names := guarded.get(id(m))):
            key.append(("values", *(_hashable(m.__dict__.get(n, _MISSING)) for n in names)))
    if any(every := global_hook_tables()):
        key.append(tuple(map(tuple, every)))
    state, slots = _unique([*params, *buffers, *values])
    return (tuple(key), slots), state


def _tensor_attributes(m: nn.Module, attributes: Mapping[int, tuple[str, ...]]) -> tuple[str, ...]:
    """Which of ``m``'s attributes read as state hold a tensor now."""
    d = m.__dict__
    return tuple(n for n in attributes.get(id(m), ()) if isinstance(d.get(n), torch.Tensor))


# Note [Attributes forward assigns]
# Tracing runs forward more than once (a metadata pass, the joint trace, a retrace under
# autocast), and the compiled graph runs no Python. So whatever forward assigns to a module
# attribute is put back after each tracing pass, so that every pass starts from the state the
# call started from (a rotary cache keyed on ``self.cached_len`` recomputed in the first pass
# was skipped by the second, which then read the cache the first pass had put back), and the
# last pass's values are returned by the graph and assigned after every call, as eager assigns
# them: tensors (Note [Module state as graph inputs]) and plain Python values alike, a SymInt
# read from a dynamic size becoming each call's int. A container holding tensors is refused:
# the next trace would read its tensors as constants; a private one kept by a module PyTorch
# defines, or a subclass of one (RNN's ``_flat_weights``: its weights, computed ones under
# weight_norm or pruning), is a cache, put back after the trace as it was (forward rebuilds it
# when it finds it stale; an RNN's is updated with the weight set after the call, as its
# setattr updates it when eager's weight_norm hook sets the weight); a public one a subclass's
# forward sets (``self.feats``) is refused.
# Other objects (RNN's weakrefs to its parameters, a config object) stay as forward left them.
# The graph holds the branches forward took for the values it was traced from, so a plain value
# forward changes (an ActNorm-style ``self.initialized = True``, a cache length) joins the
# layout key from then on: the next call traces again from the new value (a recompile naming
# it), and a value forward changes at every call (``self.calls += 1``) runs into the recompile
# limit, whose fix names it. A value computed from symbolic sizes is each call's own, unguarded.


# Note [Module hooks]
# Module hooks run inside the traced forward (forward and pre-hooks) or its traced backward
# (full backward hooks, through the BackwardHook function they insert). What they compute on
# tensors is in the graph: a hook that scales an output, pruning's and spectral_norm's weight
# recomputation. Their Python side effects (storing an activation, counting calls, logging a
# gradient norm) happen while tracing only, with tracing tensors, never when the compiled module
# runs (tensors set as module attributes excepted: see Note [Module state as graph inputs]).
# So the hooks are part of the layout (adding or removing one compiles again, with the reason),
# and hooks other than PyTorch's own tensor-only ones get a "hook" decision, logged as a
# warning, that names them and torch.compile, whose Dynamo replays hook side effects. A hook
# forward registers itself (transformers installs its output-capturing hooks on the first call)
# (or one it removes) is put back after each tracing pass, so that every pass starts from the
# same hooks, and the hooks are left after the call as the last pass left them, in their order,
# as eager leaves them: the next call traces again with them in place.
_HOOK_KINDS = ("forward pre-hook", "forward hook", "backward pre-hook", "backward hook")


# Every table registering or removing a hook changes (the last three flag hooks by id).
_HOOK_STATE = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


def _hooks(modules: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, str, Any]]:
    tables = [(name, hook_tables(m)) for name, m in modules]
    tables.append(("every module", global_hook_tables()))
    return [(name, kind, hook) for name, kinds in tables
            for kind, table in zip(_HOOK_KINDS, kinds, strict=True) for hook in table.values()]


def _record_hooks(name: str, hooks: Sequence[tuple[str, str, Any]]) -> None:
    """See Note [Module hooks]."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    own = (BasePruningMethod, SpectralNorm, WeightNorm)
    user = [f"{kind} {getattr(hook, '__qualname__', repr(hook))} on {where}"
            for where, kind, hook in hooks if not isinstance(hook, own)
            and not getattr(hook, "__module__", "").startswith("torch.ao.quantization.")]
    if user:
        counters.record(
            "hook", name,
            f"{'; '.join(user)}: traced with the forward and backward, so what they compute on "
            "tensors is in the graph and tensors they set as module attributes are set after "
            "each call, but their other Python side effects (appending outputs to a list, "
            "counting calls, logging gradients) happen only while tracing, with tracing "
            "tensors, never when the compiled module runs. Fix: torch.compile(model, "
            "backend='aotkit') runs hooks' side effects as eager does; or register tensor "
            "hooks on the compiled module's outputs.",
            logger=log, level=logging.WARNING)


def _unique(tensors: Iterable[torch.Tensor | None]) -> tuple[list[torch.Tensor], Hashable]:
    """Drop Nones and repeats (tied weights; a tensor that is a parameter and a buffer), keeping
    first occurrences, as named_parameters/named_buffers do. Also returns which unique tensor
    each slot holds (-1: None), which tells ties and unset slots apart."""
    index: dict[int, int] = {}
    out: list[torch.Tensor] = []
    slots: list[int] = []
    for t in tensors:
        if t is None:
            slots.append(-1)
            continue
        i = index.get(id(t))
        if i is None:
            i = index[id(t)] = len(out)
            out.append(t)
        slots.append(i)
    return out, tuple(slots)


def _layout(root: nn.Module, attributes: Mapping[int, tuple[str, ...]],
            guarded: Mapping[int, tuple[str, ...]]) -> _Layout:
    modules = list(root.named_modules())
    modes = [(n or type(root).__name__, m.training) for n, m in modules]
    index: dict[int, int] = {}
    names: list[str] = []
    slots: list[_Slot] = []
    for kind in ("parameter", "buffer", "attribute"):
        for prefix, m in modules:
            table = {"parameter": m._parameters, "buffer": m._buffers, "attribute": m.__dict__}[kind]
            keys = _tensor_attributes(m, attributes) if kind == "attribute" else table
            for key in keys:
                t = table[key]
                if t is None:
                    continue
                qualified = f"{prefix}.{key}" if prefix else key
                if id(t) not in index:
                    index[id(t)] = len(names)
                    names.append(qualified)
                slots.append(_Slot(table, key, index[id(t)], qualified, kind != "parameter",
                                   kind == "attribute"))
    lifted = {(id(s.table), s.key) for s in slots}
    constants = {f"{n}.{k}" if n else k: (m.__dict__, k, v) for n, m in modules
                 for k, v in m.__dict__.items()
                 if isinstance(v, torch.Tensor) and (id(m.__dict__), k) not in lifted}
    return _Layout(modes, [type(m) for _, m in modules], names, slots,
                   [(n, m.__dict__) for n, m in modules], _hooks(
        [(f"{n!r} ({type(m).__name__})" if n else type(m).__name__, m) for n, m in modules]),
        constants, {id(m.__dict__) for _, m in modules if _defined_by_pytorch(m)},
        {f"{n}.{k}" if n else k: m.__dict__.get(k, _MISSING) for n, m in modules
         for k in guarded.get(id(m), ())},
        attribute_kinds={f"{n}.{k}" if n else k: _kind_shown(m.__dict__.get(k, _MISSING))
                         for n, m in modules for k in attributes.get(id(m), ())},
        forwards={n or type(root).__name__: m.__dict__["forward"] for n, m in modules
                  if "forward" in m.__dict__},
        class_forwards={n or type(root).__name__: (type(m), class_forward(type(m))) for n, m in modules})


def _kind_shown(value: Any) -> str:
    if value is None or value is _MISSING:
        return _shown(value)
    return f"a {type(value).__name__}"


def _kind_of(value: Any) -> Hashable:
    """What a state attribute holding no tensor is keyed on: unset, None, or its type (its
    value is a constant of the graph, as other plain attributes' are)."""
    return value if value is None or value is _MISSING else type(value)


def _defined_by_pytorch(m: nn.Module) -> bool:
    """An instance of a module class PyTorch defines (``nn.LSTM``, or a user's subclass of it)."""
    return any(c.__module__.startswith("torch.") for c in type(m).__mro__
               if c is not nn.Module and c is not object)


@contextlib.contextmanager
def _filled(layout: _Layout, state: Sequence[torch.Tensor],
            registered: list[tuple[dict[int, Any], dict[int, Any]]]) -> Iterator[dict[str, Any]]:
    """Point every slot at its state tensor while forward runs; restore them after. Yields the
    buffers and attributes forward assigned anew (filled in when it returns). Hook tables
    forward changes are put back after each pass, as forward left them in ``registered``
    (Note [Module hooks])."""
    slots = layout.slots
    originals = [s.table[s.key] for s in slots]
    keys = [(table, dict.fromkeys(table)) for table in layout.tables]
    attributes = [(prefix, d, dict(d)) for prefix, d in layout.attributes]
    hooks = [(d[k], dict(d[k])) for _, d in layout.attributes for k in _HOOK_STATE if k in d]
    for s in slots:
        s.table[s.key] = state[s.index]
    assigned: dict[str, Any] = {}
    try:
        yield assigned
        assigned.update(_assigned_in_forward(slots, state, keys))
        state_slots = {(id(s.table), s.key) for s in slots if s.is_attribute}
        assigned.update(_attributes_assigned(attributes, state_slots, layout))
    finally:
        for table, before in keys:
            for key in [k for k in table if k not in before]:
                del table[key]  # registered by forward: a tracing value
        for s, t in zip(slots, originals, strict=True):
            s.table[s.key] = t
        for _, d, before in attributes:
            _restore_attributes(d, before)
        registered[:] = [(table, dict(table)) for table, before in hooks
                         if list(table.items()) != list(before.items())]
        for table, before in hooks:
            table.clear()
            table.update(before)


def _attributes_assigned(attributes: Sequence[tuple[str, dict[str, Any], dict[str, Any]]],
                         state_slots: set[tuple[int, str]], layout: _Layout) -> dict[str, Any]:
    """Plain attributes forward set (``self.cache = ...``, old-style weight_norm's
    ``module.weight``, ``self.cached_len = n``): returned by the graph and set after each call,
    as eager sets them (Note [Attributes forward assigns]). Those read as state
    (``state_slots``) are the slots' business, and a private container of tensors a module
    PyTorch defines keeps (RNN's ``_flat_weights``) is a cache its forward rebuilds."""
    assigned = {}
    for prefix, d, before in attributes:
        for key, value in d.items():
            if (id(d), key) in state_slots or (key in before and before[key] is value):
                continue
            name = f"{prefix}.{key}" if prefix else key
            kind = _kind(value)
            if kind == "tensors" and not (id(d) in layout.pytorch_modules and key.startswith("_")):
                raise UnsupportedError(
                    f"the module's forward assigned {name!r} a {type(value).__name__} holding "
                    "tensors; aot_module sets tensors and plain Python values that forward "
                    "assigns to attributes after each call, not containers of tensors (the "
                    "next trace would read them as constants).\nFix: assign each tensor to an "
                    "attribute or buffer of its own, return them from forward, or use "
                    "torch.compile(model, backend='aotkit').")
            if kind in ("tensor", "value"):
                assigned[name] = value
            if kind == "value":
                layout.values_traced_from[name] = before.get(key, _MISSING)
                if any(isinstance(v, _SYMBOLIC) for v in pytree.tree_leaves(value)):
                    layout.symbolic_values.add(name)
    return assigned


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_VALUES = (int, float, complex, str, type(None), *_SYMBOLIC)
_MISSING = object()  # an attribute not set


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # an == that does not give a bool
        return False


def _shown(value: Any) -> str:
    return "(not set)" if value is _MISSING else repr(value)


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _kind(value: Any) -> str:
    """How an attribute forward assigned is handled (Note [Attributes forward assigns]):
    "tensor", "value" (plain Python values, SymInts), "tensors" (a container holding tensors)
    or "object" (anything else)."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    leaves = pytree.tree_leaves(value)
    if any(isinstance(v, torch.Tensor) for v in leaves):
        return "tensors"
    return "value" if all(isinstance(v, _VALUES) for v in leaves) else "object"


def _restore_attributes(d: dict[str, Any], before: dict[str, Any]) -> None:
    """Put back what forward assigned, objects aside: tracing values must not stay on the
    module, and the next tracing pass must start from the state the call started from (Note
    [Attributes forward assigns])."""
    for key, value in list(d.items()):
        if (key not in before or before[key] is not value) and _kind(value) != "object":
            if key in before:
                d[key] = before[key]
            else:
                del d[key]


def _assigned_in_forward(slots: Sequence[_Slot], state: Sequence[torch.Tensor],
                         keys: Sequence[tuple[dict[str, Any], dict[str, None]]]) -> dict[str, torch.Tensor]:
    for table, before in keys:
        if table.keys() != before.keys():
            raise UnsupportedError(
                f"the module's forward registered or removed a parameter or buffer "
                f"({sorted(set(table) ^ set(before))}); aot_module traces forward on fake tensors, "
                "so the module would keep a tracing value.\nFix: create parameters and buffers "
                "in __init__ (or run one eager forward first), or use "
                "torch.compile(model, backend='aotkit')."
            )
    assigned = {}
    for s in slots:
        value = s.table[s.key]
        if value is state[s.index]:
            continue
        if not s.is_buffer or not isinstance(value, torch.Tensor):
            what = f"a new value to parameter {s.name!r}" if not s.is_buffer else (
                f"{type(value).__name__} to buffer {s.name!r}")
            raise UnsupportedError(
                f"the module's forward assigned {what}; "
                "aot_module writes back in-place changes of parameters and buffers and new "
                "tensors assigned to buffers, nothing else.\nFix: change the tensor in place "
                "(copy_, mul_), or use torch.compile(model, backend='aotkit')."
            )
        assigned[s.name] = value
    return assigned


def _assign(root: nn.Module, name: str, value: Any) -> tuple[nn.Module, str]:
    """Set a buffer or plain attribute that forward assigned while it was traced; returns the
    module and the attribute."""
    prefix, _, key = name.rpartition(".")
    module = root.get_submodule(prefix)
    (module._buffers if key in module._buffers else module.__dict__)[key] = value
    if key in getattr(module, "_flat_weights_names", ()):  # as an RNN's setattr keeps its cache
        module._flat_weights[module._flat_weights_names.index(key)] = value
    return module, key


def _refuse_scripted(root: nn.Module) -> None:
    scripted = [n or type(root).__name__ for n, m in root.named_modules()
                if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        raise UnsupportedError(
            f"aot_module({type(root).__name__}): {scripted} are TorchScript modules "
            "(torch.jit.script or torch.jit.trace), whose parameters and buffers live in C++, "
            "where aot_module cannot put the tensors it traces with.\nFix: compile the eager "
            "module (the one before scripting), or call the scripted one from a function "
            "compiled with aot_function, which reads its weights as constants.")


def _refuse_uninitialized(root: nn.Module) -> None:
    lazy = [n or type(root).__name__ for n, m in root.named_modules() if uninitialized(m)]
    if lazy:
        raise lazy_refusal("aot_module", lazy)


def _describe(old: _Layout, new: _Layout) -> str:
    """Why a new layout was compiled, e.g. ``training flags changed: drop.training True -> False``."""
    reasons = []
    if [n for n, _ in old.modes] == [n for n, _ in new.modes]:
        pairs = list(zip(old.modes, new.modes, old.classes, new.classes, old.attributes,
                         new.attributes, strict=True))
        replaced = [n for (n, _), _, _, _, (_, a), (_, b) in pairs if a is not b]
        if replaced:  # a module's __dict__ is the module, held by the layout
            reasons.append(f"submodules replaced: {', '.join(replaced)}")
        classes = [f"{n} {a.__name__} -> {b.__name__}" for (n, _), _, a, b, *_ in pairs
                   if a is not b and n not in replaced]
        if classes:
            reasons.append(f"module classes changed: {', '.join(classes)}")
        flips = [f"{n}.training {a} -> {b}" for (n, a), (_, b), *_ in pairs
                 if a != b and n not in replaced]
        if flips:
            reasons.append(f"training flags changed: {', '.join(flips)}")
    else:
        reasons.append("submodules changed (added, removed, replaced or re-registered)")
    read = [s.name for s in new.slots if s.is_attribute and s.name not in old.names]
    if read:
        reasons.append(f"plain tensor attribute(s) {read} assigned anew (by forward or from "
                       "outside): read as inputs from now on, so each call sees the current value")
    was = {**old.values_traced_from, **old.guarded_values}  # what the old graph was traced from
    changed = [f"{n} {_shown(was.get(n, _MISSING))} -> {_shown(v)}"
               for n, v in new.guarded_values.items() if not _same(was.get(n, _MISSING), v)]
    if changed:
        reasons.append(f"plain attribute(s) forward assigns changed ({', '.join(changed)}): "
                       "traced again from the current values")
    before = {**dict.fromkeys(old.constants, "a tensor"), **old.attribute_kinds}
    replaced = [f"{n} {before.get(n, _shown(_MISSING))} -> {kind}"
                for n, kind in new.attribute_kinds.items()
                if kind != "a tensor" and before.get(n, _shown(_MISSING)) != kind]
    if replaced:
        reasons.append(f"plain attribute(s) set anew ({', '.join(replaced)}): traced again for "
                       "that value")
    reasons += _state_changes(old, new, read)
    if [(n, k, hook_identity(h)) for n, k, h in old.hooks] != \
            [(n, k, hook_identity(h)) for n, k, h in new.hooks]:  # a hook's own __eq__ may raise
        reasons.append("module hooks added or removed")
    if changed := sorted(n for n in {*old.forwards, *new.forwards}
                         if old.forwards.get(n) is not new.forwards.get(n)):
        reasons.append(f"forward set on the module instance changed: {', '.join(changed)}")
    if changed := [f"{n} ({cls.__name__}.forward = ...)"
                   for n, (cls, forward) in new.class_forwards.items()
                   if (was := old.class_forwards.get(n)) and was[0] is cls and was[1] is not forward]:
        reasons.append(f"forward replaced on the module's class: {', '.join(changed)}")
    return "; ".join(reasons) or ("the module's layout changed (a submodule was replaced, or a "
                                  "parameter or buffer registered as or set to None)")


def _state_changes(old: _Layout, new: _Layout, read: Sequence[str]) -> list[str]:
    """How the state tensors changed: names added or removed, weights tied or untied."""
    names = [n for n in new.names if n not in read]
    if old.names == names:
        if [(s.name, s.index) for s in old.slots] != [(s.name, s.index) for s in new.slots
                                                     if s.name not in read]:
            return ["weights tied differently"]
        return []
    old_slots, new_slots = {s.name for s in old.slots}, {s.name for s in new.slots}
    added = [n for n in names if n not in old.names]
    removed = [n for n in old.names if n not in names]
    untied = [n for n in added if n in old_slots]  # a slot that shared a tensor has its own
    tied = [n for n in removed if n in new_slots]
    added = [n for n in added if n not in untied]
    removed = [n for n in removed if n not in tied]
    changed = "; ".join(p for p in (f"added {added}" if added else "",
                                    f"removed {removed}" if removed else "") if p)
    parts = [f"weights untied: {untied} now hold tensors of their own" if untied else "",
             f"weights tied: {tied} now share another slot's tensor" if tied else "",
             f"parameters/buffers changed: {changed}" if changed else ""]
    return [p for p in parts if p] or ["parameters/buffers changed: same names in a new order"]


def aot_module(
    mod: nn.Module,
    fw_compiler: Compiler,
    bw_compiler: Compiler | None = None,
    partition_fn: Partitioner = default_partition,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    keep_inference_input_mutations: bool = False,
    inference_compiler: Compiler | None = None,
    dynamic: bool = False,
) -> AotModule:
    """Compile an ``nn.Module`` like :func:`aot_function`; parameters and buffers become the
    leading graph inputs and buffer mutations (e.g. BatchNorm statistics) reach the module.
    The other arguments are :func:`aot_function`'s (its ``num_params_buffers`` is set from the
    module); the returned module holds ``mod`` as ``orig_module``.

    Example::

        >>> import torch, aotkit
        >>> m = aotkit.aot_module(torch.nn.Linear(4, 2), aotkit.compilers.nop)
        >>> m(torch.randn(3, 4)).sum().backward()
        >>> m.orig_module.weight.grad.shape
        torch.Size([2, 4])
    """
    if not isinstance(mod, nn.Module):
        raise ArgumentError(f"aot_module compiles an nn.Module, got {type(mod).__name__}.\n"
                            "Fix: use aotkit.aot_function for plain functions.")
    if isinstance(mod, torch.jit.ScriptModule):
        raise ArgumentError(
            f"aot_module cannot compile a TorchScript module ({type(mod).__name__}): its "
            "forward is TorchScript code, which aotkit does not trace.\nFix: pass the eager "
            "nn.Module it was scripted from.")
    if isinstance(mod, nn.parallel.DistributedDataParallel):
        raise ArgumentError(
            "aot_module cannot compile DistributedDataParallel: its forward prepares the "
            "gradient reducer in Python at every call, which a compiled graph runs only while "
            "tracing.\nFix: wrap the compiled module instead, DistributedDataParallel("
            "aot_module(model, ...)), or use torch.compile(ddp_model, backend='aotkit').")
    if _sharded(mod):
        raise ArgumentError(
            "aot_module cannot compile a module sharded by FSDP (fully_shard or "
            "FullyShardedDataParallel): its hooks gather and free parameters in Python around "
            "every forward, which a compiled graph would run only while tracing.\nFix: compile "
            "before sharding, fully_shard(aot_module(layer, ...)) for each layer, then "
            "fully_shard(model).")
    options = AotOptions(fw_compiler, bw_compiler, partition_fn, decompositions, 0,
                         keep_inference_input_mutations, inference_compiler, dynamic)
    return AotModule(mod, options)


def _sharded(mod: nn.Module) -> bool:
    """Is ``mod`` or a module in it sharded by FSDP? (Only when FSDP was imported.)"""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = tuple(getattr(fsdp, k) for k in ("FSDPModule", "FullyShardedDataParallel")
                  if hasattr(fsdp, k))
    return bool(kinds) and any(isinstance(m, kinds) for m in mod.modules())
