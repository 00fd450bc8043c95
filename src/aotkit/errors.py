"""Errors aotkit raises to users: what failed, where, and how to fix it.

Every error derives from :class:`AotkitError`; a few also derive from the built-in exception a
PyTorch user would already catch (``TypeError``, ``RuntimeError``).

    >>> import aotkit
    >>> issubclass(aotkit.errors.ArgumentError, TypeError)
    True
"""

from __future__ import annotations


class AotkitError(Exception):
    """Base class of every error aotkit raises on purpose."""


class ConfigError(AotkitError, ValueError):
    """An unknown option or a value of the wrong type in ``aotkit.config``."""


class ArgumentError(AotkitError, TypeError):
    """A compiled function was called with arguments it cannot take."""


class OutputTypeError(AotkitError, TypeError):
    """The traced function returned something that is not a tensor, a scalar or a pytree of them."""


class TraceError(AotkitError, RuntimeError):
    """Tracing the function to an FX graph failed (e.g. data-dependent Python control flow)."""


class UnsupportedError(AotkitError, RuntimeError):
    """The program does something aotkit does not support yet; the message names a workaround."""


class RecompileLimitError(AotkitError, RuntimeError):
    """A compiled function saw more input signatures than ``aotkit.config.recompile_limit``."""


class CompilerError(AotkitError, RuntimeError):
    """A graph compiler failed or returned something that is not callable."""


class MetadataMismatchError(CompilerError):
    """A graph node produced a value whose dtype, shape, strides or device differ from the fake
    value traced for it (raised by ``aotkit.compilers.debug_nop``)."""


class HookResultError(AotkitError, RuntimeError):
    """A backward hook, or a custom ``autograd.Function``'s backward, returned a gradient of
    another size or type, or the wrong number of them (raised under compiled autograd where
    eager raises a RuntimeError)."""


class HookResultTypeError(AotkitError, TypeError):
    """A backward hook returned something its kind of hook may not return (raised under compiled
    autograd where eager raises a TypeError)."""
