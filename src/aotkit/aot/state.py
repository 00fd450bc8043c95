"""Global state around the calls of a traced function: grad mode, autocast, the default dtype
and the default generator. See Note [Global state the function leaves changed]."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

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
# so it is refused. A reseed shows in the generator's initial seed (its state would also move
# when another thread draws a number while we trace); reseeding with the seed it already has
# does not show and is not caught. A graph from Dynamo is not refused: Dynamo decides what runs
# where (it gives ``torch.seed()`` a graph of its own), as with PyTorch's own AOT autograd.
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
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        return torch.get_rng_state().numpy().tobytes()


def set_default_rng_state(state: bytes) -> None:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


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

    def __init__(self, flat_fn: Callable[..., tuple[list[Any], pytree.TreeSpec]],
                 name: str, refuse_reseeds: bool = True) -> None:
        self.flat_fn = flat_fn
        self.name = name
        self.refuse_reseeds = refuse_reseeds
        self.after: GlobalState | None = None
        self.calls = 0

    def __call__(self, *args: Any) -> tuple[list[Any], pytree.TreeSpec]:
        before, rng, seed = GlobalState.now(), default_rng_state(), torch.initial_seed()
        try:
            out = self.flat_fn(*args)
        finally:
            after = GlobalState.now()
            if after != before:
                before.restore()
            reseeded = self.refuse_reseeds and torch.initial_seed() != seed
            if reseeded:
                set_default_rng_state(rng)
        if reseeded:
            raise reseeding_refused(self.name)
        if self.calls == 0 and after != before:
            self.after = after
        self.calls += 1
        return out
