"""Which containers of modules (and modules between) a trace reached on its way to the modules
it called, and read (Note [What a trace reads besides its inputs] in aotkit.aot.reads)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def with_containers(called: dict[int, nn.Module], read: set[int],
                    roots: Iterable[nn.Module] = ()) -> list[tuple[int, nn.Module]]:
    """The modules called, then the ones between them, or between ``roots`` and them, the
    function reached without calling (a ModuleList it loops over, whose ``append`` the graph
    would not see: not one of the containers it never ``read``, a list kept for bookkeeping
    over modules it reaches otherwise), and the empty containers and None children of those it
    holds or calls (only there: a model's unused parts cost nothing per call), by id."""
    found = dict(called)
    seen: set[int] = set()
    leading: set[int] = set()  # the containers found to lead to called modules

    def leads_to_called(m: nn.Module) -> bool:
        below = False
        for c in m._modules.values():
            if c is not None and (id(c) in called or id(c) in leading):  # also seen elsewhere
                below = True
            if c is None or id(c) in seen or id(c) in called:
                continue
            seen.add(id(c))
            if isinstance(c, _CONTAINERS) and c._modules and id(c) not in read:
                continue
            if c._modules and leads_to_called(c):
                found[id(c)] = c
                leading.add(id(c))
                below = True
            elif _placeholder(c):  # its own children tell (its parent's need not be watched)
                found[id(c)] = c
        return below

    for m in called.values():
        leads_to_called(m)
    for m in roots:
        if id(m) not in found and not scripted(m) and (
                leads_to_called(m) or _placeholder(m)
                or any(c is None for c in m._modules.values())):
            found[id(m)] = m
    return list(found.items())


# The container methods that hand out what a container holds: a container none of them was
# called on while tracing is one the function never read (Note [What a trace reads besides
# its inputs]). Traces run one at a time (Note [One compile at a time]), so no other
# recording's patch is undone under this one.
_CONTAINER_READS = ("__getitem__", "__iter__", "__len__", "__contains__", "__getattr__", "keys",
                    "items", "values", "children", "named_children", "modules", "named_modules",
                    "parameters", "named_parameters", "buffers", "named_buffers")


@contextlib.contextmanager
def reading_containers(read: set[int], thread: int) -> Iterator[None]:
    """Note in ``read`` the ids of the containers of modules read in this thread meanwhile."""
    patched = []
    for cls in _CONTAINERS:
        for name in _CONTAINER_READS:
            if (method := getattr(cls, name, None)) is not None:
                patched.append((cls, name, cls.__dict__.get(name)))
                setattr(cls, name, _noting_read(method, read, thread))
    try:
        yield
    finally:
        for cls, name, own in reversed(patched):
            if own is None:  # inherited
                delattr(cls, name)
            else:
                setattr(cls, name, own)


def _noting_read(method: Callable[..., Any], read: set[int], thread: int) -> Callable[..., Any]:
    @functools.wraps(method)
    def noting(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and threading.get_ident() == thread:
            read.add(id(self))
        return method(self, *args, **kwargs)

    return noting


def _placeholder(m: nn.Module) -> bool:
    """An empty container, filled later (an adapter list). A None child (a head set later) is
    told by its module's children where the function holds or calls that module."""
    return not m._modules and isinstance(m, _CONTAINERS)


def scripted(m: Any) -> bool:
    """A TorchScript module, whose attributes live in C++ (its ``__dict__`` is no module's)."""
    return issubclass(type(m), torch.jit.ScriptModule)
