"""The state of one ``enable`` block and the compiled backward the engine replays."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from aotkit import compat, counters
from aotkit.errors import CompilerError, UnsupportedError

log = logging.getLogger("aotkit.compiled_autograd")

CREATE_GRAPH_MESSAGE = (
    "aotkit.compiled_autograd does not support create_graph=True (double backward): the captured "
    "graph calls backward formulas opaquely and would return gradients without a graph. "
    "Workaround: run this backward under aotkit.compiled_autograd.disable(), or compute "
    "higher-order gradients with torch.autograd.grad outside the enable() block."
)


@dataclass
class Session:
    """One ``enable(compiler_fn)`` block: the compiler and how many graphs it captured."""

    compiler_fn: Callable[..., Any]
    dynamic: bool
    captures: int = 0


_active: Session | None = None
#: Graphs captured since the engine's cache was last cleared (0: the next capture is the first).
graphs_cached = 0


def active() -> Session | None:
    """The session of the innermost ``enable`` block, or ``None`` outside one."""
    return _active


def set_active(session: Session | None) -> None:
    global _active
    _active = session


def compile_graph(gm: fx.GraphModule, compiler_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Compile a captured backward once; counted under ``compiled_autograd.compiles``."""
    counters.bump("compiled_autograd", "compiles")
    try:
        compiled = compiler_fn(gm)
    except Exception as exc:
        raise CompilerError(
            f"compiled autograd: compiler {compiler_fn!r} failed on graph {gm.__class__.__name__}: "
            f"{exc}. Try aotkit.compiled_autograd.enable(lambda gm: gm) to check the capture."
        ) from exc
    if not callable(compiled):
        raise CompilerError(
            f"compiled autograd: compiler {compiler_fn!r} returned {type(compiled).__name__}, "
            "not a callable; a compiler takes a GraphModule and returns a callable."
        )
    return compiled


class CompiledBackward:
    """What the engine caches per autograd-graph structure and calls on each replay.

    Note [Stale compiled backward]: the engine keeps calling a cached entry until its cache is
    cleared, whichever compiler is active. So the entry remembers which compiler built its
    callable and compiles the captured graph again when another compiler is active; a graph
    built by a previous compiler is never run.
    """

    def __init__(self, gm: fx.GraphModule, compiler_fn: Callable[..., Any], compiled: Any,
                 to_cuda: list[int]) -> None:
        self.gm = gm
        self.to_cuda = to_cuda
        self._compiler_fn = compiler_fn
        self._compiled = compiled

    def compiled_for(self, session: Session | None) -> Callable[..., Any]:
        """The callable compiled by the active compiler, compiling it on a switch."""
        if session is None:
            raise UnsupportedError(
                "the autograd engine replayed an aotkit compiled backward outside "
                "aotkit.compiled_autograd.enable(); call aotkit.compiled_autograd.reset() after "
                "switching between compiled-autograd implementations."
            )
        if session.compiler_fn is not self._compiler_fn:
            counters.record("recompile", "compiled_autograd",
                            f"compiler changed to {session.compiler_fn!r}; compiling the captured "
                            "graph again", logger=log)
            self._compiled = compile_graph(self.gm, session.compiler_fn)
            self._compiler_fn = session.compiler_fn
        return self._compiled

    def __call__(self, _engine_fn: Any, inputs: list[Any], sizes: Any, scalars: Any,
                 hooks: Any, packed_data: Any) -> Any:
        if torch.is_grad_enabled():
            raise UnsupportedError(CREATE_GRAPH_MESSAGE)
        fn = self.compiled_for(active())
        for i in self.to_cuda:
            inputs[i] = inputs[i].to("cuda", non_blocking=True)
        # A hook inside the graph may run its own backward: that one runs eagerly.
        prior = compat.set_autograd_compiler(None, False)
        try:
            return fn(inputs, list(sizes), list(scalars), hooks, packed_data)
        finally:
            compat.set_autograd_compiler(*prior)
