"""Python values a function compiled with ``aot_function`` reads without taking them as
arguments, keyed with its arguments.

Note [Values a function captures]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Tracing reads a number where the function's code reads it, and the graph holds it as a
constant: ``x - LR * g`` with ``LR`` a global, ``x * scale`` with ``scale`` closed over, ``x /
self.temperature`` for a bound method ``aot_function(sampler.logits)``. Changed after compiling,
the old graph silently went on with the old value (PyTorch's ``aot_function`` too; Dynamo
guards on them). So the values the function's own code can read are keyed as extra arguments:

* the globals its code names (its nested code too: comprehensions, lambdas) and the variables
  it closes over, when they hold a plain value (a number, string, bool, None, enum, dtype or
  device; a tuple of such) when it is compiled, read again at every call;
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

import enum
import inspect
import numbers
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from aotkit.aot.signature import _plain_object

_VALUES = (bool, str, type(None), numbers.Number, enum.Enum, torch.dtype, torch.device)
_MISSING = object()


def _plain_value(value: Any) -> bool:
    if isinstance(value, tuple):
        return len(value) <= 16 and all(map(_plain_value, value))
    return isinstance(value, _VALUES)


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def captured_values(fn: Callable[..., Any]) -> tuple[list[str], list[Callable[[], Any]]]:
    """The names (for recompile reasons) and getters of the values ``fn`` reads besides its
    arguments (Note [Values a function captures]); empty lists for most functions."""
    names: list[str] = []
    getters: list[Callable[[], Any]] = []
    owner = getattr(fn, "__self__", None) if inspect.ismethod(fn) else None
    if owner is not None and _plain_object(owner):
        names.append("self")
        getters.append(lambda: owner)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return names, getters  # a callable object, a builtin, functools.partial
    space = fn.__globals__
    for name in dict.fromkeys(_code_names(code)):
        if name in space and _plain_value(space[name]):
            names.append(f"the global {name}")
            getters.append(lambda name=name: space.get(name, _MISSING))
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        try:
            plain = _plain_value(cell.cell_contents)
        except ValueError:  # not yet assigned
            continue
        if plain:
            names.append(f"the closed-over {name}")
            getters.append(lambda cell=cell: _contents(cell))
    positional = code.co_varnames[:code.co_argcount]
    defaults = dict(zip(positional[len(positional) - len(fn.__defaults__ or ()):],
                        range(len(fn.__defaults__ or ())), strict=True))
    for name in (*defaults, *(fn.__kwdefaults__ or {})):
        if _plain_value(_default(fn, name, defaults)):
            names.append(f"the default value of {name}")
            getters.append(lambda name=name: _default(fn, name, defaults))
    return names, getters


def _default(fn: types.FunctionType, name: str, positions: dict[str, int]) -> Any:
    """The default value of parameter ``name`` now (``__defaults__`` may be replaced)."""
    if name in positions:
        values = fn.__defaults__ or ()
        return values[positions[name]] if positions[name] < len(values) else _MISSING
    return (fn.__kwdefaults__ or {}).get(name, _MISSING)


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # deleted
        return _MISSING
