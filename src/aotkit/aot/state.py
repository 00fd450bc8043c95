"""Global state around the calls of a traced function: grad mode, autocast, the default dtype
and the default generator. See Note [Global state the function leaves changed]."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from aotkit.aot.frames import TORCH_DIR, current_user_line
from aotkit.aot.signature import AUTOCAST_DEVICES, AutocastState, autocast_state
from aotkit.errors import UnsupportedError


# Note [Global state the function leaves changed]
# A function may switch grad mode, autocast or the default dtype and not switch it back
# (``torch.set_grad_enabled(False)`` at its end; Dynamo's graphs of such code call
# ``_set_grad_enabled``). Eager leaves the state switched; traced, the switch happened once per
# tracing pass, and it leaked into the next pass, which then traced other dtypes or grad modes.
# So every call of the function while tracing starts in the caller's state and puts it back
# afterwards; the state the first call left is recorded, and the runtime switches to it after
# each call, as eager's call leaves it (the state before is part of the signature, so it is the
# traced one). Reseeding the global generator (``torch.manual_seed`` inside) cannot be replayed
# that way: the graph draws its random numbers at run time from the caller's generator state,
# so it is refused (ReseedWatch, set up by aotkit.aot.trace.tracing). A graph from Dynamo is not
# refused: Dynamo decides what runs where (it gives ``torch.seed()`` a graph of its own), as
# with PyTorch's own AOT autograd.
@dataclass(frozen=True)
class GlobalState:
    """Grad mode, autocast and the default dtype. See Note [Global state the function leaves
    changed]."""

    grad: bool
    autocast: AutocastState
    default_dtype: torch.dtype

    @staticmethod
    def now() -> GlobalState:
        return GlobalState(torch.is_grad_enabled(), autocast_state(), torch.get_default_dtype())

    def restore(self) -> None:
        torch._C._set_grad_enabled(self.grad)
        for device, dtype in zip(AUTOCAST_DEVICES, self.autocast, strict=True):
            torch.set_autocast_enabled(device, bool(dtype))
            if dtype:
                torch.set_autocast_dtype(device, dtype)
        torch.set_default_dtype(self.default_dtype)


def default_rng_state() -> bytes:
    """The default CPU generator's state, read outside every tracing mode."""
    with _outside_modes():
        return torch.default_generator.get_state().numpy().tobytes()


def set_default_rng_state(state: bytes) -> None:
    with _outside_modes():
        torch.default_generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def _outside_modes() -> contextlib.ExitStack:
    from torch.utils._python_dispatch import _disable_current_modes

    stack = contextlib.ExitStack()
    stack.enter_context(_disable_current_modes())
    stack.enter_context(torch._C.DisableTorchFunction())
    return stack


def _seeded_state(seed: int, draws: int = 0) -> bytes:
    """A CPU generator's state right after ``manual_seed(seed)`` and ``draws`` draws."""
    with _outside_modes():
        generator = torch.Generator().manual_seed(seed)
        if draws:
            torch.empty(draws).uniform_(generator=generator)
        return generator.get_state().numpy().tobytes()


# Note [Catching a reseed]
# Tracing runs random ops on fake tensors, which never advance the default generator, so the
# function's ``torch.manual_seed(s)`` is the only thing that moves it during a trace (another
# thread drawing numbers moves it too, which must not count). A reseed with a new seed shows in
# ``torch.initial_seed()``. One with the seed already in use shows as the state going back to
# where ``manual_seed(s)`` puts it; when the generator is there already (no draw since the
# caller seeded), the watch first moves it one draw on, so that going back shows. The caller's
# state is put back when the trace ends. Setting a saved state back (``torch.set_rng_state``,
# which ``torch.random.fork_rng`` calls on exit) shows nothing at all: fake draws never moved
# the state. So while the watch lasts, ``torch.set_rng_state`` called by the traced thread
# raises (the graph's draws move the caller's generator at run time, which the restore was
# meant to undo); reading the state stays allowed (``torch.utils.checkpoint`` reads it).
class ReseedWatch:
    """Whether the default generator has been reseeded since this watch began. See Note
    [Catching a reseed]."""

    def __init__(self, what: str) -> None:
        self._unpatch = _refuse_state_restores(what)
        self.seed = torch.initial_seed()
        self.state = default_rng_state()
        self.fresh = _seeded_state(self.seed)
        self.watched = self.state
        if self.state == self.fresh:
            self.watched = _seeded_state(self.seed, draws=1)
            set_default_rng_state(self.watched)

    def reseeded(self) -> bool:
        if torch.initial_seed() != self.seed:
            return True
        now = default_rng_state()
        return now != self.watched and now == self.fresh

    def end(self) -> None:
        """Put the caller's generator state back where the watch moved it or a reseed did."""
        self._unpatch()
        if self.watched != self.state or self.reseeded():
            set_default_rng_state(self.state)


def _called_by_user(filename: str) -> bool:
    """A call from the user's code, or from ``torch.random.fork_rng`` (which the user called)."""
    path = os.path.abspath(filename)
    return not path.startswith(TORCH_DIR) or path == TORCH_DIR + "random.py"


def _refuse_state_restores(what: str) -> Callable[[], None]:
    """Make ``torch.set_rng_state`` raise in this thread; returns what undoes that. See Note
    [Catching a reseed]."""
    thread = threading.get_ident()
    original = torch.random.set_rng_state, torch.set_rng_state

    def set_rng_state(new_state: torch.Tensor) -> None:
        # Another thread's; fork_rng's exit while an error (a reseed refused) propagates;
        # PyTorch's own (Dynamo keeps the state across its tracing of torch.cond's branches).
        if threading.get_ident() != thread or sys.exc_info()[1] is not None \
                or not _called_by_user(sys._getframe(1).f_code.co_filename):
            return original[0](new_state)
        raise UnsupportedError(
            f"{what} sets the global random number generator's state (torch.set_rng_state, "
            f"which torch.random.fork_rng calls on exit) at {current_user_line()}; its compiled "
            "graphs draw random numbers from the caller's generator when they run, and the "
            "restore would happen only while tracing.\nFix: call fork_rng/set_rng_state "
            "outside the compiled function, or draw from a torch.Generator passed as an "
            "argument."
        )

    torch.random.set_rng_state = torch.set_rng_state = set_rng_state

    def unpatch() -> None:
        torch.random.set_rng_state, torch.set_rng_state = original

    return unpatch


def reseeding_refused(what: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what} reseeds the global random number generator (torch.manual_seed inside the "
        "function); its compiled graphs draw random numbers from the caller's generator state, "
        "so the reseeding would happen only while tracing.\nFix: seed outside the compiled "
        "function, or draw from a torch.Generator passed as an argument."
    )


class StateWatch:
    """``flat_fn``, called in the caller's global state and putting it back after; remembers
    the state its first call left. See Note [Global state the function leaves changed]."""

    def __init__(self, flat_fn: Callable[..., tuple[list[Any], pytree.TreeSpec]]) -> None:
        self.flat_fn = flat_fn
        self.after: GlobalState | None = None
        self.calls = 0

    def __call__(self, *args: Any) -> tuple[list[Any], pytree.TreeSpec]:
        before = GlobalState.now()
        try:
            out = self.flat_fn(*args)
        finally:
            after = GlobalState.now()
            if after != before:
                before.restore()
        if self.calls == 0 and after != before:
            self.after = after
        self.calls += 1
        return out


# Note [Training flags of modules the function calls]
# A function that calls a module it closes over (``aot_function(lambda x: model(x))``) traces
# the module's training flag as it is then: dropout and batch norm take their training or
# evaluation path in the graph. ``model.eval()`` afterwards did not show: the graph went on
# dropping out. So the modules a trace calls are recorded with their flags (a global forward
# pre-hook while tracing, in the tracing thread only), and an entry is used only while every
# recorded module that is still alive has its traced flag; otherwise the function is traced
# again, with a recompile decision naming the module. aot_module keeps the flags in its layout
# key instead, and Dynamo's graphs call no modules.
ModuleFlags = tuple[tuple["weakref.ref[torch.nn.Module]", bool], ...]


@contextlib.contextmanager
def modules_called(watch: bool = True) -> Iterator[list[torch.nn.Module]]:
    """The modules whose forward runs in this thread inside the block, in call order (none
    unless ``watch``)."""
    called: list[torch.nn.Module] = []
    if not watch:
        yield called
        return
    thread = threading.get_ident()

    def record(module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == thread and not any(m is module for m in called):
            called.append(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield called
    finally:
        handle.remove()


def module_flags(modules: list[torch.nn.Module]) -> ModuleFlags:
    return tuple((weakref.ref(m), m.training) for m in modules)


def flags_hold(flags: ModuleFlags) -> bool:
    """Every recorded module still alive has the training flag it was traced with."""
    for ref, training in flags:
        module = ref()
        if module is not None and module.training != training:
            return False
    return True


def flag_changes(flags: ModuleFlags) -> str:
    """e.g. ``the training flag of Dropout (a module the function calls) changed: True -> False``."""
    return "; ".join(
        f"the training flag of {type(m).__name__} (a module the function calls, traced with "
        f"its flag) changed: {training} -> {m.training}"
        for ref, training in flags if (m := ref()) is not None and m.training != training)
