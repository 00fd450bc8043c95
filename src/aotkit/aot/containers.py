"""Which containers of modules (and modules between) a trace reached on its way to the modules
it called (Note [What a trace reads besides its inputs] in aotkit.aot.reads)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def with_containers(called: dict[int, nn.Module],
                    roots: Iterable[nn.Module] = ()) -> list[tuple[int, nn.Module]]:
    """The modules called, then the ones between them, or between ``roots`` and them, the
    function reached without calling (a ModuleList it loops over, whose ``append`` the graph
    would not see; also one it never reads, which cannot be told apart: a list kept for
    bookkeeping over modules it reaches otherwise), and the empty containers and None children
    of those it holds or calls (only there: a model's unused parts cost nothing per call), by
    id."""
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


def _placeholder(m: nn.Module) -> bool:
    """An empty container, filled later (an adapter list). A None child (a head set later) is
    told by its module's children where the function holds or calls that module."""
    return not m._modules and isinstance(m, _CONTAINERS)


def scripted(m: Any) -> bool:
    """A TorchScript module, whose attributes live in C++ (its ``__dict__`` is no module's)."""
    return issubclass(type(m), torch.jit.ScriptModule)
