"""Python values a function compiled with ``aot_function`` reads without taking them as
arguments, keyed with its arguments.

Note [Values a function captures]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Tracing reads a number where the function's code reads it, and the graph holds it as a
constant: ``x - LR * g`` with ``LR`` a global, ``x * scale`` with ``scale`` closed over, ``x /
self.temperature`` for a bound method ``aot_function(sampler.logits)``. Changed after compiling,
the old graph silently went on with the old value (PyTorch's ``aot_function`` too; Dynamo
guards on them). So the values the function's own code can read are keyed as extra arguments:

* the globals its code loads (its nested code too: comprehensions, lambdas; not those it or
  a function nested in it assigns, nor attribute names) and the variables it closes over,
  when they hold a plain value (a number, string, bool, None, enum, dtype or device; a tuple
  of such, by its repr) when it is compiled or are not assigned yet, read again at every
  call; each level of a decorated function (``functools.wraps``'s ``__wrapped__``) counts,
  a decorator module's globals named by module (``the global mylib.DEBUG``);
* its default argument values;
* the object of a bound method, keyed by its attributes as an object argument is (Note
  [Objects as arguments]): ``aot_function(sampler.logits)`` recompiles where
  ``aot_function(Sampler.logits)(sampler, x)`` did.

A change is a recompile naming it (``the global LR changed: float 1.0 -> float 0.1``). Not
keyed: values read by the functions it calls, and objects held in globals or closed over (a
config object: Dynamo guards on the attributes read; keying every attribute would recompile at
every call on a logger's or a writer's counters): pass those as arguments. Modules and tensors
have their own watch (Note [What a trace reads besides its inputs]). ``aot_module``'s forward is
not looked into: a module's attributes are read while tracing (README).
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import inspect
import numbers
import types
from collections.abc import Callable
from typing import Any

import torch

from aotkit.aot.signature import _plain_object

_VALUES = (bool, str, type(None), numbers.Number, enum.Enum, torch.dtype, torch.device)


class _Unset:
    """What a getter reads for a global not (yet) defined or a cell not (yet) assigned."""

    def __repr__(self) -> str:
        return "unset"


_UNSET = _Unset()


def _plain_value(value: Any) -> bool:
    if isinstance(value, tuple):
        return len(value) <= 16 and all(map(_plain_value, value))
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ == "bool"
    return isinstance(value, _VALUES) or numpy_bool  # np.bool_ is no numbers.Number


def _keyed(value: Any) -> Any:
    if isinstance(value, tuple) and _plain_value(value):
        return repr(value)  # (0.0,) == (-0.0,) and (2.0,) == (2,): their reprs differ
    if value is _UNSET or _plain_value(value):
        return value
    return _Object(type(value))  # not keyed further


@dataclasses.dataclass(frozen=True)
class _Object:
    """The key of a value that is not plain: its type alone (a string could equal any text)."""

    kind: type

    def __repr__(self) -> str:
        return f"an object of type {self.kind.__name__}"


def _global_loads(code: types.CodeType) -> set[str]:
    """The globals ``code`` (and the code nested in it: comprehensions, lambdas, functions)
    reads but does not assign (a counter it increments: its own doing at every call, which a
    trace runs once per pass). Attribute names (``x.t()``) are not globals, though
    ``co_names`` holds them too."""
    loads: set[str] = set()
    stores: set[str] = set()
    for inner in _nested(code):
        for instruction in dis.get_instructions(inner):
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                loads.add(instruction.argval)
            elif instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                stores.add(instruction.argval)
    return loads - stores


def _nested(code: types.CodeType) -> list[types.CodeType]:
    found = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += _nested(const)
    return found


def captured_values(fn: Callable[..., Any]) -> tuple[list[str], list[Callable[[], Any]]]:
    """The names (for recompile reasons) and getters of the values ``fn`` reads besides its
    arguments (Note [Values a function captures]); empty lists for most functions."""
    names: list[str] = []
    getters: list[Callable[[], Any]] = []
    owner = getattr(fn, "__self__", None) if inspect.ismethod(fn) else None
    if owner is not None and _plain_object(owner):
        names.append("self")
        getters.append(lambda: owner)
    levels = _levels(getattr(fn, "__func__", fn))
    for level in levels:
        _captured_by(level, levels[-1].__globals__, names, getters)
    return names, getters


def _levels(fn: Any) -> list[types.FunctionType]:
    """``fn`` and the functions behind its decorators (``__wrapped__``): each one's code runs."""
    found = []
    while isinstance(fn, types.FunctionType) and fn not in found:
        found.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return found


def _captured_by(fn: types.FunctionType, home: dict[str, Any], names: list[str],
                 getters: list[Callable[[], Any]]) -> None:
    """Add what one level of the function reads besides its arguments to ``names``/``getters``;
    ``home``: the innermost level's globals (the decorated function's own module)."""
    code = fn.__code__
    space, builtins = fn.__globals__, fn.__builtins__
    for name in sorted(_global_loads(code)):
        # A decorator's module is not the function's: its globals are named by module.
        shown = f"the global {name}" if space is home else \
            f"the global {space.get('__name__', '?')}.{name}"
        if shown in names:
            continue
        # Plain now, or not defined yet (assigned after compiling); not a builtin's name.
        if _plain_value(space[name]) if name in space else name not in builtins:
            names.append(shown)
            getters.append(lambda name=name: _keyed(space.get(name, _UNSET)))
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        if (value := _contents(cell)) is _UNSET or _plain_value(value):  # or not assigned yet
            names.append(f"the closed-over {name}")
            getters.append(lambda cell=cell: _keyed(_contents(cell)))
    positional = code.co_varnames[:code.co_argcount]
    defaults = dict(zip(positional[len(positional) - len(fn.__defaults__ or ()):],
                        range(len(fn.__defaults__ or ())), strict=True))
    for name in (*defaults, *(fn.__kwdefaults__ or {})):
        if _plain_value(_default(fn, name, defaults)):
            names.append(f"the default value of {name}")
            getters.append(lambda name=name: _keyed(_default(fn, name, defaults)))


def _default(fn: types.FunctionType, name: str, positions: dict[str, int]) -> Any:
    """The default value of parameter ``name`` now (``__defaults__`` may be replaced)."""
    if name in positions:
        values = fn.__defaults__ or ()
        return values[positions[name]] if positions[name] < len(values) else _UNSET
    return (fn.__kwdefaults__ or {}).get(name, _UNSET)


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not assigned yet, or deleted
        return _UNSET


def held_modules(fn: Callable[..., Any]) -> list[torch.nn.Module]:
    """The modules ``fn``'s code loads from its globals or closes over, as they are now (a
    ModuleList it loops over: Note [What a trace reads besides its inputs])."""
    values = []
    for level in _levels(getattr(fn, "__func__", fn)):
        values += [level.__globals__.get(name) for name in _global_loads(level.__code__)]
        values += [_contents(cell) for cell in level.__closure__ or ()]
    return [v for v in values if isinstance(v, torch.nn.Module)]
