"""Input signatures: what a compiled entry is keyed on, and how two signatures differ."""

from __future__ import annotations

import array
import enum
import numbers
import os
import re
import struct
import traceback
import types
import weakref
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from aotkit import config
from aotkit.aot.subclass import is_subclass, layout_of, parts
from aotkit.compat import guard_globals, source_name, treespec_children
from aotkit.errors import UnsupportedError


def _not_strided(t: torch.Tensor) -> UnsupportedError:
    what = f"aotkit cannot take a tensor with layout {t.layout} (shape {tuple(t.shape)}) as an " \
        "input (an argument, or a parameter or buffer of an aot_module)"
    if t.layout is torch._mkldnn:  # type: ignore[attr-defined]
        return UnsupportedError(f"{what}: fake tensors cannot hold it.\nFix: pass it dense "
                                "(.to_dense()).")
    return UnsupportedError(
        f"{what}: it traces sparse tensors only as constants the function reads.\nFix: pass it "
        "dense (.to_dense()), read it from a closure or an attribute of an object outside the "
        "compiled module instead, or use torch.compile(..., backend='aotkit'), which runs the "
        "sparse ops outside the graph.")


def leaf_key(leaf: Any, dynamic: bool) -> tuple[Any, ...]:
    """What about one flattened argument decides the traced graph."""
    if type(leaf) is Keyed:  # a value the function captures (Note [Values a function captures])
        return leaf.key
    if type(leaf) in weakref.ProxyTypes:
        return _proxy_key(leaf, 0, _Walk())
    if isinstance(leaf, torch.Tensor):
        if is_subclass(leaf):  # Note [Tensor subclasses]
            sub = layout_of(leaf)
            return (sub.key, *(leaf_key(p, dynamic) for p in parts(leaf, sub)))
        layout = leaf.layout
        if leaf.is_nested:  # not a subclass: torch.strided's nested tensors have no sizes
            raise UnsupportedError(
                "aotkit cannot trace nested tensors with layout=torch.strided (they have no "
                "sizes or strides to fake).\nFix: make it with torch.nested.nested_tensor(..., "
                "layout=torch.jagged), which aotkit traces.")
        if layout is not torch.strided:
            raise _not_strided(leaf)
        rg = leaf.requires_grad
        return (
            leaf.dtype,
            leaf.device,
            layout,
            rg,
            rg and leaf.is_leaf,
            leaf.dim() if dynamic else leaf.shape,
            None if dynamic else leaf.stride(),
            leaf.is_conj(),  # the graph reads its storage conjugated / negated
            leaf.is_neg(),
            type(leaf),  # Note [Subclasses with __torch_function__]
        )
    # -0.0 == 0.0 but 1 / -0.0 is -inf; nan != nan. NumPy's float scalars too (np.float32).
    # Decimal("-0") == Decimal("0") too.
    if isinstance(leaf, (float, complex)) or (
            isinstance(leaf, numbers.Number) and not isinstance(leaf, numbers.Rational)):
        return (type(leaf), repr(leaf))
    if (contents := _contents_key(leaf)) is not None:
        return contents
    if issubclass(type(leaf), torch.nn.Module):  # not by its __eq__; freed with its next fold
        return Collectable(leaf)
    if _by_identity(leaf) or not _hashable(leaf):
        return _object_key(leaf, 0, _Walk()) if _plain_object(leaf) else _Identity(leaf)
    if getattr(type(leaf), "__dataclass_fields__", None) is not None:  # Note [Keys compared
        values = _typed(leaf, _Walk(), plain_only=True)  # by ==]
        if values is not None:
            return (type(leaf), values)
        return (type(leaf), _ByEq(leaf), _typed(leaf, _Walk()))
    return (type(leaf), leaf)


class _ByEq:
    """A key part compared by its value's own ``==``, an error or a non-bool answer (a tensor
    field of a frozen dataclass) counting as unequal: traced again, not a raw error."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if type(other) is not _ByEq:
            return False
        if other.value is self.value:
            return True
        try:
            return bool(self.value == other.value)
        except Exception:
            return False

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


# Note [Keys compared by ==]
# A key part compared with its own ``==`` says 1 == 1.0 == True and 0.0 == -0.0, yet a graph
# traced for one computes in another dtype or sign (``torch.full((2,), k)``, ``1 / k``), and it
# never matches a NaN it holds (a recompile at every call). So numbers are keyed with their type,
# floats by repr; a frozenset, range or slice by its items (``_contents_key``); a hashable
# dataclass whose fields are such values (``Cfg(lr=0.1)``) by them. Other hashable objects are
# still compared by their own ``==``, and so are the contexts of the argument structure's nodes
# (dict keys, custom nodes' contexts), which its TreeSpec compares; a dataclass holding other
# objects, and those contexts (in a ``_Structure`` beside the TreeSpec), add what ``==``
# misses: the types of the values and the signs of the floats, through containers
# (``_typed``). That refines ``==`` and never compares by identity, since flattening makes
# contexts anew at every call. Contexts ``==`` cannot mislead (None, a class, a list of
# strings: almost every call's) are left to the TreeSpec. Still compared by ``==`` alone, so
# 1 and 1.0 share a graph there: hashable objects that are not dataclasses of plain values (a
# slotted class with its own ``__eq__``, a tuple subclass registered as a leaf) and frozensets
# past 64 items; a NaN in a context never matches (the TreeSpec's ``==``), so it traces again.
def _typed(value: Any, walk: _Walk, depth: int = 0, plain_only: bool = False) -> Any:
    """What ``==`` does not see of ``value``: the type of each value it holds, with ints,
    strings, bytes, None, enums and the like by value and floats (any non-rational number, NumPy's
    too) by repr, through lists, tuples, dicts, sets and dataclass fields, ``walk.left`` values
    in all. Other objects, and what lies past those limits, count by their type alone, or, with
    ``plain_only``, make the answer None (then compared by their own ``==``)."""
    walk.left -= 1
    kind = type(value)
    if isinstance(value, numbers.Number) and not isinstance(value, numbers.Rational):
        return (kind, repr(value))
    if kind in _PLAIN or isinstance(value, (enum.Enum, numbers.Rational)):
        return (kind, value)
    items: list[Any] | None = None
    if depth >= _DEPTH or walk.left < 0:
        pass
    elif kind in (list, tuple, dict, set, frozenset) and len(value) <= walk.left:
        if kind is dict:
            items = [_typed(v, walk, depth + 1, plain_only)
                     for pair in value.items() for v in pair]
        else:
            items = [_typed(v, walk, depth + 1, plain_only) for v in value]
            if kind is not list and kind is not tuple:  # unordered
                items = [None] if None in items else [frozenset(items)]
    elif (fields := getattr(kind, "__dataclass_fields__", None)) is not None:
        items = [_typed(getattr(value, name, None), walk, depth + 1, plain_only)
                 for name in fields]
    if items is not None and not (plain_only and None in items):
        return (kind, *items)
    return None if plain_only else kind


# Note [Objects as arguments]
# An argument that is neither a tensor nor a value (a dataclass of hyperparameters, an argparse
# Namespace, any object compared by identity) is a constant of the graph, and tracing reads its
# attributes as they are then (``x / hp.temperature``). Keyed by identity alone, an attribute
# changed between calls (a temperature annealed each epoch) left the graph stale. So the key
# holds the object's attributes too, through lists, tuples, dicts and such objects down to
# _DEPTH levels: a tensor by identity (the graph holds the one it read as a constant, so
# in-place changes show), a number by its repr, a string, bool, None, enum, dtype or device by
# value, anything else by identity (its own ``__eq__`` may raise or never hold), holding a
# reference so that the id is not reused. Only objects keeping all their state in ``__dict__``
# are keyed by attributes (not ``functools.partial``, a ``list`` subclass, slotted classes);
# they, deeper levels, containers of more than _ITEMS items, objects past the first _BUDGET
# values of an argument and modules (Note [What a trace reads besides its inputs]) are keyed by
# identity alone. Every attribute counts, read by the function or not: one changed at
# every call (a step counter) is a recompile each time, until the recompile limit names it.
# Five levels reach a scheduler's ``trainer.opt.param_groups[0]["lr"]`` (at three, the lr was
# keyed by its dict's identity and a changed lr silently kept the traced one); what the limits
# leave keyed by identity is named in an ``identity_key`` decision (once per function and
# part). A dict keyed by tensors (an optimizer's per-parameter ``state``) is walked after the
# object's other attributes: walked first, it spent the 256 values before the optimizer's
# ``param_groups`` came, and a changed lr was not seen.
_DEPTH = 5
_ITEMS = 64
_BUDGET = 256
_OPAQUE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.ModuleType, torch.nn.Module, torch.Generator)
_PLAIN = frozenset({bool, int, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})


def class_forward(cls: type) -> Any:
    """The ``forward`` a module class defines, as the class holds it: ``cls.forward`` unless
    each access makes a new function (a ``functools.partialmethod``), whose identity could not
    tell ``Net.forward = ...`` patched after compiling from no change."""
    forward = cls.forward  # type: ignore[attr-defined]
    if forward is cls.forward:  # type: ignore[attr-defined]
        return forward
    return next(c.__dict__["forward"] for c in cls.__mro__ if "forward" in c.__dict__)


class _Object(tuple):  # type: ignore[type-arg]
    """The key of an object argument: ``(type, number of attributes, ((attribute, key), ...))``.
    Not its identity: equal objects made anew at every call (``f(x, Hparams(0.1))``) share a
    graph."""


def _by_identity(value: Any) -> bool:
    """Compared by identity: unhashable, or hashed as ``object`` hashes."""
    hash_ = type(value).__hash__
    return hash_ is None or hash_ is object.__hash__


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except (TypeError, RecursionError):  # a frozen dataclass holding a list; one holding itself
        return False
    return True


def _plain_object(value: Any) -> bool:
    """An instance of Python classes that keep all its state in ``__dict__``: no slots, no
    base written in C but ``object`` (``functools.partial``, a ``list`` subclass and
    ``random.Random`` keep theirs elsewhere). The empty ``__slots__`` of ``abc.ABC``,
    ``typing.Generic`` and ``collections.abc`` bases hold nothing: their subclasses (a
    transformers cache layer, a ``UserDict``) are plain."""
    try:
        state = getattr(value, "__dict__", None)
    except Exception:  # a __dict__ property that raises: an object of its own making
        return False
    if isinstance(value, _OPAQUE) or not isinstance(state, dict) \
            or getattr(type(value), "_aotkit_opaque", False):  # an aot_function: its cache
        return False
    cls = value.__class__ if type(value) in weakref.ProxyTypes else type(value)
    return cls.__basicsize__ <= _PLAIN_SIZE and not any(_has_slots(c) for c in cls.__mro__)


def _has_slots(cls: type) -> bool:
    """Whether ``cls`` declares slots holding values (not only ``__dict__`` or ``__weakref__``)."""
    slots = vars(cls).get("__slots__", ())
    names = (slots,) if isinstance(slots, str) else tuple(slots)
    return any(n not in ("__dict__", "__weakref__") for n in names)


# An instance no bigger than an ``object`` and its ``__dict__`` pointer keeps no state in C
# (``functools.partial``: 64 bytes on CPython 3.11, a plain class's instance: 24).
_PLAIN_SIZE = object.__basicsize__ + struct.calcsize("P")


class _Identity:
    """A key part compared by identity that holds its object, so that its id is not reused."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)

    def __repr__(self) -> str:
        return f"a {type(self.value).__name__} object"


class Collectable(_Identity):
    """Identity of a module that the key does not keep alive: a model rebound for the next
    fold (``model = Net()``) is freed with its graph's entry, which no call can match again."""

    __slots__ = ("id", "kind", "ref")

    def __init__(self, value: Any) -> None:  # not its class: a parametrized one holds it
        self.ref, self.id, self.kind = weakref.ref(value), id(value), type(value).__name__

    @property
    def value(self) -> Any:  # type: ignore[override]
        return self.ref()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Collectable) and (v := self.ref()) is not None and v is other.ref()

    def __hash__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"a {self.kind} object{'' if self.ref() is not None else ' since freed'}"


def collected(key: Any) -> bool:
    """Whether an entry's key holds a module that is gone: no call matches it again."""
    return any(part.ref() is None for part in modules_in(key))


def modules_in(key: Any) -> list[Collectable]:
    """The modules an entry's key holds (weakly)."""
    if isinstance(key, (tuple, frozenset)):
        return [m for k in key for m in modules_in(k)]
    return [key] if isinstance(key, Collectable) else []


class Keyed:
    """A value keyed already: its key (a captured value's, Note [Values a function
    captures])."""

    __slots__ = ("key",)

    def __init__(self, key: Any) -> None:
        self.key = key


class _Walk:
    """How many more values an argument's key may hold, and, when ``cut`` is a list, the
    paths below which it holds identities for lack of depth, size or values left."""

    __slots__ = ("cut", "left")

    def __init__(self, cut: list[str] | None = None) -> None:
        self.left = _BUDGET
        self.cut = cut

    def cut_at(self, path: str | None, value: Any) -> _Identity:
        if self.cut is not None and path is not None:
            self.cut.append(path)
        return _Identity(value)


def _item_text(key: Any) -> str:
    return repr(key) if type(key) in (str, int, float, bool) else f"<{type(key).__name__}>"


def _object_key(obj: Any, depth: int, walk: _Walk, path: str | None = None) -> _Object | _Identity:
    attributes = vars(obj)
    if len(attributes) > walk.left:
        return walk.cut_at(path, obj)
    # Per-tensor state last (an optimizer's ``state`` before its ``param_groups``).
    ordered = sorted(attributes.items(), key=lambda item: _keyed_by_tensors(item[1]))
    return _Object((type(obj), len(attributes), tuple(
        (name, _attribute_key(value, depth + 1, walk, path and f"{path}.{name}"))
        for name, value in ordered)))


def _attribute_key(value: Any, depth: int, walk: _Walk, path: str | None = None) -> Any:
    """See Note [Objects as arguments]. ``path`` names ``value`` when ``walk`` collects cuts."""
    walk.left -= 1
    kind = type(value)
    if kind in _PLAIN:
        return (kind, value)
    if kind is float or kind is complex:  # nan != nan; -0.0 == 0.0
        return (kind, repr(value))
    if kind in weakref.ProxyTypes:
        return _proxy_key(value, depth, walk, path)
    if isinstance(value, torch.Tensor):
        return _Identity(value)
    if issubclass(kind, torch.nn.Module):  # a model rebound for the next fold is freed
        return Collectable(value)
    if isinstance(value, enum.Enum):
        return (kind, value)
    if isinstance(value, numbers.Number):  # numpy scalars
        return (kind, repr(value))
    container = isinstance(value, (list, tuple, dict))
    if depth >= _DEPTH or walk.left < 0:
        return walk.cut_at(path, value) if container or _plain_object(value) else _Identity(value)
    if container and len(value) <= _ITEMS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return (type(value), tuple((_attribute_key(k, depth + 1, walk),
                                    _attribute_key(v, depth + 1, walk,
                                                   path and f"{path}[{_item_text(k)}]"))
                                   for k, v in items))
    if container:
        return walk.cut_at(path, value)
    if _plain_object(value):
        return _object_key(value, depth, walk, path)
    if walk.cut is not None and _state_unseen(value):  # keyed by identity either way: no
        return walk.cut_at(path, value)  # hashing a frozen slotted object at every call
    return _contents_key(value) or _Identity(value)


def _proxy_key(proxy: Any, depth: int, walk: _Walk, path: str | None = None) -> Any:
    """A ``weakref.proxy``: keyed by identity and, alive, by what is read through it (a plain
    object's attributes: Note [Objects as arguments]); dead (asked anything, it raises), by
    identity alone: a function reading it traces again and raises as eager does."""
    if _dead_proxy(proxy):
        return _Identity(proxy)
    cls = proxy.__class__
    if issubclass(cls, _OPAQUE) or not _plain_object(proxy):
        return (_Identity(proxy), cls)
    return (_Identity(proxy), _object_key(proxy, depth, walk, path))


def _dead_proxy(value: Any) -> bool:
    """A ``weakref.proxy`` whose object is gone."""
    if type(value) not in weakref.ProxyTypes:
        return False
    try:
        value.__class__  # noqa: B018
    except ReferenceError:
        return True
    return False


def _state_unseen(value: Any) -> bool:
    """An instance keeping state in slots (``@dataclass(slots=True)``), which its key does not
    read: keyed by identity, an in-place change is not seen."""
    return (_by_identity(value) or not _hashable(value)) and not isinstance(value, _OPAQUE) \
        and any(_has_slots(c) for c in type(value).__mro__)


def _keyed_by_tensors(value: Any) -> bool:
    """A dict keyed by tensors (an optimizer's ``state``, per parameter): walked after an
    object's other attributes, so that it does not spend a key's values before them."""
    return issubclass(type(value), dict) and bool(value) \
        and issubclass(type(next(iter(value))), torch.Tensor)  # type(): a dead proxy raises


def identity_keyed_parts(leaf: Any, name: str) -> list[str]:
    """The parts of an object argument its key holds by identity for lack of depth, size or
    values left (Note [Objects as arguments]): changed in place, they are not seen."""
    if _dead_proxy(leaf):
        return []
    if _state_unseen(leaf):
        return [name]
    if not _plain_object(leaf) or not (_by_identity(leaf) or not _hashable(leaf)):
        return []
    walk = _Walk(cut=[])
    _object_key(leaf, 0, walk, name)
    return walk.cut


# Note [Values compared by contents]
# A slice, set, bytearray, array.array, NumPy array or torch.finfo / iinfo argument is a value
# the trace reads (``float(a)``, ``len(s)``, ``x[s]``) into constants of the graph, but none
# hashes by its value. Keyed by identity, one changed in place (``a[...] = 5.0``) reused a graph
# holding the old value, silently, and an equal slice made anew at every call (``f(x,
# slice(0, 3))``) traced again each time until the recompile limit. So they are keyed by their
# contents, up to _ITEMS elements, a set's items as other arguments are (``{1}``, ``{1.0}`` and
# ``{True}`` are equal sets that trace other dtypes). A buffer (bytearray, array.array, NumPy
# array) is keyed by identity too: the graph may hold a tensor sharing its memory
# (``torch.from_numpy(a)``), which an equal array made anew does not share. A bigger buffer,
# such as a data batch read through ``torch.from_numpy``, is keyed by identity alone: in-place
# changes then show through the memory the graph shares, as in eager.
class _Contents(tuple):  # type: ignore[type-arg]
    """``(type, description, *contents)``: see Note [Values compared by contents]."""


def _contents_key(value: Any) -> _Contents | None:
    kind = type(value)
    if kind is slice:
        parts = (value.start, value.stop, value.step)
        return _Contents((kind, repr(value), tuple(_attribute_key(p, _DEPTH, _Walk()) for p in parts)))
    if kind is range:
        return _Contents((kind, repr(value), (value.start, value.stop, value.step)))
    if (kind is set or kind is frozenset) and len(value) <= _ITEMS:
        items = frozenset(_attribute_key(v, 1, _Walk()) for v in value)
        return _Contents((kind, _short(repr(value)), items))
    if kind in (torch.finfo, torch.iinfo):
        return _Contents((kind, f"{kind.__name__}({value.dtype})", str(value.dtype)))
    if kind is bytearray and len(value) <= _ITEMS:
        return _Contents((kind, _short(repr(value)), _Identity(value), bytes(value)))
    if kind is array.array and len(value) <= _ITEMS:
        return _Contents((kind, _short(repr(value)), _Identity(value), value.tobytes()))
    if kind.__module__ == "numpy" and kind.__name__ == "ndarray" and value.size <= _ITEMS \
            and not value.dtype.hasobject:
        return _Contents((kind, _short(f"numpy array {value.tolist()} ({value.dtype})"),
                          _Identity(value), value.dtype.str, value.shape, value.tobytes()))
    return None


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def signature(structure: pytree.TreeSpec | int, leaves: Sequence[Any], dynamic: bool,
              config_parts: tuple[str, ...] = ("aot", "min_cut"),
              static: Collection[int] = (), context: tuple[Any, ...] | None = None,
              ) -> tuple[Any, ...]:
    """The key of one call: argument structure (a TreeSpec, or the count of a call made of
    positional tensors only), every leaf, and the call's :func:`call_context` (given as
    ``context`` where read already). Under ``dynamic`` the leaves at the positions in
    ``static`` (parameters and buffers) keep their sizes in the key: they are traced with
    static sizes."""
    if dynamic and static:
        keys = tuple(leaf_key(x, i not in static) for i, x in enumerate(leaves))
    else:
        keys = tuple(leaf_key(x, dynamic) for x in leaves)
    if type(structure) is not int and (contexts := _inexact_contexts(structure)):
        structure = _Structure(structure, contexts)  # type: ignore[assignment]
    return (structure, keys, repeated_tensors(leaves),
            *(call_context(config_parts) if context is None else context))


class _Structure:
    """An argument structure with the keys of its contexts that ``==`` could mislead (Note
    [Keys compared by ==])."""

    __slots__ = ("contexts", "spec")

    def __init__(self, spec: pytree.TreeSpec, contexts: tuple[Any, ...]) -> None:
        self.spec, self.contexts = spec, contexts

    def __eq__(self, other: object) -> bool:
        return type(other) is _Structure and self.contexts == other.contexts \
            and self.spec == other.spec

    def __hash__(self) -> int:
        return hash((self.spec, self.contexts))


def _inexact_contexts(spec: pytree.TreeSpec) -> tuple[Any, ...]:
    """``_typed`` of the node contexts of ``spec`` that are not None, a class or a list of
    strings (Note [Keys compared by ==])."""
    found = []
    stack = [spec]
    while stack:
        node = stack.pop()
        context = node.context
        if not (context is None or isinstance(context, type) or (
                type(context) is list and all(type(k) is str for k in context))):
            found.append(_typed(context, _Walk()))
        for child in treespec_children(node):
            if not child.is_leaf():  # a constant (register_constant) has no children
                stack.append(child)
    return tuple(found)


def _spec(structure: Any) -> Any:
    return structure.spec if type(structure) is _Structure else structure


def call_context(config_parts: tuple[str, ...]) -> tuple[Any, ...]:
    """What besides its arguments decides a call's graph: grad/autocast modes, backend flags,
    and the options of ``config_parts`` (:func:`aotkit.config.cache_key`)."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        *autocast_state(),  # CPU, CUDA
        # Read inside even while off: ``torch.autocast("cpu")`` without a dtype takes it.
        *map(torch.get_autocast_dtype, AUTOCAST_DEVICES),
        # Backend switches decide which kernels a composite op traces to (e.g. LSTM on CPU).
        torch.backends.mkldnn.enabled,
        torch.backends.cudnn.enabled,
        torch.are_deterministic_algorithms_enabled(),
        torch.get_default_dtype(),  # factories inside (torch.ones(3)) trace to it
        config.cache_key(*config_parts),
    )


# Note [One tensor passed twice]
# A call passing one tensor object at two positions (``f(x, x)``; ``mha(q, q, q)``) is traced
# as a function of that tensor once: the later positions read the first one's input, so the
# function sees one tensor there as eager does (``query is key`` picks self-attention's packed
# projection: separate ones round differently and, in eval, lay the output out otherwise), and
# the graph has one input for it, whose gradient is the sum eager accumulates. A subclass made
# of one tensor twice (``TwoTensor(x, x)``) is traced with one fake for both parts. Such a
# graph is right for calls that repeat a tensor at the same positions only, so which positions
# (and subclass parts) hold one tensor object is part of the key (tensors that merely share
# memory are separate inputs: Note [Overlapping mutated inputs]).
def tensor_positions(leaves: Sequence[Any]) -> tuple[list[int], dict[int, int]]:
    """The positions of the tensor leaves, each tensor object's first only, and for each
    later position of one, its first (Note [One tensor passed twice])."""
    first: dict[int, int] = {}
    copies: dict[int, int] = {}
    for i, x in enumerate(leaves):
        if issubclass(type(x), torch.Tensor):
            if id(x) in first:
                copies[i] = first[id(x)]
            else:
                first[id(x)] = i
    return list(first.values()), copies


def repeated_tensors(leaves: Sequence[Any]) -> tuple[tuple[Any, ...], ...]:
    """The positions of each tensor passed more than once, grouped (a subclass's part as
    ``(position, part)``); empty when none is."""
    subclasses = any(map(is_subclass, leaves))
    if not subclasses and len(set(map(id, leaves))) == len(leaves):  # the common case
        return ()
    at: dict[int, list[Any]] = {}
    for i, x in enumerate(leaves):
        if is_subclass(x):
            for k, p in enumerate(parts(x, layout_of(x))):
                at.setdefault(id(p), []).append((i, k))
        elif isinstance(x, torch.Tensor):
            at.setdefault(id(x), []).append(i)
    return tuple(tuple(group) for group in at.values() if len(group) > 1)


AutocastState = tuple[Any, ...]  # per device in AUTOCAST_DEVICES: its dtype, or False when off
AUTOCAST_DEVICES = ("cpu", "cuda")
NO_AUTOCAST: AutocastState = (False,) * len(AUTOCAST_DEVICES)


def autocast_state() -> AutocastState:
    """The dtype autocast casts to on each device of ``AUTOCAST_DEVICES``, ``False`` where it is
    off: graphs traced under autocast carry its casts, so a new dtype needs a new graph."""
    return tuple(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d)
                 for d in AUTOCAST_DEVICES)


_FIELDS = ("dtype", "device", "layout", "requires_grad", "is_leaf", "shape", "stride",
           "conjugate bit", "negative bit", "type")
_MODES = ("grad mode", "inference mode", "CPU autocast", "CUDA autocast",
          "CPU autocast dtype", "CUDA autocast dtype",
          "torch.backends.mkldnn.enabled", "torch.backends.cudnn.enabled",
          "deterministic algorithms", "the default dtype")


def describe_change(old: tuple[Any, ...], new: tuple[Any, ...], names: Sequence[str],
                    skip: int = 0) -> str:
    """A sentence naming every difference between two signatures.

    Example::

        >>> import torch
        >>> old = signature(1, [torch.ones(3, requires_grad=True)], dynamic=False)
        >>> with torch.no_grad():
        ...     new = signature(1, [torch.ones(4, requires_grad=True)], dynamic=False)
        >>> describe_change(old, new, ["args[0]"])
        'shape of args[0] changed: (3,) -> (4,); grad mode changed: True -> False'
    """
    found = [_short(phrase, _PHRASE) for phrase in differences(old, new, names, skip)]
    more = f"; and {len(found) - _PHRASES} more" if len(found) > _PHRASES else ""
    return "; ".join(found[:_PHRASES]) + more or "the signature changed"


# A reason names at most _PHRASES differences of at most _PHRASE characters each (a changed
# tuple of 5000 numbers, a 100 KB string: a reason of 200 KB in explain() and the logs).
_PHRASES, _PHRASE = 8, 300


def differences(old: tuple[Any, ...], new: tuple[Any, ...], names: Sequence[str],
                skip: int = 0) -> list[str]:
    """One phrase per difference between two signatures (the structure's, if it differs, alone:
    leaves of different structures do not correspond). ``skip``: leading positional arguments
    the caller did not pass (aot_module's parameters and buffers)."""
    if old[0] != new[0] and _spec(old[0]) == _spec(new[0]):
        return ["a dict key or a pytree node's context changed in type or sign "
                "(1 -> 1.0 -> True, 0.0 -> -0.0), which == does not tell apart"]
    old, new = (_spec(old[0]), *old[1:]), (_spec(new[0]), *new[1:])
    if old[0] != new[0] and isinstance(old[0], int) != isinstance(new[0], int) \
            and len(old[1]) == len(new[1]):  # a tensor argument became a value, or back
        found = [f"{name} changed: {_show(a)} -> {_show(b)}"
                 for name, a, b in zip(names, old[1], new[1], strict=True)
                 if _is_tensor_key(a) != _is_tensor_key(b)]
        if found:
            return found
    if old[0] != new[0]:
        before, after = _structure(old[0], skip), _structure(new[0], skip)
        if before == after and not isinstance(old[0], int) and not isinstance(new[0], int):
            path, before, after = _first_spec_difference(old[0], new[0], "")
            return [f"the structure of the arguments changed at {_argument_path(path, skip)}: "
                    f"{before} -> {after}"]
        return [f"the structure of the arguments changed: {before} -> {after}"]
    if len(old[1]) != len(new[1]):
        return [f"the number of arguments changed: {len(old[1])} -> {len(new[1])}"]
    found = [_leaf_change(name, a, b)
             for name, a, b in zip(names, old[1], new[1], strict=True) if a != b]
    grouped = {at[0] if isinstance(at, tuple) else at for group in (*old[2], *new[2])
               for at in group}
    if old[2] != new[2] and all(old[1][i] == new[1][i] for i in grouped):  # else said above
        found.append(f"the tensors passed more than once changed: {_repeated(old[2], names)} "
                     f"-> {_repeated(new[2], names)}")
    modes = {mode: (x, y) for mode, x, y in zip(_MODES, old[3:-1], new[3:-1], strict=True)
             if x != y}
    found += [f"{mode} changed: {x} -> {y}" for mode, (x, y) in modes.items()
              if not (mode.endswith("autocast dtype") and mode[:-6] in modes)]  # said there
    return found + config_changes(old[-1], new[-1])


def config_changes(old: tuple[tuple[str, Any], ...], new: tuple[tuple[str, Any], ...]) -> list[str]:
    """One phrase per option that differs between two :func:`aotkit.config.cache_key` values."""
    return [f"aotkit.config.{option} changed: {x!r} -> {y!r}"
            for (option, x), (_, y) in zip(old, new, strict=True) if x != y]


def _repeated(groups: tuple[tuple[Any, ...], ...], names: Sequence[str]) -> str:
    def name(at: Any) -> str:
        i, part = at if isinstance(at, tuple) else (at, None)
        where = names[i] if i < len(names) else f"leaf {i}"
        return where if part is None else f"part {part} of {where}"

    return "; ".join(" is ".join(map(name, group)) for group in groups) or "none"


def _leaf_change(name: str, a: Any, b: Any) -> str:
    if isinstance(a, _Identity) and isinstance(b, _Identity) and type(a.value) is type(b.value):
        if isinstance(b.value, torch.Generator):
            return (f"{name} is another torch.Generator object (a graph draws from the generator "
                    "it was traced with; pass the same one at every call, reseeding it outside "
                    "with g.manual_seed(...))")
        if type(b.value) in _PLAIN:  # a dtype or memory format: one object per value
            return f"{name} changed: {a.value} -> {b.value}"
        return f"{name} is another {type(b.value).__name__} object"
    if isinstance(a, _Contents) and isinstance(b, _Contents) and a[:2] == b[:2]:
        return (f"{name} is another {a[0].__name__} object, with equal contents (a buffer is "
                "keyed by identity too: the graph may hold a tensor sharing its memory; pass "
                "torch.as_tensor(...) of it for one entry whatever the object)")
    if not (isinstance(a, tuple) and isinstance(b, tuple)):
        return f"{name} changed: {_show(a)} -> {_show(b)}"
    if _is_subclass_key(a) and _is_subclass_key(b) and a[0] == b[0]:
        parts = _part_names(a[0])
        for part, x, y in zip(parts, a[1:], b[1:], strict=True):
            if x != y:
                return _leaf_change(f"{name}'s {part} (a {a[0][0].__name__} part)", x, y)
    if len(a) == len(b) == len(_FIELDS) and isinstance(a[5], torch.Size) \
            and isinstance(b[5], int):
        return (f"{name} is traced with symbolic sizes from now on: forward assigns this "
                "buffer anew, so its size may change")
    if len(a) == len(b) == len(_FIELDS):
        changed = [(f, x, y) for f, x, y in zip(_FIELDS, a, b, strict=True) if x != y]
        if any(f == "requires_grad" for f, _, _ in changed):  # is_leaf is "rg and is_leaf"
            changed = [c for c in changed if c[0] != "is_leaf"]
        return "; ".join(f"{_field_name(f, x)} of {name} changed: {_show(x)} -> {_show(y)}"
                         for f, x, y in changed)
    if _is_subclass_key(a) or _is_subclass_key(b):
        return f"{name} changed: {_kind(a)} -> {_kind(b)}"
    if (fields := _dataclass_field_changes(name, a, b)) is not None:
        return fields
    if isinstance(a, _Object) and isinstance(b, _Object) and a[:2] == b[:2]:
        return "; ".join(_attribute_changes(name, a, b))
    if _same_container(a, b) and (items := _item_changes(name, a, b)):  # a captured dict
        return "; ".join(items)
    return f"{name} changed: {_show(a)} -> {_show(b)}"


def _dataclass_field_changes(name: str, a: tuple[Any, ...], b: tuple[Any, ...]) -> str | None:
    """e.g. ``field scale of args[1] changed: int 1 -> float 1.0``, for two keys of one
    dataclass by its fields' ``_typed`` (Note [Keys compared by ==]); None for other keys."""
    cls = a[0]
    fields = getattr(cls, "__dataclass_fields__", None) if isinstance(cls, type) else None
    if fields is None or b[0] is not cls:
        return None
    typed = [k[-1] for k in (a, b)]
    if not all(isinstance(t, tuple) and t[:1] == (cls,) for t in typed):
        return None
    changes = [f"field {field} of {name} changed: {_typed_text(x)} -> {_typed_text(y)}"
               for field, x, y in zip(fields, typed[0][1:], typed[1][1:], strict=True) if x != y]
    return "; ".join(changes) or f"{name} changed: {_show(a[1])} -> {_show(b[1])}"


def _typed_text(typed: Any) -> str:
    """A ``_typed`` value as text: ``float 1.0``, ``int``, ``a tuple of 2 item(s)``."""
    if isinstance(typed, type):
        return typed.__name__
    if isinstance(typed, tuple) and len(typed) == 2 and isinstance(typed[0], type) \
            and not isinstance(typed[1], tuple):
        return f"{typed[0].__name__} {_short(str(typed[1]), 60)}"
    if isinstance(typed, tuple) and typed and isinstance(typed[0], type):
        return f"a {typed[0].__name__} of {len(typed) - 1} item(s)"
    return _short(repr(typed), 60)


def _attribute_changes(name: str, a: _Object, b: _Object) -> list[str]:
    """e.g. ``attribute temperature of args[1] changed: float 1.0 -> float 0.1``."""
    old, new = dict(a[2]), dict(b[2])
    found = []
    for attribute in [*old, *(k for k in new if k not in old)]:
        x, y = old.get(attribute, "<unset>"), new.get(attribute, "<unset>")
        if x == y:
            continue
        if isinstance(x, _Object) and isinstance(y, _Object) and x[:2] == y[:2]:
            found += _attribute_changes(f"{name}.{attribute}", x, y)
        elif _same_container(x, y) and (items := _item_changes(f"{name}.{attribute}", x, y)):
            found += items
        elif isinstance(x, _Identity) and isinstance(y, _Identity):
            found.append(f"attribute {attribute} of {name} is another "
                         f"{type(y.value).__name__} object")
        else:
            found.append(f"attribute {attribute} of {name} changed: {_show(x)} -> {_show(y)}")
    return found or [f"an attribute of {name} changed"]


def _same_container(x: Any, y: Any) -> bool:
    """Keys of a list, tuple or dict of as many items: ``(type, ((key, value), ...))``."""
    return type(x) is tuple and type(y) is tuple and len(x) == len(y) == 2 \
        and x[0] is y[0] and x[0] in (list, tuple, dict) and len(x[1]) == len(y[1])


def _item_changes(path: str, x: Any, y: Any) -> list[str]:
    """e.g. ``args[2].opt.param_groups[0]['lr'] changed: float 0.1 -> float 0.2``; nothing
    where the items' keys differ."""
    found = []
    for (k, v), (k2, v2) in zip(x[1], y[1], strict=True):
        where = f"{path}[{_show(k).split(' ', 1)[-1]}]"
        if k != k2:
            return []
        if v == v2:
            continue
        if isinstance(v, _Object) and isinstance(v2, _Object) and v[:2] == v2[:2]:
            found += _attribute_changes(where, v, v2)
        elif _same_container(v, v2) and (items := _item_changes(where, v, v2)):
            found += items
        else:
            found.append(f"{where} changed: {_show(v)} -> {_show(v2)}")
    return found


def _field_name(field: str, value: Any) -> str:
    # Under dynamic=True a tensor's key holds its number of dimensions in place of its shape.
    return "number of dimensions" if field == "shape" and isinstance(value, int) else field


def _is_subclass_key(key: tuple[Any, ...]) -> bool:
    """Is this ``leaf_key`` a subclass's: ``(Layout.key, *its parts' keys)``?"""
    return isinstance(key, tuple) and bool(key) and isinstance(key[0], tuple) and bool(key[0]) \
        and isinstance(key[0][0], type)


def _part_names(layout_key: tuple[Any, ...]) -> list[str]:
    """The names of a subclass's plain parts, in ``parts`` order, from its ``Layout.key``."""
    _, attrs, _, _, children, *_ = layout_key
    return [f"{attr}.{inner}" if child is not None else attr
            for attr, child in zip(attrs, children, strict=True)
            for inner in (_part_names(child) if child is not None else [""])]


def _is_tensor_key(key: Any) -> bool:
    return isinstance(key, tuple) and (len(key) == len(_FIELDS) or _is_subclass_key(key))


def _kind(key: tuple[Any, ...]) -> str:
    if _is_subclass_key(key):
        cls, attrs, ctx, requires_grad, *_ = key[0]
        return f"{cls.__name__}(parts {', '.join(attrs)}; context {ctx}; requires_grad={requires_grad})"
    return "a plain tensor" if isinstance(key, tuple) and len(key) == len(_FIELDS) else _show(key)


def _structure(s: pytree.TreeSpec | int, skip: int = 0) -> str:
    if isinstance(s, int):
        return f"{s - skip} positional tensor(s)"
    args_spec, kwargs_spec = s.child(0), s.child(1)
    kwargs = ", ".join(f"{k}=" for k in kwargs_spec.context)
    return (f"{args_spec.num_children - skip} positional argument(s) "
            f"({args_spec.num_leaves - skip} leaves)" + (f" and keywords {kwargs}" if kwargs else ""))


def _first_spec_difference(a: pytree.TreeSpec, b: pytree.TreeSpec, path: str,
                           ) -> tuple[str, str, str]:
    """Where two argument structures first differ (a pytree key path), and each one there."""
    if a.type is not b.type or a.context != b.context or a.num_children != b.num_children:
        return path, _container(a), _container(b)
    keys = a.context if isinstance(a.context, list) and len(a.context) == a.num_children \
        else range(a.num_children)
    for key, x, y in zip(keys, treespec_children(a), treespec_children(b), strict=True):
        if x != y:
            return _first_spec_difference(x, y, f"{path}[{key!r}]")
    return path, _container(a), _container(b)


def _container(spec: pytree.TreeSpec) -> str:
    if spec.is_leaf():
        return "a leaf"
    name = getattr(spec.context, "__name__", None) if spec.type.__name__ == "namedtuple" \
        else None  # a namedtuple's spec names its class in the context
    name = name or getattr(spec.type, "__name__", str(spec.type))
    article = "an" if name[0].lower() in "aeiou" else "a"
    if isinstance(spec.context, list):
        return f"{article} {name} with keys {spec.context}"
    shown = "" if spec.context is None or isinstance(spec.context, type) \
        else f" (context {_short(_repr(spec.context), 60)})"  # a custom node's
    return f"{article} {name} of {spec.num_children}{shown}"


def _argument_path(path: str, skip: int) -> str:
    """``[0][0]['b']`` (positional arguments, then the first one's key) as ``args[0]['b']``."""
    if path.startswith("[0]["):
        index, _, rest = path[4:].partition("]")
        return f"args[{int(index) - skip}]{rest}" if index.isdigit() else f"args{path[3:]}"
    if path.startswith("[1]"):
        return "kwargs" + path[3:]
    return path or "the arguments"


def _show(x: Any) -> str:
    if isinstance(x, tuple) and len(x) == len(_FIELDS) and isinstance(x[0], torch.dtype):
        dtype = str(x[0]).removeprefix("torch.")
        shape = f"{x[5]} dimension(s)" if isinstance(x[5], int) else f"shape {tuple(x[5])}"
        return f"a tensor ({dtype}, {shape})"
    if isinstance(x, _Identity):
        return repr(x)
    if isinstance(x, _Object):
        return f"a {x[0].__name__} object"
    if isinstance(x, _Contents):
        return x[1]
    if isinstance(x, tuple) and len(x) == 2 and x[0] is dict:
        keys = [_show(k).split(" ", 1)[-1] for k, _ in x[1][:8]]
        return f"a dict with keys [{', '.join(keys)}{', ...' if len(x[1]) > 8 else ''}]"
    if isinstance(x, tuple) and len(x) == 2 and x[0] in (list, tuple):
        return f"a {x[0].__name__} of {len(x[1])} item(s)"
    if isinstance(x, torch.Size):
        return str(tuple(x))
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], type):
        keyed_by_repr = issubclass(x[0], numbers.Number) and isinstance(x[1], str)
        shown = x[1] if keyed_by_repr else _repr(x[1])
        return f"{x[0].__name__} {_short(shown, 100)}"
    return repr(x)


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except ValueError:  # an int past Python's 4300 digits
        return f"of {value.bit_length()} bits" if isinstance(value, int) else "?"


def _static_sizes(shape_env: Any, fakes: Sequence[Any]) -> list[str]:
    """Guards for the sizes and strides the graph bakes in: traced as plain ints (sizes 0 and 1
    are specialized) or made constant while tracing (``int(x.shape[0])``, a size compared with a
    literal), which the ShapeEnv records as a replacement but not always as a guard."""
    guards = []
    for i, fake in enumerate(fakes):
        for what, values in (("size", fake.shape), ("stride", fake.stride())):
            for d, v in enumerate(values):
                constant = v if isinstance(v, int) else _constant(shape_env, v)
                if constant is not None:
                    guards.append(f"L['t{i}'].{what}()[{d}] == {constant}")
    return guards


def _constant(shape_env: Any, value: torch.SymInt) -> int | None:
    expr = shape_env.replace(value.node.expr)
    return int(expr) if expr.is_number else None


class ShapeGuard:
    """The size conditions a dynamic entry was traced under, e.g. ``2 <= L['t0'].size()[0]``
    (sizes 0 and 1 are specialized, so a batch of 1 needs its own entry)."""

    def __init__(self, shape_env: Any, fakes: Sequence[Any]) -> None:
        from torch._dynamo.source import LocalSource

        self.shape_env = shape_env
        sources = [LocalSource(f"t{i}") for i in range(len(fakes))]
        self.guards: list[str] = [*shape_env.produce_guards(fakes, sources), *_static_sizes(shape_env, fakes)]
        # Parenthesized: a guard may itself be an ``a or b``, which a bare ``and`` would split.
        self.code = " and ".join(f"({guard})" for guard in self.guards)
        # Compiled once: evaluating the source string would parse it again on every call.
        self._compiled = compile(self.code or "True", "<aotkit shape guard>", "eval")
        self._globals = guard_globals()

    def __call__(self, tensors: Sequence[torch.Tensor]) -> bool:
        env = {"L": {f"t{i}": t for i, t in enumerate(tensors)}}
        return bool(eval(self._compiled, self._globals, env))

    def explain(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> str:
        """Which guard ``tensors`` fail, in the caller's argument names: one whose origin in
        the user's code is known first (a size fixed by ``math.sqrt(x.shape[-1])`` fails its
        own guard and a stride guard derived from it, which names neither the size nor the
        line)."""
        failing = [g for g in self.guards
                   if not self.shape_env.evaluate_guards_expression(g, tensors)]
        if not failing:
            return "sizes fail the shape guards of the dynamic entry"
        guard, origin = next(((g, o) for g in failing if (o := self._origin(g)) is not None),
                             (failing[0], None))
        readable = re.sub(r"L\['t(\d+)'\]", lambda m: names[int(m.group(1))], guard)
        read = sorted({int(i) for i in re.findall(r"L\['t(\d+)'\]", guard)})
        shapes = ", ".join(f"{names[i]}: {tuple(tensors[i].shape)}" for i in read)
        where = f"; the trace fixed it at {origin}" if origin else ""
        return f"sizes fail the shape guard {readable} of the dynamic entry ({shapes}){where}"

    def _origin(self, guard: str) -> str | None:
        """The user's line where the trace compared or fixed the sizes ``guard`` reads
        (``x / math.sqrt(x.shape[-1])`` makes a size a Python number), if the ShapeEnv kept it."""
        wanted = {f"L['arg{i}'].{what}()[{d}]" for i, what, d in
                  re.findall(r"L\['t(\d+)'\]\.(size|stride)\(\)\[(\d+)\]", guard)}
        env = self.shape_env
        symbols = {sym for sym, sources in env.var_to_sources.items()
                   if any(source_name(src) in wanted for src in sources)}
        slocs = [g.sloc for g in env.guards if g.expr.free_symbols & symbols]
        slocs += [loc for sym, loc in getattr(env, "replacements_slocs", {}).items()
                  if sym in symbols]
        return next(filter(None, map(_user_location, slocs)), None)


def _user_location(sloc: Any) -> str | None:
    """``file:line in function`` of a ShapeEnv location, if it is in the user's code."""
    if sloc.maybe_user_loc is not None:
        return sloc.maybe_user_loc
    frame = sloc.framework_loc
    if not isinstance(frame, traceback.FrameSummary) or frame.filename.startswith(_LIBRARIES):
        return None
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


_LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
