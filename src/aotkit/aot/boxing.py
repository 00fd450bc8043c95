"""The boxed calling convention: a compiled callable takes one list it may clear to free inputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from aotkit.errors import AotkitError, ArgumentError, CompilerError

Compiler = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]


def make_boxed_func(f: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    """Wrap ``f(*args)`` as ``g(args)``, the boxed convention.

    Example::

        >>> from aotkit import make_boxed_func
        >>> g = make_boxed_func(lambda a, b: a + b)
        >>> g([1, 2]), g._boxed_call
        (3, True)
    """
    if getattr(f, "_boxed_call", False):
        return f

    def boxed(*call: Any) -> Any:
        if len(call) != 1 or not isinstance(call[0], (list, tuple)):
            raise ArgumentError(
                f"{getattr(f, '__name__', 'this compiled graph')} takes its inputs boxed, as one "
                f"list, but was called with {len(call)} argument(s).\nFix: aotkit compilers "
                "return boxed callables for AOT autograd; with torch.compile use "
                "backend='aotkit' / 'aotkit_debug' / 'aotkit_inductor', not the compiler itself."
            )
        return f(*call[0])

    boxed._boxed_call = True  # type: ignore[attr-defined]
    return boxed


def make_boxed_compiler(compiler: Compiler) -> Compiler:
    """Adapt a compiler returning an unboxed callable into one returning a boxed callable.

    Example::

        >>> import aotkit
        >>> boxed = aotkit.make_boxed_compiler(lambda gm, inputs: gm.forward)
    """

    def boxed_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(compiler(gm, example_inputs))

    boxed_compiler.__name__ = getattr(compiler, "__name__", "boxed_compiler")
    return boxed_compiler


def compile_boxed(compiler: Compiler, gm: fx.GraphModule, example_inputs: Sequence[Any], what: str) -> Callable[[list[Any]], Any]:
    """Run a compiler and return its result as a boxed callable, with a clear error on failure."""
    name = getattr(compiler, "__name__", type(compiler).__name__)
    try:
        compiled = compiler(gm, list(example_inputs))
    except AotkitError:
        raise  # the compiler's own error already says what to fix
    except Exception as exc:
        raise CompilerError(
            f"compiler {name!r} failed on the {what} graph: {type(exc).__name__}: {exc}\n"
            "Fix: try aotkit.compilers.nop to check the graph itself, or aotkit.compilers.debug_nop."
        ) from exc
    if not callable(compiled):
        raise CompilerError(
            f"compiler {name!r} returned {type(compiled).__name__} for the {what} graph; "
            "a compiler must return a callable (gm.forward, or make_boxed_func(...))."
        )
    return make_boxed_func(compiled)
