"""Python values a function compiled with ``aot_function`` reads without taking them as
arguments, keyed with its arguments.

Note [Values a function captures]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Tracing reads a number where the function's code reads it, and the graph holds it as a
constant: ``x - LR * g`` with ``LR`` a global, ``x * scale`` with ``scale`` closed over, ``x /
self.temperature`` for a bound method ``aot_function(sampler.logits)``. Changed after compiling,
the old graph silently went on with the old value (PyTorch's ``aot_function`` too; Dynamo
guards on them). So the values the function's own code can read are keyed as extra arguments,
each as an object argument's attribute is (Note [Objects as arguments]: a number by its repr, a
tensor by identity, its dtype, size and strides watched with the graph's constants, Note
[Constants changed in place]):

* the globals its code loads (its nested code too: comprehensions, lambdas; not those it or
  a function nested in it assigns, nor attribute names) and the variables it closes over (not
  those it assigns: a ``nonlocal`` counter), when they hold a plain value (a number, string,
  bool, None, enum, dtype, device, layout, memory format, slice, range, bytes, a tuple or
  frozenset of such; a longer one, or one holding other objects, by identity), a tensor
  when it is compiled or a module (by identity: ``model = Net()`` again for the next fold
  runs another graph), or are not assigned yet, read again at
  every call; a decorator module's globals are named by module (``the global mylib.DEBUG``);
* its default argument values, and a ``functools.partial``'s arguments;
* a module's class's ``forward``, where the function is a module (``Net.forward = ...``
  patched after compiling; aot_module keys every submodule's class's in its layout);
* the attributes of the object it runs on that its code mentions (as an attribute, a name or
  a string: ``self.temperature``, ``s = self; s.temperature``, ``vars(self)["temperature"]``,
  also not set yet where it reads it from ``self``: ``hasattr``), with those the methods of
  the object's class it mentions mention (every definition along the MRO: ``super()``; the
  function a decorator in the class wraps; a descriptor's ``__get__``, and the names it holds
  as strings: ``obj.__dict__[self.key]``), less those it assigns
  on it (``self.calls += 1``); a method's name by what the instance itself holds under it (an
  override set later, ``model.act = torch.sigmoid``). A bound method's object (``aot_function(sampler.logits)``, a classmethod's class)
  has them keyed as an object argument's attributes. An object that is the function itself (a
  callable object's ``__call__``, a class-based decorator) and a module (``forward``;
  ``model.eval()`` sets ``self.training``) have them keyed as settings: plain values and
  tensors as such, anything else (a list, a dict, a function) by identity, since their
  containers hold bookkeeping changed in place at every call (``self.stats["calls"] += 1``, a
  cache); not a module's tensors (parameters and buffers have their own watch, and a pruned
  weight is made anew by a pre-hook at every call), nor names of tensor attributes they do not
  read from ``self``, ``type(self)`` or ``vars(self)``, or a local holding one of them
  (``x.mean()`` next to a running ``self.mean``). A name mentioned but not
  read can only cost a recompile, where a read missed would run a stale graph.

The function is looked into through every level of what wraps it: decorators
(``__wrapped__``, through any object), ``functools.partial``, bound methods, callable objects
and another ``aot_function``.

A change is a recompile naming it (``the global LR changed: float 1.0 -> float 0.1``,
``self.temperature changed: ...``). Not keyed: values read by the functions it calls (but its
object's methods; a submodule's attributes), attributes its code does not mention (a
scheduler's step counter on the same trainer: keying every attribute recompiled at every
call; ``getattr(self, name)`` of a variable name), and objects other than tensors and modules
held in globals or closed over (a config object, a logger): pass those as arguments. Modules have their
own watch (Note [What a trace reads besides its inputs]). ``aot_module``'s forward is not
looked into: a module's attributes are read while tracing (README).
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import inspect
import numbers
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from aotkit import config
from aotkit.aot.signature import (
    _ITEMS,
    Collectable,
    Keyed,
    _attribute_key,
    _Identity,
    _plain_object,
    _Walk,
    class_forward,
)

_VALUES = (bool, str, bytes, type(None), numbers.Number, enum.Enum, torch.dtype, torch.device,
           torch.layout, torch.memory_format, slice, range, torch.Tensor)


class _Unset:
    """What a getter reads for a global not (yet) defined or a cell not (yet) assigned."""

    def __repr__(self) -> str:
        return "unset"


_UNSET = _Unset()


def _capturable(value: Any) -> bool:
    kind = type(value)  # not value.__class__: a proxy's may raise, or run Python per call
    if issubclass(kind, (tuple, frozenset)):
        return len(value) <= _ITEMS and all(map(_capturable, value))
    return issubclass(kind, _VALUES) or config.is_numpy_bool(kind)  # np.bool_ is no Number


def _constant(value: Any) -> bool:
    """A plain value, or a tuple or frozenset beyond them (too long, or holding an object):
    immutable, so keyed by identity when not by value; or a module, keyed by identity (its
    parameters are the graph's constants)."""
    return _capturable(value) or issubclass(type(value), (tuple, frozenset, torch.nn.Module))


def key(value: Any) -> Keyed:
    """The key of a captured value now: as an object argument's attribute's (a value whose
    own ``__repr__`` or ``__eq__`` raises is keyed by identity)."""
    if value is _UNSET or isinstance(value, _Identity):
        return Keyed(value)
    try:
        keyed = _attribute_key(value, 1, _Walk())
        hash(keyed)
        return Keyed(keyed)
    except Exception:  # a user's __repr__ raising, an Enum with __eq__ but no __hash__
        return Keyed(_Identity(value))


@dataclasses.dataclass
class Captured:
    """What ``fn`` reads besides its arguments: names (for recompile reasons) and getters of
    the values now, and the objects its code runs as ``self`` (for Note [Tracing tensors left
    in argument objects])."""

    names: list[str] = dataclasses.field(default_factory=list)
    getters: list[Callable[[], Any]] = dataclasses.field(default_factory=list)
    owners: list[Any] = dataclasses.field(default_factory=list)

    def add(self, name: str, getter: Callable[[], Any]) -> None:
        if name not in self.names:
            self.names.append(name)
            self.getters.append(getter)


def captured_values(fn: Callable[..., Any]) -> Captured:
    """See Note [Values a function captures]; empty for most functions."""
    found = Captured()
    if isinstance(fn, torch.nn.Module):  # ``Net.forward = ...`` patched on the class
        found.add(f"the forward of class {type(fn).__name__}", lambda: class_forward(type(fn)))
    levels = list(_levels(fn))
    functions = [f for f, _ in levels if isinstance(f, types.FunctionType)]
    home = functions[-1].__globals__ if functions else {}
    for level, owner in levels:
        if isinstance(level, functools.partial):
            _partial_arguments(level, found)
        elif owner is not None:  # the object called itself, a module: its settings only
            settings = isinstance(owner, torch.nn.Module) or level is _python_call(owner)
            _attributes_named(owner, level, found, settings)
        else:
            _captured_by(level, home, found)
    return found


def _levels(fn: Any) -> Iterator[tuple[Any, Any]]:
    """``(function, None)`` for each function whose code runs when ``fn`` is called, ``(it,
    owner)`` for one run as a method of ``owner``, ``(partial, None)`` for each partial."""
    seen: dict[int, Any] = {}  # holding each: a bound method made here may be freed
    todo = [(fn, None)]
    while todo:
        fn, owner = todo.pop(0)
        if id(fn) in seen or fn is None:
            continue
        seen[id(fn)] = fn
        if isinstance(fn, types.FunctionType):
            yield fn, None
            if owner is not None:
                yield fn, owner
            todo.append((_wrapped(fn), owner))  # a method decorated in its class
        elif isinstance(fn, types.MethodType):
            todo.append((fn.__func__, fn.__self__))
        elif isinstance(fn, functools.partial):
            yield fn, None
            todo.append((fn.func, None))
        elif isinstance(fn, torch.nn.Module):
            todo.append((fn.forward, None))
        else:  # a callable object (its __call__ runs), a class-based decorator, aot_function
            if (call := _python_call(fn)) is not None and not inspect.getattr_static(
                    fn, "_aotkit_opaque", False):
                todo.append((call, fn))
            todo.append((_wrapped(fn), None))


def _wrapped(fn: Any) -> Any:
    """``fn.__wrapped__`` where ``fn`` has one (not made up by a ``__getattr__``)."""
    return inspect.getattr_static(fn, "__wrapped__", None)


def _python_call(obj: Any) -> types.FunctionType | None:
    call = type(obj).__call__ if callable(obj) and not isinstance(obj, type) else None
    return call if isinstance(call, types.FunctionType) else None


def _partial_arguments(partial: functools.partial, found: Captured) -> None:
    for i in range(len(partial.args)):
        found.add(f"argument {i} of {_name(partial)}",
                  lambda i=i: partial.args[i] if i < len(partial.args) else _UNSET)
    for name in partial.keywords:
        found.add(f"keyword {name} of {_name(partial)}",
                  lambda name=name: partial.keywords.get(name, _UNSET))


def _name(partial: functools.partial) -> str:
    return f"partial({getattr(partial.func, '__qualname__', type(partial.func).__name__)}, ...)"


def _global_loads(code: types.CodeType) -> set[str]:
    """The globals ``code`` (and the code nested in it: comprehensions, lambdas, functions)
    reads but does not assign (a counter it increments: its own doing at every call, which a
    trace runs once per pass). Attribute names (``x.t()``) are not globals, though
    ``co_names`` holds them too."""
    return _names(code, ("LOAD_GLOBAL", "LOAD_NAME")) - \
        _names(code, ("STORE_GLOBAL", "DELETE_GLOBAL"))


def _names(code: types.CodeType, opnames: tuple[str, ...]) -> set[str]:
    """The names the instructions ``opnames`` of ``code`` and the code nested in it take."""
    return {instruction.argval for inner in _nested(code)
            for instruction in dis.get_instructions(inner) if instruction.opname in opnames}


def _nested(code: types.CodeType) -> list[types.CodeType]:
    found = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += _nested(const)
    return found


def _captured_by(fn: types.FunctionType, home: dict[str, Any], found: Captured) -> None:
    """Add what one level of the function reads besides its arguments; ``home``: the innermost
    level's globals (the decorated function's own module)."""
    code = fn.__code__
    space, builtins = fn.__globals__, fn.__builtins__
    for name in sorted(_global_loads(code)):
        # A decorator's module is not the function's: its globals are named by module.
        shown = f"the global {name}" if space is home else \
            f"the global {space.get('__name__', '?')}.{name}"
        # Plain now, or not defined yet (assigned after compiling); not a builtin's name.
        if _constant(space[name]) if name in space else name not in builtins:
            found.add(shown, lambda name=name: _setting(space.get(name, _UNSET)))
    assigned = _names(code, ("STORE_DEREF", "DELETE_DEREF"))  # a nonlocal counter
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        value = _contents(cell)
        if name not in assigned and (value is _UNSET or _constant(value)):
            found.add(f"the closed-over {name}", lambda cell=cell: _setting(_contents(cell)))
    positional = code.co_varnames[:code.co_argcount]
    count = min(len(fn.__defaults__ or ()), len(positional))  # Python takes longer tuples
    defaults = {name: i for i, name in enumerate(positional[len(positional) - count:])}
    for name in (*defaults, *(fn.__kwdefaults__ or {})):
        found.add(f"the default value of {name}",
                  lambda name=name: _default(fn, name, defaults, count))


def _default(fn: types.FunctionType, name: str, positions: dict[str, int], count: int) -> Any:
    """The default value of parameter ``name`` now (``__defaults__`` may be replaced)."""
    if name in positions:
        values = (fn.__defaults__ or ())[-count:] if count else ()
        return values[positions[name]] if positions[name] < len(values) else _UNSET
    return (fn.__kwdefaults__ or {}).get(name, _UNSET)


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not assigned yet, or deleted
        return _UNSET


class _Method:
    """What ``_attribute`` reads for a method, property or other descriptor of the class."""


_METHOD = _Method()


def _attributes_named(owner: Any, fn: types.FunctionType, found: Captured,
                      settings: bool) -> None:
    """Add the attributes of ``owner`` that ``fn``'s code, or the code of the methods of
    ``owner``'s class it names, names and does not assign on it; with ``settings``, only those
    holding plain values."""
    if _plain_object(owner) or isinstance(owner, torch.nn.Module):
        found.owners.append(owner)
    who = owner.__name__ if isinstance(owner, type) else "self"
    named, read, assigned = _named(owner if isinstance(owner, type) else type(owner), fn)
    if settings:  # x.mean() would key a running self.mean: only reads from self count
        named = {n for n in named if n not in _TENSOR_NAMES or n in read}
    module = isinstance(owner, torch.nn.Module)
    for name in sorted(named - assigned):
        value = _attribute(owner, name)
        if value is _METHOD and not isinstance(owner, type) and _has_state(owner):
            # replaced on the instance later (``model.act = torch.sigmoid``): its entry there
            found.add(f"{who}.{name}", functools.partial(_instance_entry, vars(owner), name))
        if value is _METHOD or (value is _UNSET and name not in read) \
                or (module and issubclass(type(value), torch.Tensor)):
            continue
        found.add(f"{who}.{name}", lambda name=name: _setting(_attribute(owner, name))
                  if settings else _attribute(owner, name))


def _instance_entry(state: dict[str, Any], name: str) -> Any:
    return _setting(state.get(name, _UNSET))


def _has_state(owner: Any) -> bool:
    try:
        return type(vars(owner)) is dict
    except Exception:  # slots only, or a __dict__ property raising
        return False


def _setting(value: Any) -> Any:
    """A setting's value as keyed: a plain value or a tensor itself, anything else (a list, a
    dict, a function) by identity (bookkeeping changes containers in place at every call), a
    module without holding it."""
    if value is _UNSET or issubclass(type(value), torch.Tensor) or _capturable(value):
        return value
    return Collectable(value) if issubclass(type(value), torch.nn.Module) else _Identity(value)


def _named(cls: type, fn: types.FunctionType) -> tuple[set[str], set[str], set[str]]:
    """The names ``fn``'s code and the methods of ``cls`` it names (every definition along the
    MRO: ``super()``) mention (attributes, globals, strings: ``vars(self)["t"]``), those they
    read from their first argument (``hasattr(self, "t")``: also keyed while unset) and those
    they assign on it (``self.calls += 1``)."""
    named: set[str] = set()
    read: set[str] = set()
    assigned: set[str] = set()
    todo, seen = [fn], set()
    while todo:
        code = todo.pop().__code__
        if code in seen:
            continue
        seen.add(code)
        this = code.co_varnames[0] if code.co_argcount else None
        mentioned = set()
        for inner in _nested(code):
            mentioned |= {*inner.co_names, *_strings(inner.co_consts)}
            if this is not None:
                _self_accesses(inner, this, read, assigned)
        named |= mentioned
        todo += [f for name in mentioned for f in _definitions(cls, name)]
        named |= {n for name in mentioned for n in _descriptor_names(cls, name)}
    return named | read, read, assigned


_TENSOR_NAMES = frozenset(dir(torch.Tensor))


def _strings(consts: tuple[Any, ...]) -> set[str]:
    found = set()
    for c in consts:
        if isinstance(c, str) and c.isidentifier():
            found.add(c)
        elif isinstance(c, tuple):  # a match statement's keyword attributes
            found |= _strings(c)
    return found


def _self_accesses(code: types.CodeType, this: str, read: set[str], assigned: set[str]) -> None:
    """Add to ``read`` the attributes ``code`` loads from the variable ``this`` (its ``self``,
    or ``type(self)``, ``vars(self)``, ``self.__class__``, ``self.__dict__``) and to
    ``assigned`` those it stores on it, ``self.x = ...`` and ``self.x += ...``."""
    instructions = [i for i in dis.get_instructions(code) if i.opname not in _NO_VALUE]
    of_self = _of_self(instructions, this)
    augmented: set[str] = set()
    for k, ins in enumerate(instructions[1:], start=1):
        prev = instructions[k - 1]
        on_self = of_self[k - 1]
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and on_self:
            read.add(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and prev.opname in ("COPY", "DUP_TOP") \
                and k >= 2 and _loads(instructions[k - 2], this):  # self.x += ...
            read.add(ins.argval)
            augmented.add(ins.argval)
        elif ins.opname == "LOAD_CONST" and on_self and isinstance(ins.argval, str) \
                and ins.argval.isidentifier():  # getattr(self, "x"), hasattr(self, "x")
            read.add(ins.argval)
        elif ins.opname in ("STORE_ATTR", "DELETE_ATTR") and (
                on_self or (prev.opname in ("SWAP", "ROT_TWO") and ins.argval in augmented)):
            assigned.add(ins.argval)


# Instructions that push nothing a read takes (3.11's PRECALL before each CALL).
_NO_VALUE = frozenset({"PRECALL", "CACHE", "EXTENDED_ARG", "PUSH_NULL", "NOP"})


def _of_self(instructions: list[dis.Instruction], this: str) -> list[bool]:
    """Per instruction, whether it pushes ``this`` or its class or attribute dict, or a local
    holding one of them (``cls = type(self)``)."""
    pushed: list[bool] = []
    aliases = {this}
    for k, ins in enumerate(instructions):
        if ins.opname == "STORE_FAST" and k > 0 and pushed[k - 1]:
            aliases.add(ins.argval)
        pushed.append(any(_loads(ins, a) for a in aliases)
                      or (k > 0 and pushed[k - 1] and ins.opname == "LOAD_ATTR"
                          and ins.argval in ("__class__", "__dict__"))
                      or (k > 1 and ins.opname in ("CALL", "CALL_FUNCTION") and ins.arg == 1
                          and pushed[k - 1] and instructions[k - 2].opname == "LOAD_GLOBAL"
                          and instructions[k - 2].argval in ("type", "vars")))
    return pushed


def _descriptor_names(cls: type, name: str) -> set[str]:
    """Identifier strings a descriptor object of ``cls`` holds (the attribute ``__set_name__``
    gave it: ``obj.__dict__[self.key]``), which its ``__get__``'s code reads by variable."""
    member = inspect.getattr_static(cls, name, None)
    if isinstance(member, (types.FunctionType, property, classmethod, staticmethod, type)):
        return set()
    try:
        return {v for v in vars(member).values() if type(v) is str and v.isidentifier()}
    except Exception:  # no __dict__ of its own, or an odd one
        return set()


def _loads(instruction: dis.Instruction, name: str) -> bool:
    """Whether ``instruction`` pushes the local or closed-over variable ``name`` last."""
    value = instruction.argval
    last = value[-1] if isinstance(value, tuple) and value else value  # LOAD_FAST_LOAD_FAST
    return instruction.opname.startswith(("LOAD_FAST", "LOAD_DEREF")) and last == name


def _definitions(cls: type, name: str) -> list[types.FunctionType]:
    """Every definition of method (or property) ``name`` along ``cls``'s MRO, and the functions
    its decorators wrap."""
    found = []
    for klass in cls.__mro__:
        member = vars(klass).get(name)
        if isinstance(member, property):
            member = member.fget
        elif isinstance(member, (classmethod, staticmethod)):
            member = member.__func__
        elif isinstance(member, (functools.partialmethod, functools.cached_property)):
            member = member.func
        elif not isinstance(member, types.FunctionType) and member is not None:
            member = inspect.getattr_static(type(member), "__get__", None)  # a descriptor's
        while isinstance(member, types.FunctionType) and member not in found:
            found.append(member)
            member = _wrapped(member)
    return found


def _attribute(owner: Any, name: str) -> Any:
    """``owner.name`` as a read finds it, without running a property or ``__getattr__``:
    ``_UNSET`` where absent, ``_METHOD`` for a method or another descriptor."""
    try:
        state = vars(owner)
    except Exception:  # no __dict__ (slots only), or a __dict__ property raising
        state = {}
    state = state if isinstance(state, dict) else {}
    if not isinstance(owner, type) and name in state:
        return state[name]
    if isinstance(owner, torch.nn.Module):
        for kind in ("_parameters", "_buffers", "_modules"):
            if name in state.get(kind, ()):
                return state[kind][name]
    for klass in owner.__mro__ if isinstance(owner, type) else type(owner).__mro__:
        if name in vars(klass):
            member = vars(klass)[name]
            if isinstance(member, types.MemberDescriptorType):  # a slot
                try:
                    return member.__get__(owner)
                except AttributeError:
                    return _UNSET
            return _METHOD if hasattr(type(member), "__get__") else member
    return _UNSET


def held_values(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """The values ``fn``'s code loads from its globals or closes over, as they are now, named
    (``the global activations``, ``the closed-over trainer``)."""
    values = []
    for level, owner in _levels(fn):
        if isinstance(level, types.FunctionType) and owner is None:
            values += [(f"the global {name}", level.__globals__.get(name))
                       for name in sorted(_global_loads(level.__code__))]
            values += [(f"the closed-over {name}", _contents(cell))
                       for name, cell in zip(level.__code__.co_freevars, level.__closure__ or (),
                                             strict=True)]
    return values

