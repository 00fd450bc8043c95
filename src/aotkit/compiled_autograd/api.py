"""``enable`` / ``disable`` / ``reset``: install our capture object in the C++ autograd engine."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from aotkit import compat, config, counters
from aotkit.aot.boxing import refused_call
from aotkit.compiled_autograd import capture, runtime, session
from aotkit.compilers.bind import bind_aten_calls
from aotkit.errors import ArgumentError, UnsupportedError
from aotkit.locks import new_lock

log = session.log
# The engine logs why its cache missed to a Logger it is given; we keep those under ours.
_engine_log = logging.getLogger("aotkit.compiled_autograd.engine")
_last_session: session.Session | None = None
_ENTER_LOCK = new_lock()


def nop(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """The compiler that runs a captured backward as Python: the graph lowered to ATen (Note
    [Lowering captured backwards]) with its ATen calls bound to PyTorch's Python bindings (Note
    [Binding ATen calls]), ~1 us less per call than ``lambda gm: gm``.

        >>> import torch, aotkit
        >>> w = torch.ones(3, requires_grad=True)
        >>> with aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):
        ...     (w * 2).sum().backward()
        >>> w.grad
        tensor([2., 2., 2.])
    """
    bound = bind_aten_calls(gm)
    compat.hide_from_dynamo(bound)  # Note [aotkit's code is not user code to Dynamo]
    return bound


@contextlib.contextmanager
def enable(compiler_fn: Callable[..., Any], dynamic: bool = True) -> Iterator[None]:
    """Capture every ``backward()`` in the block as one FX graph, compiled by ``compiler_fn``.

    ``compiler_fn`` takes the captured ``torch.fx.GraphModule`` and returns a callable with the
    same signature. The engine replays the compiled graph while the autograd graph keeps its
    structure; ``dynamic=False`` captures again on the first change of a size, then treats it as
    dynamic. PyTorch's engine holds one compiler per process: while the block is active,
    backwards run by other threads are captured too, and a block in another thread is refused
    (Note [Backwards in other threads]).

        >>> import torch, aotkit
        >>> w = torch.ones(3, requires_grad=True)
        >>> with aotkit.compiled_autograd.enable(lambda gm: gm):
        ...     (w * 2).sum().backward()
        >>> w.grad
        tensor([2., 2., 2.])
    """
    dynamic = config.plain_bool(dynamic)
    _check_arguments(compiler_fn, dynamic)
    with _ENTER_LOCK:  # two threads must not both find no active block
        if (outer := session.active()) is not None:
            raise _overlapping(outer)
        new = session.Session(compiler_fn, dynamic)
        compat.hide_from_dynamo()  # the engine may capture under Dynamo's frame callback
        factory = functools.partial(capture.Capture, new)
        prior = compat.set_autograd_compiler(factory, dynamic)
        if prior[0] is not None:
            compat.set_autograd_compiler(*prior)
            raise UnsupportedError(
                "another compiled autograd (torch._dynamo.compiled_autograd) is active; "
                "aotkit.compiled_autograd.enable() cannot run inside it. Leave that context first."
            )
        if compat.engine_cache_is_empty():  # torch._dynamo.reset() since the last block
            session.graphs_cached = 0
        _forget_other_compilers(new)
        compat.set_autograd_verbose_logger(_engine_log)
        if compat.compiled_autograd_is_off():
            counters.record_once("fallback", "compiled_autograd",
                                 "enable() inside disable(): backwards run eagerly until the "
                                 "disable() block ends (disable() wins)",
                                 once="enable inside disable", logger=log)
        session.set_active(new)
        engine = compat.execution_engine()
        compat.set_execution_engine(runtime.Engine(
            engine, functools.partial(_reinstall_if_cleared, factory, dynamic),
            _engine_log))
        runtime.note_removed_hooks(True)
    try:
        # Multithreaded device queues would call the capture object from several threads.
        with torch.autograd.set_multithreading_enabled(False), \
                compat.pytorch_compiled_autograd_kept_off():
            yield
    finally:
        runtime.note_removed_hooks(False)
        compat.set_execution_engine(engine)
        session.set_active(None)
        compat.set_autograd_verbose_logger(None)
        compat.set_autograd_compiler(*prior)


def _check_arguments(compiler_fn: Any, dynamic: Any) -> None:
    """Refuse at enable() what would fail, or mean something else, at the first backward."""
    if not isinstance(dynamic, bool):
        raise ArgumentError(f"compiled_autograd.enable(dynamic=...) takes True or False, got "
                            f"{dynamic!r}.\nFix: pass a bool.")
    if not callable(compiler_fn):
        raise ArgumentError(
            f"compiled_autograd.enable() takes a compiler function, got {compiler_fn!r}.\nFix: "
            "pass aotkit.compiled_autograd.nop, lambda gm: gm, or "
            "lambda gm: torch.compile(gm, backend=...).")
    refused = refused_call(compiler_fn, 1)
    if refused is not None:
        raise ArgumentError(
            f"compiled_autograd.enable() calls its compiler as compiler(gm), but "
            f"{refused.partition('(')[0]!r} takes {refused}.\nFix: pass "
            "aotkit.compiled_autograd.nop (aotkit.compilers.nop is AOT autograd's compiler, "
            "called as compiler(gm, example_inputs)), or wrap it: lambda gm: ...")


# Note [Compiler cleared inside enable()]
# ``torch._dynamo.reset()`` / ``torch.compiler.reset()`` (before compiling another model, in a
# test) empties the engine's compiler slot, and the rest of the enable() block ran eagerly
# without a word. Every backward in the block first looks at the slot (enable() stands in for the
# engine, Note [Final callbacks]); found empty outside a disable() window, it is set again and a
# decision says so. Another compiler in the slot is left alone, and so is the slot emptied by
# PyTorch's own off window (``torch._dynamo.compiled_autograd._disable()``), which
# ``torch.func.grad``/``vjp``/``jacrev`` open around their ``autograd.grad(create_graph=True)``:
# setting it again captured that backward and failed it as a double backward. A reset while the
# slot was set aside (an off window: a compiler, a hook's replay, disable()) leaves the slot as
# it was; the engine's emptied cache says so.
def _reinstall_if_cleared(factory: Callable[..., Any], dynamic: bool) -> None:
    compat.keep_pytorch_compiled_autograd_off_at_compiles()  # a reset dropped it
    if compat.compiled_autograd_is_off():
        return
    prior = compat.set_autograd_compiler(factory, dynamic)
    if prior[0] is factory:
        if session.graphs_cached and compat.engine_cache_is_empty():  # not by us: we count 0
            session.graphs_cached = 0
            counters.record("cache_clear", "compiled_autograd",
                            "the engine's cached graphs were dropped inside enable() while its "
                            "compiler slot was set aside (torch._dynamo.reset() or "
                            "torch.compiler.reset() in a compiler, a hook or a disable() block); "
                            "backward graphs are captured anew", logger=log)
        return
    if prior[0] is not None or compat.pytorch_disable_is_open():
        compat.set_autograd_compiler(*prior)
        if prior[0] is None:
            counters.record_once("fallback", "compiled_autograd",
                                 "a backward inside torch._dynamo.compiled_autograd._disable() "
                                 "(torch.func's transforms open one around their autograd.grad) "
                                 "runs eagerly", once="PyTorch's disable", logger=log)
        return
    compat.set_autograd_verbose_logger(_engine_log)  # emptied too
    session.graphs_cached = 0
    counters.record("cache_clear", "compiled_autograd",
                    "the engine's compiler slot was emptied inside enable() (torch._dynamo.reset() "
                    "or torch.compiler.reset() does that); it is set again and backward graphs "
                    "are captured anew", logger=log)


# Note [Backwards in other threads]
# The engine's compiler slot is process-wide: once enable() sets it, every thread's backward
# goes through a capture object until the block ends. Those backwards are captured and compiled
# like the block's own (their gradients are eager's), with a "thread" decision saying so. The
# engine runs one compiled backward at a time: one that starts while another thread's is running
# fails in the engine (NotImplementedError, "compiled autograd within another compiled autograd
# call"), before any of our code runs. Autograd lists eager's node order only for a
# backward running with multithreading disabled, which enable() can set for its own thread only,
# so other threads' graphs keep the capture's order (a "hook_order" decision). A second block in
# another thread would swap the compiler under the first one's backwards: it is refused.
def _overlapping(outer: session.Session) -> UnsupportedError:
    if not outer.thread.is_alive():
        return UnsupportedError(
            f"aotkit.compiled_autograd.enable() was entered in thread {outer.thread.name}, which "
            "ended without leaving it (its __enter__ without __exit__), so it is still active "
            "and captures every backward.\nFix: enter enable() with a with-statement; to end "
            "the one left open, call __exit__(None, None, None) on the object entered.")
    if outer.thread is not threading.current_thread():
        return UnsupportedError(
            f"aotkit.compiled_autograd.enable() is active in another thread ({outer.thread.name})"
            "; PyTorch's autograd engine holds one compiled-autograd compiler per process, so "
            "enable() blocks cannot overlap across threads (that thread's backwards would run "
            "this block's compiler). Fix: run compiled-autograd backwards from one thread, or "
            "serialize the enable() blocks with a lock."
        )
    return UnsupportedError(
        "aotkit.compiled_autograd.enable() is already active; nested enable blocks are not "
        "supported. Exit the outer block first, or switch compilers between blocks."
    )


def _forget_other_compilers(new: session.Session) -> None:
    """Clear the engine's cache when the compiler changes (Note [Stale compiled backward]), or
    ``dynamic`` does: the engine would replay graphs captured with sizes as symbols under
    ``dynamic=False``, whose point is capturing again for new sizes; or an aotkit.config option
    that changes what is captured (``compiled_autograd_lower``)."""
    global _last_session
    last = _last_session
    if last is not None and not session.same_compiler(last.identity, new.identity):
        change = f"compiler changed from {last.compiler_fn!r} to {new.compiler_fn!r}"
    elif last is not None and last.dynamic != new.dynamic:
        change = f"dynamic changed from {last.dynamic} to {new.dynamic}"
    elif last is not None and last.options != new.options:
        change = f"aotkit.config changed from {dict(last.options)} to {dict(new.options)}"
    else:
        change = None
    if change is not None:
        _clear_engine_cache()
        counters.record("cache_clear", "compiled_autograd",
                        f"{change}; the engine's cached graphs are dropped and backward graphs "
                        "are captured again", logger=log)
    _last_session = new


def _clear_engine_cache() -> None:
    compat.clear_autograd_cache()
    session.graphs_cached = 0


@contextlib.contextmanager
def disable() -> Iterator[None]:
    """Run backward eagerly inside the block, even within ``enable``.

        >>> import torch, aotkit
        >>> w = torch.ones(2, requires_grad=True)
        >>> with aotkit.compiled_autograd.disable():
        ...     w.sum().backward()
    """
    with compat.compiled_autograd_off():
        yield


def reset() -> None:
    """Return to a fresh process's state: no compiler, an empty engine cache, ids from 0.

        >>> import aotkit
        >>> aotkit.compiled_autograd.reset()
    """
    global _last_session
    if session.active() is not None:
        raise UnsupportedError(
            "aotkit.compiled_autograd.reset() was called inside enable(); call it outside."
        )
    compat.set_autograd_compiler(None, False)
    compat.set_autograd_verbose_logger(None)
    _clear_engine_cache()
    _last_session = None
    capture.reset_ids()
