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
tensor by identity):

* the globals its code loads (its nested code too: comprehensions, lambdas; not those it or
  a function nested in it assigns, nor attribute names) and the variables it closes over (not
  those it assigns: a ``nonlocal`` counter), when they hold a plain value (a number, string,
  bool, None, enum, dtype, device, layout, memory format, slice, range, bytes, a tuple or
  frozenset of such) or a tensor when it is compiled, or are not assigned yet, read again at
  every call; a decorator module's globals are named by module (``the global mylib.DEBUG``);
* its default argument values, and a ``functools.partial``'s arguments;
* the attributes its code names (``self.temperature``, and those named by the methods of the
  object's class it names, ``self.helper()``; not those it assigns) of the object it is bound
  to: a bound method's (``aot_function(sampler.logits)``, a classmethod's class), a callable
  object's (``__call__``) and a module's (``forward``; ``model.eval()`` sets
  ``self.training``).

The function is looked into through every level of what wraps it: decorators
(``__wrapped__``, through any object), ``functools.partial``, bound methods, callable objects
and another ``aot_function``.

A change is a recompile naming it (``the global LR changed: float 1.0 -> float 0.1``,
``self.temperature changed: ...``). Not keyed: values read by the functions it calls (but its
object's methods), attributes it does not name (a scheduler's step counter on the same object:
keying every attribute recompiled at every call), and objects other than tensors held in
globals or closed over (a config object, a logger): pass those as arguments. Modules have their
own watch (Note [What a trace reads besides its inputs]). ``aot_module``'s forward is not
looked into: a module's attributes are read while tracing (README).
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import numbers
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from aotkit.aot.signature import Keyed, _attribute_key, _Identity, _plain_object, _Walk

_VALUES = (bool, str, bytes, type(None), numbers.Number, enum.Enum, torch.dtype, torch.device,
           torch.layout, torch.memory_format, slice, range, torch.Tensor)
_ITEMS = 64


class _Unset:
    """What a getter reads for a global not (yet) defined or a cell not (yet) assigned."""

    def __repr__(self) -> str:
        return "unset"


_UNSET = _Unset()


def _capturable(value: Any) -> bool:
    try:
        if isinstance(value, (tuple, frozenset)):
            return len(value) <= _ITEMS and all(map(_capturable, value))
        numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ == "bool"
        return isinstance(value, _VALUES) or numpy_bool  # np.bool_ is no numbers.Number
    except Exception:  # a proxy whose __class__ raises: an object, not keyed
        return False


def key(value: Any) -> Keyed:
    """The key of a captured value now: as an object argument's attribute's (a value whose
    own ``__repr__`` or ``__eq__`` raises is keyed by identity)."""
    if value is _UNSET:
        return Keyed(_UNSET)
    try:
        return Keyed(_attribute_key(value, 1, _Walk()))
    except Exception:  # a user's __repr__ raising: its identity still keys it
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
    levels = list(_levels(fn))
    functions = [f for f, _ in levels if isinstance(f, types.FunctionType)]
    home = functions[-1].__globals__ if functions else {}
    for level, owner in levels:
        if isinstance(level, functools.partial):
            _partial_arguments(level, found)
        elif owner is not None:
            _attributes_named(owner, level, found)
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
            todo.append((getattr(fn, "__wrapped__", None), None))
        elif isinstance(fn, types.MethodType):
            todo.append((fn.__func__, fn.__self__))
        elif isinstance(fn, functools.partial):
            yield fn, None
            todo.append((fn.func, None))
        elif isinstance(fn, torch.nn.Module):
            todo.append((fn.forward, None))
        else:  # a callable object (its __call__ runs), a class-based decorator, aot_function
            if (call := _python_call(fn)) is not None and not getattr(fn, "_aotkit_opaque", False):
                todo.append((call, fn))
            todo.append((getattr(fn, "__wrapped__", None), None))


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
        if _capturable(space[name]) if name in space else name not in builtins:
            found.add(shown, lambda name=name: space.get(name, _UNSET))
    assigned = _names(code, ("STORE_DEREF", "DELETE_DEREF"))  # a nonlocal counter
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        value = _contents(cell)
        if name not in assigned and (value is _UNSET or _capturable(value)):
            found.add(f"the closed-over {name}", lambda cell=cell: _contents(cell))
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


def _attributes_named(owner: Any, fn: types.FunctionType, found: Captured) -> None:
    """Add the attributes of ``owner`` that ``fn`` (and the methods of its class it names)
    names and does not assign."""
    if _plain_object(owner):
        found.owners.append(owner)
    who = owner.__name__ if isinstance(owner, type) else "self"
    for name in sorted(_named(type(owner) if not isinstance(owner, type) else owner, fn)):
        if _attribute(owner, name) not in (_UNSET, _METHOD):
            found.add(f"{who}.{name}", lambda name=name: _attribute(owner, name))


def _named(cls: type, fn: types.FunctionType) -> set[str]:
    """The attribute names ``fn``'s code and the methods of ``cls`` it names read, less those
    they assign."""
    read: set[str] = set()
    assigned: set[str] = set()
    todo, seen = [fn.__code__], set()
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        names = {n for inner in _nested(code) for n in inner.co_names}
        read |= names
        assigned |= _names(code, ("STORE_ATTR", "DELETE_ATTR"))
        todo += [c for n in names if (c := _method_code(cls, n)) is not None]
    return read - assigned


def _method_code(cls: type, name: str) -> types.CodeType | None:
    for klass in cls.__mro__:
        if name in vars(klass):
            member = vars(klass)[name]
            member = getattr(member, "fget", None) or getattr(member, "__func__", member)
            code = getattr(member, "__code__", None)
            return code if isinstance(code, types.CodeType) else None
    return None


def _attribute(owner: Any, name: str) -> Any:
    """``owner.name`` as a read finds it, without running a property or ``__getattr__``:
    ``_UNSET`` where absent, ``_METHOD`` for a method or another descriptor."""
    state = getattr(owner, "__dict__", None)
    if not isinstance(owner, type) and state is not None and name in state:
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


def held_modules(fn: Callable[..., Any]) -> list[torch.nn.Module]:
    """The modules ``fn``'s code loads from its globals or closes over, as they are now (a
    ModuleList it loops over: Note [What a trace reads besides its inputs])."""
    values = []
    for level, owner in _levels(fn):
        if isinstance(level, types.FunctionType) and owner is None:
            values += [level.__globals__.get(name) for name in _global_loads(level.__code__)]
            values += [_contents(cell) for cell in level.__closure__ or ()]
    return [v for v in values if issubclass(type(v), torch.nn.Module)]  # not v.__class__
