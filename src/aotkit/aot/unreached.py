"""Which inputs of a compiled call may get no gradient when a backward reaches only some of its
outputs (Note [Outputs backward does not reach] in aotkit.aot.runtime)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Iterator
from typing import Any

import torch

from aotkit.aot.subclass import PASSING_NONE

# Note [One walk per backward]
# Each compiled call that a backward reaches with missing tangents walks the eager graph behind
# its inputs. Calls in a loop (a per-step head on an eager recurrence) share that graph, so
# walking it afresh per call cost the square of the loop's length (800 steps: 11 s against
# eager's 0.25 s). What a walk learns about a node holds for the whole backward, so it is kept
# for the running graph task, each node with its result: ids stay unique while the memo holds
# the node objects (the engine's Python wrappers of C++ nodes come and go). The memo is dropped
# when the backward ends (an engine callback). A backward inside a hook is a task of its own,
# with its own memo; one that raised never runs its callbacks: a thread keeps a few memos at
# most, the oldest dropped first, and all of them are dropped by the next compiled call's
# forward that runs outside any backward of its thread (a raised backward's nodes and saved
# tensors were kept alive for good otherwise: a NaN check raising in a hook, then training on).
_memo = threading.local()
_MEMOS = 4


def quiet(edge: tuple[Any, int], compiled: type) -> bool:
    """Whether None sent along ``edge`` reaches only nodes that pass it on or drop it, as eager
    never visiting them would. ``compiled``: the node class of compiled calls, which apply the
    same rule to their own inputs and keep weak references to their outputs (and to the views
    regenerated from them) in ``outputs``, a tuple per output slot."""
    memo = _task_memo()
    path: list[tuple[Hashable, Any, Iterator[tuple[Any, int]]]] = []
    found = _enter(edge, memo, path, compiled)
    while path:  # depth first; a node found loud makes every node on the path to it loud
        if found is False:
            for key, node, _ in path:
                memo[key] = (False, node)
            return False
        key, node, rest = path[-1]
        if (nxt := next(rest, None)) is None:
            path.pop()
            memo[key] = (True, node)
            found = True
        else:
            found = _enter(nxt, memo, path, compiled)
    return found is not False


def forget_ended() -> None:
    """Drop this thread's memos where no backward runs in it (Note [One walk per backward])."""
    if getattr(_memo, "by_task", None) and torch._C._current_graph_task_id() == -1:
        _memo.by_task.clear()


def _task_memo() -> dict[Hashable, tuple[bool, Any]]:
    task = torch._C._current_graph_task_id()
    if task == -1:  # not inside the engine (a compiled-autograd replay): this walk only
        return {}
    memos = _memo.__dict__.setdefault("by_task", {})
    if (memo := memos.get(task)) is None:
        if len(memos) >= _MEMOS:  # the oldest: a backward that raised, whose callback never ran
            del memos[next(iter(memos))]
        memo = memos[task] = {}
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: memos.pop(task, None))
    return memo


def _enter(edge: tuple[Any, int], memo: dict[Hashable, tuple[bool, Any]],
           path: list[tuple[Hashable, Any, Iterator[tuple[Any, int]]]], compiled: type) -> bool | None:
    """The answer for ``edge`` if known without going further, else None after putting its
    node on ``path``."""
    node, slot = edge
    if node is None:
        return True
    key: Hashable = (id(node), slot) if isinstance(node, compiled) else id(node)
    if (known := memo.get(key)) is not None:
        return known[0]
    looked = _look(node, slot, compiled)
    if looked is None:
        path.append((key, node, iter(node.next_functions)))
    else:
        memo[key] = (looked, node)
    return looked


def _look(node: Any, slot: int, compiled: type) -> bool | None:
    """What None sent into ``node`` at ``slot`` does: False, it reaches a hook, or a Function
    that materializes zeros; True, it stops there; None, the node passes it on."""
    if (runs := runs_node(node)) is False:  # autograd.grad(..., inputs=) does not run it, nor its hooks
        return True
    if isinstance(node, compiled):  # that call applies the same rule
        refs = node.outputs[slot] if slot < len(node.outputs) else ()
        return not any((t := ref()) is not None and t._backward_hooks for ref in refs)
    if (leaf := getattr(node, "variable", None)) is not None:
        return not (leaf._backward_hooks or (leaf._post_accumulate_grad_hooks and (
            runs or torch._C._current_graph_task_id() == -1)))  # autograd.grad never accumulates
    if isinstance(node, PASSING_NONE):  # a subclass input's wrapping: hooks on the subclass?
        ref, had = getattr(node, "source", (None, False))
        return False if (bool(t._backward_hooks) if (t := ref and ref()) is not None else had) \
            else None
    if isinstance(node, torch.autograd.function.BackwardCFunction) \
            or type(node).__name__ == "AccumulateGrad":
        return False  # a Python Function (a module's backward hook) materializes zeros
    return None


def runs_node(node: Any) -> bool | None:
    """Whether the engine runs ``node``; None where it does not say: a leaf's AccumulateGrad
    under autograd.grad (which captures the gradient: the tensor's hooks run, post-accumulate
    ones never), or outside the engine (a compiled-autograd replay)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return None


def note_view(base: torch.Tensor, view: torch.Tensor, compiled: type) -> None:
    """A view regenerated from a compiled call's output: hooks on it count as the output's."""
    if isinstance(node := base.grad_fn, compiled):
        node.outputs[base.output_nr] += (weakref.ref(view),)
