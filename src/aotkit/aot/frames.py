"""Which line of the user's code aotkit is tracing, for error messages, and which code a Dynamo
graph came from, for decisions."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import traceback
from collections.abc import Iterable
from types import FrameType

import torch

AOTKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# A context manager's exit (torch.random.fork_rng restoring the state) runs in contextlib: the
# user's line is the ``with`` statement's.
_CONTEXTLIB = os.path.abspath(contextlib.__file__)
# Library code whose line is worth showing beside the user's (the check that read data): torch.nn,
# torch.ao (quantization modules and observers) and torch.functional, but not nn.Module's call
# wrapper, which every module call passes through.
_LIBRARY = tuple(TORCH_DIR + p for p in ("nn" + os.sep, "ao" + os.sep, "distributions" + os.sep,
                                           "functional.py"))
_MODULE_CALL = TORCH_DIR + os.path.join("nn", "modules", "module.py")


def user_frame(exc: BaseException) -> str:
    """Where in the user's code ``exc`` was raised (and the torch.nn line it passed through)."""
    where = _describe_frames(traceback.extract_tb(exc.__traceback__))
    if where != _UNKNOWN:
        return where
    return _graph_line(reversed(list(traceback.walk_tb(exc.__traceback__))))


def current_user_line() -> str:
    """The user's line being traced now: the innermost one below aotkit's outermost frame (frames
    above it are the caller's call of the compiled function)."""
    frames = traceback.extract_stack()
    ours = [i for i, f in enumerate(frames) if os.path.abspath(f.filename).startswith(AOTKIT_DIR)]
    where = _describe_frames(frames[ours[0]:] if ours else frames)
    return where if where != _UNKNOWN else _graph_line(traceback.walk_stack(sys._getframe()))


def _describe_frames(frames: list[traceback.FrameSummary]) -> str:
    frames = [f for f in frames if not os.path.abspath(f.filename).startswith(AOTKIT_DIR)]
    user = [f for f in frames if not os.path.abspath(f.filename).startswith(TORCH_DIR)
            and os.path.abspath(f.filename) != _CONTEXTLIB]
    # The data dependence may sit in a library check (torch.nn.functional): show that line too.
    library = [f for f in frames if os.path.abspath(f.filename).startswith(_LIBRARY)
               and os.path.abspath(f.filename) != _MODULE_CALL]
    shown = []
    if library and (not user or frames.index(library[-1]) > frames.index(user[-1])):
        shown.append(library[-1])
    shown += user[-1:]
    if not shown:
        return _UNKNOWN
    return "\n  called from ".join(f"{f.filename}:{f.lineno} in {f.name}: {f.line}" for f in shown)


_UNKNOWN = "<unknown location>"
_STACK_ENTRY = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n\s*(?P<code>.*)')


def _graph_line(frames: Iterable[tuple[FrameType, int]]) -> str:
    """Under torch.compile the user's code runs as a Dynamo graph, node by node through an FX
    interpreter (innermost frames first): the user's line its running node was recorded from."""
    for frame, _ in frames:
        node = frame.f_locals.get("n") if frame.f_code.co_name == "run_node" else None
        if isinstance(node, torch.fx.Node) and isinstance(frame.f_locals.get("self"),
                                                          torch.fx.Interpreter):
            entries = list(_STACK_ENTRY.finditer(node.meta.get("stack_trace") or ""))
            if entries:
                last = entries[-1]
                return f"{last['file']}:{last['line']} in {last['fn']}: {last['code'].strip()}"
    return _UNKNOWN


def region(mod: torch.nn.Module) -> str:
    """Which code a Dynamo graph came from, for logs and ``explain()``: ``fn in file.py
    [0/1]`` (function, file, Dynamo's frame/compile id); the module's class name otherwise."""
    stack = getattr(getattr(mod, "compile_subgraph_reason", None), "user_stack", None)
    if not stack:
        return type(mod).__name__
    from torch._guards import CompileContext

    frame = stack[-1]
    compile_id = CompileContext.current_compile_id()
    where = _module_forward(mod) if _is_dynamo_wrapper(frame.filename) else None
    where = where or f"{frame.name} in {os.path.basename(frame.filename)}"
    return where if compile_id is None else f"{where} [{compile_id}]"


def _is_dynamo_wrapper(filename: str) -> bool:
    """Dynamo compiles a built-in module (``nn.Sequential``, ``nn.Linear``) through a wrapper
    function of its own, which is the only frame it records for the graph."""
    return os.path.dirname(filename) == os.path.dirname(torch._dynamo.__file__)


def _module_forward(mod: torch.nn.Module) -> str | None:
    """``Sequential.forward in container.py``: the outermost module Dynamo's graph came from."""
    for node in getattr(mod, "graph", torch.fx.Graph()).nodes:
        stack = node.meta.get("nn_module_stack")
        cls = next(iter(stack.values()))[1] if stack else None
        if isinstance(cls, type):
            try:
                where = os.path.basename(inspect.getsourcefile(cls) or cls.__module__)
            except (OSError, TypeError):  # defined in a REPL, a notebook or ``python -c``
                where = cls.__module__
            return f"{cls.__name__}.forward in {where}"
    return None
