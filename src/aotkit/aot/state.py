"""Global state around the calls of a traced function: grad mode, autocast, the default dtype
and the default generator. See Note [Global state the function leaves changed]."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from aotkit import counters
from aotkit.aot.frames import TORCH_DIR, current_user_line
from aotkit.aot.signature import AUTOCAST_DEVICES
from aotkit.errors import UnsupportedError


# Note [Global state the function leaves changed]
# A function may switch grad mode, autocast, the default dtype or another mode of GlobalState
# and not switch it back (``torch.set_grad_enabled(False)`` at its end; Dynamo's graphs call
# ``_set_grad_enabled``). Eager leaves the state switched; traced, the switch happened once per
# tracing pass, and it leaked into the next pass, which then traced other dtypes or grad modes.
# So every call of the function while tracing starts in the caller's state and puts it back
# afterwards; what the first call switched is recorded, and the runtime switches it after each
# call, as eager's call leaves it, and nothing else (a mode outside the signature, such as
# matmul precision, may differ at the next call). Reseeding the global generator
# (``torch.manual_seed`` inside) cannot be replayed that way: the graph draws its random
# numbers at run time from the caller's generator state, so it is refused (ReseedWatch, set up by aotkit.aot.trace.tracing). A graph from Dynamo is not
# refused: Dynamo decides what runs where (it gives ``torch.seed()`` a graph of its own), as
# with PyTorch's own AOT autograd.
@dataclass(frozen=True)
class GlobalState:
    """The global modes a function may switch and leave switched: grad mode, autocast (on or
    off, and its dtype, per device), the default dtype, deterministic algorithms, the mkldnn and
    cudnn switches and float32 matmul precision. See Note [Global state the function leaves
    changed]. A field that is None is left as it is by :meth:`restore`."""

    grad: bool | None
    autocast: tuple[tuple[bool, torch.dtype] | None, ...] | None
    default_dtype: torch.dtype | None
    deterministic: tuple[bool, bool] | None
    backends: tuple[bool, bool] | None
    matmul_precision: str | None

    @staticmethod
    def now() -> GlobalState:
        return GlobalState(
            torch.is_grad_enabled(),
            tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                  for d in AUTOCAST_DEVICES),
            torch.get_default_dtype(),
            (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled()),
            (torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled),
            torch.get_float32_matmul_precision())

    def changes_from(self, before: GlobalState) -> GlobalState:
        """Only the fields that differ from ``before``: what a call switched."""
        changed = GlobalState(*(None if new == old else new for new, old in zip(
            astuple(self), astuple(before), strict=True)))
        if changed.autocast is None or before.autocast is None:
            return changed
        autocast = tuple(None if new == old else new  # per device
                         for new, old in zip(changed.autocast, before.autocast, strict=True))
        return replace(changed, autocast=autocast)

    def restore(self) -> None:
        if self.grad is not None:
            torch._C._set_grad_enabled(self.grad)
        for device, mode in zip(AUTOCAST_DEVICES, self.autocast or (), strict=False):
            if mode is not None:
                torch.set_autocast_enabled(device, mode[0])
                torch.set_autocast_dtype(device, mode[1])
        if self.default_dtype is not None:
            torch.set_default_dtype(self.default_dtype)
        if self.deterministic is not None:
            torch.use_deterministic_algorithms(self.deterministic[0],
                                               warn_only=self.deterministic[1])
        if self.backends is not None:
            torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled = self.backends
        if self.matmul_precision is not None:
            torch.set_float32_matmul_precision(self.matmul_precision)


def default_rng_state() -> bytes:
    """The default CPU generator's state, read outside every tracing mode."""
    with _outside_modes():
        return torch.default_generator.get_state().numpy().tobytes()


def set_default_rng_state(state: bytes) -> None:
    with _outside_modes():
        torch.default_generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


@contextlib.contextmanager
def _outside_modes() -> Iterator[None]:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _seeded_state(seed: int) -> bytes:
    """A CPU generator's state right after ``manual_seed(seed)``."""
    with _outside_modes():
        return torch.Generator().manual_seed(seed).get_state().numpy().tobytes()


# Note [Catching a reseed]
# Tracing runs random ops on fake tensors, which never advance the default generator, so the
# function's ``torch.manual_seed(s)`` or ``torch.set_rng_state(saved)`` is the only thing of the
# traced thread that moves it (another thread drawing numbers moves it too, which must not
# count, and the generator must not move under that thread either). While the watch lasts:
# - ``torch.manual_seed`` called by the traced thread's own code raises at the call;
# - a reseed that went around that (``from torch import manual_seed`` before tracing) shows in
#   ``torch.initial_seed()``, or, with the seed already in use, as the state going back to
#   where ``manual_seed(s)`` puts it (caught only if a draw came since the caller seeded);
# - ``torch.set_rng_state`` called by that code (``torch.random.fork_rng`` calls it on exit)
#   raises once the trace has drawn from the default generator: the graph's draws move the
#   caller's generator at run time, which the restore was meant to undo. A restore with no draw
#   before it changes nothing, and reading the state stays allowed (``torch.utils.checkpoint``
#   reads it).
# PyTorch's own calls (Dynamo tracing torch.cond's branches keeps the state) are not refused.
# Another thread's manual_seed or set_rng_state, through the same patched functions, starts
# the comparison afresh: the traced function did not reseed, and that thread's seed stays.
# Threads the trace started are the function's own; a thread that was alive before it (a pool
# worker) cannot be told apart from an unrelated one, so its reseed is taken as not the
# function's and recorded as a ``reseed`` decision (were it the function's, the graph would
# draw without reseeding).
class ReseedWatch:
    """Whether the default generator has been reseeded since this watch began. See Note
    [Catching a reseed]."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.draws = 0  # draws from the default generator traced so far
        self._begin_at_current_state()
        self._unpatch = self._patch()

    def _begin_at_current_state(self) -> None:
        """Compare with the generator as it is now (also after another thread set it)."""
        self.seed = torch.initial_seed()
        self.state = default_rng_state()
        self.fresh = _seeded_state(self.seed)

    def reseeded(self) -> bool:
        if torch.initial_seed() != self.seed:
            return True
        now = default_rng_state()
        return now != self.state and now == self.fresh

    def end(self) -> None:
        """Undo the patches; put the caller's generator state back where a reseed moved it."""
        self._unpatch()
        if self.reseeded():
            set_default_rng_state(self.state)

    def _patch(self) -> Callable[[], None]:
        thread = threading.get_ident()
        active = [True]
        originals = (torch.random.manual_seed, torch.random.set_rng_state)

        def refused(caller: str) -> bool:
            # Another thread's call; a call after the watch ended (a module imported while
            # tracing kept the patched function); fork_rng's exit while an error propagates;
            # PyTorch's own calls.
            return (active[0] and threading.get_ident() == thread
                    and sys.exc_info()[1] is None and _called_by_user(caller))

        # Threads started during the trace may be the function's own: their reseed counts.
        before = {t.ident for t in threading.enumerate()} - {thread}

        told: set[int] = set()  # one decision per thread and trace

        def elsewhere(call: str) -> bool:
            ident = threading.get_ident()
            if not (active[0] and ident in before):
                return False
            if ident not in told:
                told.add(ident)
                counters.record("reseed", self.what, f"{call} from thread "
                                f"{threading.current_thread().name} during the trace, taken as "
                                "not the function's", level=logging.WARNING)
            return True

        def manual_seed(seed: int) -> Any:
            if refused(sys._getframe(1).f_code.co_filename):
                raise reseeding_refused(f"{self.what} (at {current_user_line()})")
            result = originals[0](seed)
            if elsewhere("torch.manual_seed"):  # not the function's: that thread's seed stays
                self._begin_at_current_state()
            return result

        def set_rng_state(new_state: torch.Tensor) -> None:
            if self.draws and refused(sys._getframe(1).f_code.co_filename):
                raise _restore_refused(self.what)
            originals[1](new_state)
            if elsewhere("torch.set_rng_state"):
                self._begin_at_current_state()

        torch.random.manual_seed = torch.manual_seed = manual_seed
        torch.random.set_rng_state = torch.set_rng_state = set_rng_state

        def unpatch() -> None:
            active[0] = False
            torch.random.manual_seed = torch.manual_seed = originals[0]
            torch.random.set_rng_state = torch.set_rng_state = originals[1]

        return unpatch


def _called_by_user(filename: str) -> bool:
    """A call from the user's code, or from ``torch.random.fork_rng`` (which the user called)."""
    path = os.path.abspath(filename)
    return not path.startswith(TORCH_DIR) or path == TORCH_DIR + "random.py"


def _restore_refused(what: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what} sets the global random number generator's state (torch.set_rng_state, "
        f"which torch.random.fork_rng calls on exit) at {current_user_line()} after drawing "
        "random numbers; its compiled graphs draw from the caller's generator when they run, "
        "and the restore would happen only while tracing.\nFix: call fork_rng/set_rng_state "
        "outside the compiled function, or draw from a torch.Generator passed as an argument."
    )


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
            if after != before:  # only what changed: a mode may refuse to be set at all
                before.changes_from(after).restore()  # (mkldnn's under PyTorch's tests)
        if self.calls == 0 and after != before:
            self.after = after.changes_from(before)
        self.calls += 1
        return out
