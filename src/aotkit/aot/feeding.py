"""The runtime side of Note [Outputs other outputs are computed from] (in
aotkit.aot.analysis): where a hooked output misses a gradient that eager's passes through it,
the backward is refused."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from aotkit.aot import unreached
from aotkit.errors import UnsupportedError

if TYPE_CHECKING:
    from aotkit.aot.runtime import CompiledGraphs


def refuse_hooks_missing_inner_gradients(ctx: Any, graphs: CompiledGraphs,
                                         grads: Sequence[Any]) -> None:
    """Note [Outputs other outputs are computed from] in aotkit.aot.analysis."""
    if not ctx.fed:  # not recorded: a subclass boundary, inputs laid over one another
        return
    ran = frozenset(ctx.fed_ran)  # in this backward (retain_graph=True: another may follow)
    ctx.fed_ran.clear()
    for k, dependents in graphs.feeding:
        if not _hooked(ctx.fed[k]):
            continue
        reached = [j for j, at in dependents if (
            grads[at] is not None if isinstance(at, int)
            else at == "ran" and (j in ran or _runs_changed(ctx.fed.get(j))))]
        if reached:
            raise _hook_misses(graphs, k, reached)


def _hook_misses(graphs: CompiledGraphs, k: int, reached: list[int]) -> UnsupportedError:
    return UnsupportedError(
        f"output {k} of {graphs.name} (counted over the flattened outputs) has a hook, "
        f"retain_grad() or is among backward()'s inputs, and output(s) {reached}, computed "
        "from it inside the compiled function, got a gradient in this backward: that part of "
        "its gradient flows inside the compiled backward or beside it, never through output "
        f"{k} itself, so its hook or .grad would miss it (eager's sees it).\nFix: compute "
        f"those outputs from output {k} outside the compiled function, or read the gradient "
        "elsewhere (a hook on an input).")


def note_fed(node: Any, graphs: CompiledGraphs, outs: Sequence[Any]) -> None:
    """Keep on the call's node what its backward's check reads: the hooked outputs' tensors
    (weakly, with their versions), and for the view dependents, which of them ran; a view of
    an input is checked when its own node runs."""
    node.fed = fed = {j: (weakref.ref(outs[j]), outs[j]._version)
                      for j in (*graphs.fed, *graphs.fed_views)}
    node.fed_ran = ran = set()
    for k, dependents in graphs.feeding:
        for j, at in dependents:
            if isinstance(at, str) and (view_node := outs[j].grad_fn) is not None:
                view_node.register_prehook(functools.partial(_ran, ran, j) if at == "ran"
                                           else functools.partial(_around, graphs, fed, k, j))


def _ran(ran: set[int], j: int, grads: tuple[Any, ...]) -> None:
    if any(g is not None for g in grads):  # a node after it may send None, another compiled call
        ran.add(j)


def _around(graphs: CompiledGraphs, fed: dict[int, tuple[Any, int]], k: int, j: int,
            grads: tuple[Any, ...]) -> None:
    """View ``j``, made beside output ``k`` (from an input, or from a base ``k`` views), gets
    a gradient: refused while ``k`` has hooks (Note [Outputs other outputs are computed
    from])."""
    if any(g is not None for g in grads) and _hooked(fed[k]):
        raise _hook_misses(graphs, k, [j])


def note_beside(graphs: CompiledGraphs, results: Sequence[Any], view: torch.Tensor,
                k: int) -> None:
    """``view``, output ``k``, taken from another output but made beside it (Note [Views taken
    from returned views]), refuses a gradient into it while that output, or one it was taken
    from, has hooks: that gradient goes around them."""
    if view.grad_fn is None:
        return
    chain: dict[int, tuple[Any, int]] = {}
    j = graphs.meta.outputs[k].through
    while j is not None:
        chain[j] = (weakref.ref(results[j]), results[j]._version)
        j = graphs.meta.outputs[j].through
    for j in chain:
        view.grad_fn.register_prehook(functools.partial(_around, graphs, chain, j, k))


def _hooked(fed: tuple[Any, int]) -> bool:
    """Whether the output recorded has hooks or retains its gradient (not read where changed in
    place since: its hooks are the new value's, as in eager)."""
    out = _alive(fed)
    return out is not None and bool(out._backward_hooks or out.retains_grad)


def _alive(fed: tuple[Any, int]) -> torch.Tensor | None:
    """The output tensor recorded, if alive and not changed in place since."""
    ref, version = fed
    out = ref()
    return out if out is not None and out._version == version else None


def _runs_changed(fed: tuple[Any, int] | None) -> bool:
    """Whether a view output changed in place since the call (its gradient then bypasses the
    node noting it: its new node leads into its base) and the engine runs its new node."""
    out = fed[0]() if fed is not None else None
    return out is not None and out._version != fed[1] and (  # type: ignore[index]
        out.grad_fn is not None and unreached.runs_node(out.grad_fn) is not False)
