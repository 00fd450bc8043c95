"""What a trace reads besides its inputs: modules it calls and tensors it closes over. A compiled
entry holds them as the trace found them and is used only while they still are so.

Note [What a trace reads besides its inputs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A function may call a module it does not take as its compiled input (``aot_function(lambda x:
model(x))``, a frozen teacher handed to an ``aot_module``'s forward) and read tensors it closes
over (a mask, a global table, that module's frozen weights). The graph holds such tensors as
constants (later in-place changes show, Note [Closed-over tensors]) and the branches the
module's training flag took. Three changes would leave the graph silently stale:

* the module's training flag (``model.eval()``): dropout went on dropping out;
* a parameter or buffer of the module replaced by a new tensor (``load_state_dict(...,
  assign=True)``, ``module.weight = nn.Parameter(...)``): the graph went on reading the old one;
* a constant made to require grad (a frozen feature extractor unfrozen after warm-up): its
  gradient was silently dropped, where tracing it that way is refused.

So each trace records the modules whose forward runs (a global forward pre-hook, in the tracing
thread only) with their flags and their own parameters and buffers, and the constants it reads
where a gradient could flow (Note [Closed-over tensors]), and an entry is used only while every
recorded module still alive has them and no such constant requires grad; otherwise the function
is traced again, with a recompile decision naming the change (a constant that now requires grad
is then refused, with the fix). A module the function switches itself (``model.eval()``
inside; ``Module.train`` is watched while tracing) keeps no flag: its flag is the function's
doing, the same at every call. ``aot_module``'s own submodules are inputs, not reads: its
layout key holds them; Dynamo's graphs call no modules.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class _ModuleRead:
    module: weakref.ref[nn.Module]
    training: bool | None  # None: the function switches it itself
    # ("parameter" or "buffer", name, the tensor then); weak: the graph holds what it uses.
    tensors: tuple[tuple[str, str, weakref.ref[torch.Tensor] | None], ...]

    def change(self) -> str | None:
        """What changed since the trace, if anything (None also once the module is freed)."""
        module = self.module()
        if module is None:
            return None
        where = f"{type(module).__name__} (a module the function calls)"
        if self.training is not None and module.training != self.training:
            return (f"the training flag of {where}, traced with its flag, changed: "
                    f"{self.training} -> {module.training}")
        for kind, name, ref in self.tensors:
            table = module._parameters if kind == "parameter" else module._buffers
            if table.get(name) is not (ref() if ref is not None else None):
                return (f"the {kind} {name!r} of {where}, which the graph reads as a "
                        "constant, was replaced")
        return None


@dataclass
class Reads:
    """What one trace read besides its inputs. See Note [What a trace reads besides its inputs]."""

    modules: list[_ModuleRead] = field(default_factory=list)
    constants: dict[int, torch.Tensor] = field(default_factory=dict)  # by id

    def hold(self) -> bool:
        """Whether the graph is still what a trace would give."""
        return (not self.modules and not self.constants) or self.change() is None

    def change(self) -> str | None:
        """What changed since the trace, if anything: every change, ``; ``-separated."""
        changes = [why for read in self.modules if (why := read.change()) is not None]
        changes += [f"a tensor of shape {tuple(t.shape)} the function reads as a constant (a "
                    "closed-over variable, a global or an attribute) now requires grad"
                    for t in self.constants.values() if t.requires_grad]
        return "; ".join(changes) or None


_ACTIVE: contextvars.ContextVar[Reads | None] = contextvars.ContextVar(
    "aotkit_reads", default=None)


def note_constant(t: torch.Tensor) -> None:
    """Called by the tracing guard for a constant read where a gradient could flow."""
    reads = _ACTIVE.get()
    if reads is not None:
        reads.constants.setdefault(id(t), t)


@contextlib.contextmanager
def recording(own_modules: Callable[[], Iterable[nn.Module]] | None = None) -> Iterator[Reads]:
    """Record what the traces inside the block read (Note [What a trace reads besides its
    inputs]); ``own_modules``: the compiled module's own submodules, which are inputs."""
    reads = Reads()
    own = {id(m) for m in own_modules()} if own_modules is not None else set()
    thread = threading.get_ident()
    called: list[nn.Module] = []
    switched: list[nn.Module] = []
    snapshots: list[_ModuleRead] = []
    original_train = nn.Module.train

    def record(module: nn.Module, args: object) -> None:
        # Dynamo inlines module hooks where it traces a module call (a torch.cond branch
        # inside our trace) and cannot trace get_ident: the modules such a branch calls stay
        # unrecorded.
        if torch.compiler.is_compiling() or threading.get_ident() != thread \
                or id(module) in own or any(m is module for m in called):
            return
        called.append(module)
        snapshots.append(_ModuleRead(weakref.ref(module), module.training, _tensors_of(module)))

    def train(module: nn.Module, mode: bool = True) -> nn.Module:
        if threading.get_ident() == thread:
            switched.append(module)
        return original_train(module, mode)

    handle = nn.modules.module.register_module_forward_pre_hook(record)
    nn.Module.train = train  # type: ignore[method-assign]
    token = _ACTIVE.set(reads)
    try:
        yield reads
    finally:
        _ACTIVE.reset(token)
        handle.remove()
        nn.Module.train = original_train  # type: ignore[method-assign]
        reads.modules = [
            _ModuleRead(r.module, None, r.tensors)
            if any(m is r.module() for m in switched) else r for r in snapshots]


def _tensors_of(module: nn.Module) -> tuple[tuple[str, str, weakref.ref[torch.Tensor] | None], ...]:
    return (*(("parameter", n, _ref(t)) for n, t in module._parameters.items()),
            *(("buffer", n, _ref(t)) for n, t in module._buffers.items()))


def _ref(t: torch.Tensor | None) -> weakref.ref[torch.Tensor] | None:
    return weakref.ref(t) if t is not None else None
