"""Which line of the user's code aotkit is tracing, for error messages."""

from __future__ import annotations

import contextlib
import os
import traceback

import torch

_AOTKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# A context manager's exit (torch.random.fork_rng restoring the state) runs in contextlib: the
# user's line is the ``with`` statement's.
_CONTEXTLIB = os.path.abspath(contextlib.__file__)


def user_frame(exc: BaseException) -> str:
    """Where in the user's code ``exc`` was raised (and the torch.nn line it passed through)."""
    return _describe_frames(traceback.extract_tb(exc.__traceback__))


def current_user_line() -> str:
    """The user's line being traced now: the innermost one below aotkit's outermost frame (frames
    above it are the caller's call of the compiled function)."""
    frames = traceback.extract_stack()
    ours = [i for i, f in enumerate(frames) if os.path.abspath(f.filename).startswith(_AOTKIT_DIR)]
    return _describe_frames(frames[ours[0]:] if ours else frames)


def _describe_frames(frames: list[traceback.FrameSummary]) -> str:
    frames = [f for f in frames if not os.path.abspath(f.filename).startswith(_AOTKIT_DIR)]
    user = [f for f in frames if not os.path.abspath(f.filename).startswith(TORCH_DIR)
            and os.path.abspath(f.filename) != _CONTEXTLIB]
    # The data dependence may sit in a library check (torch.nn.functional): show that line too.
    library = [f for f in frames if os.path.abspath(f.filename).startswith(
        (TORCH_DIR + "nn" + os.sep, TORCH_DIR + "functional.py"))]
    shown = []
    if library and (not user or frames.index(library[-1]) > frames.index(user[-1])):
        shown.append(library[-1])
    shown += user[-1:]
    if not shown:
        return "<unknown location>"
    return "\n  called from ".join(f"{f.filename}:{f.lineno} in {f.name}: {f.line}" for f in shown)
