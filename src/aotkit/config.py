"""aotkit's options: defined once, typed, with help, an ``AOTKIT_*`` environment override each.

Read an option as an attribute, change it for a block with :func:`patch`::

    >>> import aotkit
    >>> aotkit.config.recompile_limit
    8
    >>> with aotkit.config.patch(recompile_limit=2):
    ...     aotkit.config.recompile_limit
    2

Options flagged ``in_cache_key`` change generated code; :func:`cache_key` returns their values so
a persistent cache can key on them.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aotkit.errors import ConfigError


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any
    help: str
    in_cache_key: bool = False

    @property
    def env_var(self) -> str:
        return f"AOTKIT_{self.name.upper()}"


_OPTIONS: dict[str, Option] = {}


def _define(name: str, type_: type, default: Any, help: str, *, in_cache_key: bool = False) -> None:
    _OPTIONS[name] = Option(name, type_, default, help, in_cache_key)


_define("recompile_limit", int, 8,
        "Most input signatures one aot_function/aot_module keeps before raising "
        "RecompileLimitError; use dynamic=True when shapes vary.")
_define("debug_graphs", bool, False,
        "Run graph.lint() after every pass and log every graph at DEBUG level.")
_define("log_graphs", bool, False,
        "Log the forward, backward and inference graphs at INFO level under aotkit.aot.")
_define("max_decisions", int, 1000,
        "How many decisions (recompiles, fallbacks) aotkit.explain() keeps; older ones are dropped.")
_define("keep_rng_ops_in_forward", bool, True,
        "Keep random ops uncomposed and never recomputed so results match eager for a seed.",
        in_cache_key=True)


def _parse(option: Option, text: str) -> Any:
    if option.type is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{option.env_var}={text!r} is not a boolean; use 1/0, true/false.")
    try:
        return option.type(text)
    except ValueError as exc:
        raise ConfigError(
            f"{option.env_var}={text!r} is not a valid {option.type.__name__}."
        ) from exc


def _check(option: Option, value: Any) -> Any:
    if option.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, option.type) or (option.type is int and isinstance(value, bool)):
        raise ConfigError(
            f"aotkit.config.{option.name} must be {option.type.__name__}, got {value!r}."
        )
    return value


class _Config:
    """Module replacement: attribute access reads and writes the option values."""

    def __init__(self) -> None:
        values = {}
        for option in _OPTIONS.values():
            text = os.environ.get(option.env_var)
            values[option.name] = option.default if text is None else _parse(option, text)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(_unknown(name)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _OPTIONS:
            raise ConfigError(_unknown(name))
        self._values[name] = _check(_OPTIONS[name], value)

    def __dir__(self) -> list[str]:
        return [*_OPTIONS, "patch", "options", "cache_key", "Option"]

    @contextlib.contextmanager
    def patch(self, **changes: Any) -> Iterator[None]:
        """Set options for the duration of a ``with`` block, restoring them afterwards."""
        saved = dict(self._values)
        try:
            for name, value in changes.items():
                setattr(self, name, value)
            yield
        finally:
            self._values.clear()
            self._values.update(saved)

    def options(self) -> dict[str, Option]:
        """Every option with its type, default, help and environment variable."""
        return dict(_OPTIONS)

    def cache_key(self) -> tuple[tuple[str, Any], ...]:
        """The values of the options that change generated code, for cache keys."""
        return tuple((n, self._values[n]) for n, o in _OPTIONS.items() if o.in_cache_key)

    Option = Option


def _unknown(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(_OPTIONS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"aotkit.config has no option {name!r}.{hint} Options: {', '.join(sorted(_OPTIONS))}."


sys.modules[__name__] = _Config()  # type: ignore[assignment]
