"""aotkit's options: defined once, typed, with help, an ``AOTKIT_*`` environment override each.

Read an option as an attribute, change it for a block with :func:`patch`::

    >>> import aotkit
    >>> aotkit.config.recompile_limit
    8
    >>> with aotkit.config.patch(recompile_limit=2):
    ...     aotkit.config.recompile_limit
    2

Options with an ``in_cache_key`` part change what that part generates (``"aot"``: AOT graphs
and how they run; ``"min_cut"``: what the min-cut partitioner saves; ``"compiled_autograd"``:
compiled autograd's graphs); :func:`cache_key` returns their values, so compiled entries (and a
persistent cache) key on the parts that concern them.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import os
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any

from aotkit.errors import ConfigError
from aotkit.locks import new_lock


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any
    help: str
    in_cache_key: str | None = None  # the part whose generated code it changes
    bounds: tuple[float, float] | None = None  # inclusive, for numeric options

    @property
    def env_var(self) -> str:
        return f"AOTKIT_{self.name.upper()}"


_OPTIONS: dict[str, Option] = {}


def _define(name: str, type_: type, default: Any, help: str, *, in_cache_key: str | None = None,
            bounds: tuple[float, float] | None = None) -> None:
    _OPTIONS[name] = Option(name, type_, default, help, in_cache_key, bounds)


_define("recompile_limit", int, 8,
        "Most input signatures one aot_function/aot_module keeps before raising "
        "RecompileLimitError (at least 1: the first compile is not a recompile); use "
        "dynamic=True when shapes vary.", bounds=(1, math.inf))
_define("debug_graphs", bool, False,
        "Run graph.lint() on every traced graph (the joint, forward, backward and inference "
        "graphs are logged at DEBUG level whether it is on or not).")
_define("log_graphs", bool, False,
        "Log the forward, backward and inference graphs at INFO level under aotkit.aot (and "
        "compiled autograd's lowered graphs under aotkit.compiled_autograd, whose captured "
        "graphs are logged at INFO always).")
_define("bind_aten_calls", bool, True,
        "nop and the compilers that run a graph as Python call each ATen op through PyTorch's "
        "Python binding for it (torch.mm, Tensor.view) where that binding makes exactly the "
        "traced dispatcher call, instead of through torch.ops (about 1 us less per op); off, "
        "they run the torch.ops calls as traced. See Note [Binding ATen calls].",
        in_cache_key="aot")
_define("record_stack_traces", bool, False,
        "Record the Python stack of every traced op in node.meta['stack_trace'] (slows the "
        "first call by ~20%). Plain functions need torch >= 2.13 (older releases keep only "
        "module forward frames). Graphs from torch.compile keep Dynamo's stack traces regardless.")
_define("max_decisions", int, 1000,
        "How many decisions (recompiles, fallbacks) aotkit.explain() keeps; older ones are dropped.",
        bounds=(0, math.inf))
_define("debug_dir", str, "aotkit_debug",
        "Folder where aotkit.compilers.debug_compile writes each graph and its runnable "
        "repro.py (a relative path is relative to the current directory).")
_define("compiled_autograd_cudagraphs", bool, False,
        "CUDA graphs are requested for compiled-autograd backward graphs: CPU 0-dim tensor inputs "
        "that only feed ATen ops or built-in backward formulas move to the GPU, so the graph has "
        "no CPU inputs. Only applies when the graph already has CUDA inputs.",
        in_cache_key="compiled_autograd")
_define("compiled_autograd_lower", bool, True,
        "Compiled autograd lowers each captured backward to the ATen ops of its formulas (hooks "
        "and custom Function backwards stay calls) before compiling it, guarded by the sizes it "
        "was lowered for; off, the compiler gets the captured graph of opaque formula calls. See "
        "Note [Lowering captured backwards].",
        in_cache_key="compiled_autograd")
_define("activation_memory_budget", float, 1.0,
        "For min_cut_rematerialization_partition: the share (0..1) of saved-activation memory to "
        "keep between the least the partitioner can save (0: recompute everything but random "
        "ops) and its default cut (1: recompute only cheap pointwise and view ops).",
        in_cache_key="min_cut", bounds=(0.0, 1.0))


def _parse(option: Option, text: str) -> Any:
    if option.type is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{option.env_var}={text!r} is not a boolean.\nFix: set it to 1/0 "
                          "or true/false, or unset it.")
    try:
        return option.type(text)
    except ValueError:
        raise ConfigError(
            f"{option.env_var}={text!r} is not a valid {option.type.__name__}.\nFix: set it "
            f"to a value such as {option.default!r}, or unset it."
        ) from None


def is_numpy_bool(kind: type) -> bool:
    """Whether ``kind`` is NumPy's bool scalar type, which is neither bool nor a number."""
    return kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")


def plain_bool(value: Any) -> Any:
    """``value`` as a Python bool when it is NumPy's bool scalar, else ``value`` unchanged.

    >>> import numpy as np
    >>> plain_bool(np.bool_(True)) is True, plain_bool(1)
    (True, 1)
    """
    return bool(value) if is_numpy_bool(type(value)) else value


def _check(option: Option, value: Any) -> Any:
    # NumPy's scalars (np.float32(0.5), np.int64(8), np.bool_(True)) are numbers and bools too
    if option.type is bool:
        value = plain_bool(value)
    if option.type is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
    if option.type is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    if option.type is str and isinstance(value, os.PathLike):  # debug_dir=Path(...)
        value = os.fspath(value)
    if option.type is str and value == "":
        raise ConfigError(f"aotkit.config.{option.name} must not be empty.\nFix: name a folder, "
                          f"e.g. its default {option.default!r}.")
    if not isinstance(value, option.type) or (option.type is int and isinstance(value, bool)):
        raise ConfigError(
            f"aotkit.config.{option.name} must be {option.type.__name__}, got {value!r}.\n"
            f"Fix: use {'an' if option.type is int else 'a'} {option.type.__name__}, e.g. its "
            f"default {option.default!r}."
        )
    if option.bounds is not None and not option.bounds[0] <= value <= option.bounds[1]:
        low, high = option.bounds
        allowed = f"be at least {low}" if high == math.inf else f"lie in [{low}, {high}]"
        raise ConfigError(f"aotkit.config.{option.name} must {allowed}, got {value!r}.\n"
                          f"Fix: use a value that does, e.g. its default {option.default!r}.")
    return value


_values: dict[str, Any] = {}
# cache_key() per set of parts, computed once per set of values
_keys: dict[tuple[str, ...], tuple[tuple[str, Any], ...]] = {}


def _write(name: str, value: Any) -> None:
    _values[name] = value
    # A copy in the module's namespace, where unittest.mock.patch.object looks for the value
    # to put back (reads go through _ConfigModule's properties, never this copy).
    globals()[name] = value
    _environment_errors.pop(name, None)  # set from code: a bad variable no longer matters
    _keys.clear()


#: Bad AOTKIT_* variables by option, raised at the first use of aotkit.config rather than at
#: import, so that ``import aotkit`` and ``aotkit --help`` work and the error has a place to be
#: reported. Setting the option from code replaces the variable's value.
_environment_errors: dict[str, ConfigError] = {}

#: AOTKIT_* variables that are not options (read by a repro script aotkit writes).
_OTHER_VARIABLES = frozenset({"AOTKIT_REPRO_DEVICE"})

#: A warning for AOTKIT_* variables naming no option (a misspelled option would otherwise go
#: unnoticed; another program's variable of that prefix must not stop aotkit), given at the
#: first use of aotkit.config.
_unknown_variables: list[str] = []


def _load_environment() -> None:
    import difflib

    options = {o.env_var.removeprefix("AOTKIT_"): o.env_var for o in _OPTIONS.values()}
    for variable in sorted(v for v in os.environ if v.startswith("AOTKIT_")
                           and v not in _OTHER_VARIABLES and v.removeprefix("AOTKIT_") not in options):
        close = difflib.get_close_matches(variable.removeprefix("AOTKIT_"), list(options), n=1,
                                          cutoff=0.8)
        _unknown_variables.append(
            f"{variable} is set, but aotkit has no such option"
            f"{f'; did you mean {options[close[0]]}?' if close else ''} (it is ignored).")
    if _unknown_variables:
        _unknown_variables.append(f"Options: {', '.join(sorted(options.values()))}.")
    for option in _OPTIONS.values():
        text = os.environ.get(option.env_var)
        try:
            value = option.default if text is None else _from_environment(option, text)
        except ConfigError as exc:
            _write(option.name, option.default)
            _environment_errors[option.name] = exc
            continue
        _write(option.name, value)


def _outside_aotkit() -> int:
    """The stacklevel of the first caller outside aotkit, for a warning given in its name."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(2), 2  # the caller of the function that warns
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        frame, level = frame.f_back, level + 1
    return level


def check_environment() -> None:
    """Raise a ConfigError naming every bad ``AOTKIT_*`` environment variable, if any, and warn
    once about variables naming no option."""
    if _unknown_variables:
        import warnings

        told = "\n".join(_unknown_variables)
        _unknown_variables.clear()  # first: under -W error the warning raises, once
        warnings.warn(told, stacklevel=_outside_aotkit())
    if _environment_errors:
        raise ConfigError("\n".join(str(e) for e in _environment_errors.values()))


def _from_environment(option: Option, text: str) -> Any:
    try:
        return _check(option, _parse(option, text))
    except ConfigError as exc:
        if str(exc).startswith(option.env_var):
            raise
        raise ConfigError(f"{option.env_var}={text!r}: {exc}") from None


class patch(contextlib.ContextDecorator):  # a class so that one patch can be entered again
    """Set options for the duration of a ``with`` block (or a decorated function's call) and
    restore them afterwards. Only the options named here are restored: others assigned inside
    the block keep their values. One ``patch`` object may be entered again, and nested.

    Options are process-wide: a patch in one thread is seen by the others while it is active.
    Patches may end in any order (two threads' overlapping blocks): when the last one ends,
    every option has the value it had before the first began.

        >>> import aotkit
        >>> fewer = aotkit.config.patch(recompile_limit=2)
        >>> with fewer:
        ...     aotkit.config.recompile_limit
        2
        >>> with fewer:
        ...     aotkit.config.recompile_limit
        2
    """

    def __init__(self, **changes: Any) -> None:
        self.changes = changes
        self._active: list[tuple[int, dict[str, _Saved]]] = []  # (thread, what it replaced)

    def __call__(self, func: Any) -> Any:
        if inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func) \
                or inspect.isasyncgenfunction(func):
            raise ConfigError(
                f"aotkit.config.patch cannot decorate {getattr(func, '__qualname__', func)!r}: "
                "it is a generator "
                "or async function, whose body runs after the call returns, outside the patch."
                "\nFix: use `with aotkit.config.patch(...):` inside its body."
            )
        return super().__call__(func)

    def __enter__(self) -> None:
        for name in self.changes:
            if name not in _OPTIONS:
                raise ConfigError(_unknown(name))
        values = {name: _check(_OPTIONS[name], value) for name, value in self.changes.items()}
        with _PATCH_LOCK:
            replaced = {name: _Saved(_values[name], _environment_errors.get(name))
                        for name in values}
            for name in values:  # what it sets replaces a bad variable's value
                _environment_errors.pop(name, None)
            try:
                check_environment()
            except ConfigError:
                _environment_errors.update({n: r.error for n, r in replaced.items() if r.error})
                raise
            for name, value in values.items():
                _write(name, value)
                _patched.setdefault(name, []).append(replaced[name])
            self._active.append((threading.get_ident(), replaced))

    def __exit__(self, *exc: Any) -> None:
        if not self._active:
            raise ConfigError("aotkit.config.patch exited more times than it was entered.\n"
                              "Fix: use it as `with aotkit.config.patch(...):` or a decorator.")
        with _PATCH_LOCK:
            # This thread's latest entry; the latest of all where it entered in another thread.
            thread = threading.get_ident()
            k = max((i for i, (t, _) in enumerate(self._active) if t == thread),
                    default=len(self._active) - 1)
            for name, replaced in self._active.pop(k)[1].items():
                _end_patch(name, replaced)


@dataclass
class _Saved:
    """What a patch replaced: a value, and the bad environment variable behind it, if any."""

    value: Any
    error: ConfigError | None


#: Per option, what each active patch replaced, oldest first.
_patched: dict[str, list[_Saved]] = {}
_PATCH_LOCK = new_lock()


def _end_patch(name: str, replaced: _Saved) -> None:
    """Put back what a patch replaced; where a later patch of the option is still active, that
    one puts it back when it ends (it replaced this patch's value)."""
    stack = _patched[name]
    i = next(i for i, r in enumerate(stack) if r is replaced)
    del stack[i]
    if i < len(stack):
        stack[i].value, stack[i].error = replaced.value, replaced.error
        return
    _write(name, replaced.value)
    if replaced.error is not None:
        _environment_errors[name] = replaced.error


def options() -> dict[str, Option]:
    """Every option with its type, default, help and environment variable."""
    return dict(_OPTIONS)


def cache_key(*parts: str) -> tuple[tuple[str, Any], ...]:
    """The values of the options that change what ``parts`` generate (every part by default),
    for cache keys.

        >>> import aotkit
        >>> aotkit.config.cache_key("aot")
        (('bind_aten_calls', True),)
    """
    key = _keys.get(parts)
    if key is None:
        check_environment()  # called at every call of a compiled function: see aotkit.aot.signature
        key = _keys[parts] = tuple((n, _values[n]) for n, o in _OPTIONS.items()
                                   if o.in_cache_key and (not parts or o.in_cache_key in parts))
    return key


class _ConfigModule(types.ModuleType):
    """Option values read and written as module attributes (properties, added below for each
    option), type-checked on write."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(_unknown(name))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OPTIONS:
            _write(name, _check(_OPTIONS[name], value))
        elif name.startswith("_"):
            super().__setattr__(name, value)
        else:  # also the module's functions (config.patch = ...): not options
            raise ConfigError(_unknown(name))

    def __delattr__(self, name: str) -> None:
        if name in _OPTIONS:
            raise ConfigError(f"aotkit.config.{name} cannot be deleted.\nFix: assign it a "
                              "value, or use aotkit.config.patch(...) to change it for a while.")
        super().__delattr__(name)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_OPTIONS})


def _unknown(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(_OPTIONS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"aotkit.config has no option {name!r}.{hint} Options: {', '.join(sorted(_OPTIONS))}."


def _option_property(name: str) -> property:
    def read(_: types.ModuleType) -> Any:
        check_environment()
        return _values[name]

    def write(_: types.ModuleType, value: Any) -> None:
        _write(name, _check(_OPTIONS[name], value))

    return property(read, write, doc=_OPTIONS[name].help)


for _name in _OPTIONS:
    setattr(_ConfigModule, _name, _option_property(_name))
_load_environment()
sys.modules[__name__].__class__ = _ConfigModule
