"""Which autograd node each call of a captured backward comes from, in eager's order.

Note [Eager node order]
The engine captures nodes in its own topological order: a stack, starting at the graph root,
onto which a node is pushed once every gradient flowing into it is known. Eager runs the ready
node created last in the forward first (and accumulation into ``.grad`` as soon as it is ready).
On independent branches the two orders differ, and so would the order of the hooks that run
there. While a capture starts, autograd can list the nodes in eager's order; we replay the
engine's stack over those same nodes to learn which NodeCall index is which node, check the
result against the node names the engine reports, and let ``passes.follow_node_order`` put each
node's calls in eager's order.
"""

from __future__ import annotations

from collections import ChainMap, Counter
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

#: Nodes visited while matching the engine's order of several backward roots before giving up.
MAX_ROOT_STEPS = 1_000_000
MAX_ROOTS = 256


def execution_order() -> tuple[list[Any] | None, str]:
    """The autograd nodes of the running backward, in the order eager would run them; or
    ``None`` and why autograd cannot list them."""
    try:
        return list(torch._C._current_graph_task_execution_order()), ""
    except RuntimeError as exc:
        if "INTERNAL ASSERT" in str(exc):  # it visits that node once per root and asserts
            return None, ("autograd cannot list eager's node order when several backward roots "
                          "are outputs of one autograd node (e.g. backward(list(x.chunk(2))))")
        if "multithreading disabled" in str(exc):
            return None, ("autograd lists eager's node order only in a thread whose backward "
                          "runs with multithreading disabled, as enable() sets for its own "
                          "thread; this backward runs in another thread")
        raise


def eager_ranks(eager_order: Sequence[Any], call_names: Mapping[int, str]) -> dict[int, int] | None:
    """NodeCall index -> position in ``eager_order`` (the graph root first), or ``None`` when no
    replay of the engine's order gives the node names it reported in ``call_names``, or several
    replays that place nodes differently do (backward roots alike in structure)."""
    rank = {node: r for r, node in enumerate(eager_order)}
    incoming: Counter[Any] = Counter()
    for node in eager_order:
        incoming.update(fn for fn, _ in node.next_functions if fn in rank)
    roots = [node for node in eager_order if incoming[node] == 0]
    if len(roots) > MAX_ROOTS:  # the search recurses once per root
        return None
    found: list[dict[int, int]] = []
    steps = [0]

    def search(left: list[Any], waiting: MutableMapping[Any, int], calls: list[Any]) -> bool:
        """Try each root still pushed as the next one the engine pops: the nodes it makes ready
        are captured before the next root (a stack), so a wrong choice shows in their names at
        once. True: stop (two orders fit, or the search is too long)."""
        if not left:
            if _same_names(calls, call_names):
                ranks = {0: -1} | {i: rank[node] for i, node in enumerate(calls, start=1)}
                if found and ranks != found[0]:
                    found.append(ranks)
                    return True
                found[:] = [ranks]
            return False
        for k, root in enumerate(left):
            after = ChainMap({}, waiting)  # what this root's part counts down, over the rest
            part = _capture_order([root], after, rank)
            steps[0] += len(part) * (len(roots) - len(left) + 1)  # lookups down the chain
            if steps[0] > MAX_ROOT_STEPS:
                found[:] = [{}, {}]  # not known
                return True
            if _names_from(calls, part, call_names) and search(
                    left[:k] + left[k + 1:], after, calls + part):
                return True
        return False

    search(roots, incoming, [])
    return found[0] if len(found) == 1 else None


def _names_from(calls: Sequence[Any], part: Sequence[Any], call_names: Mapping[int, str]) -> bool:
    """Whether the calls in ``part``, captured after ``calls``, have the names reported."""
    return all(type(node).name(node) == call_names[i]
               for i, node in enumerate(part, start=len(calls) + 1) if i in call_names)


def _capture_order(roots: Sequence[Any], waiting: MutableMapping[Any, int],
                   rank: Mapping[Any, int]) -> list[Any]:
    """The engine's capture order from ``roots`` pushed in order, counting the inputs each node
    still waits for down in ``waiting``."""
    stack = list(roots)
    calls = []
    while stack:
        node = stack.pop()
        calls.append(node)
        for fn, _ in node.next_functions:
            if fn in rank:
                waiting[fn] -= 1
                if waiting[fn] == 0:
                    stack.append(fn)
    return calls


def _same_names(calls: Sequence[Any], call_names: Mapping[int, str]) -> bool:
    if len(calls) + 1 < len(call_names):
        return False
    # type(node).name: a custom Function's node is its ctx, where ``ctx.name = ...`` may shadow it.
    return all(i == 0 or (i <= len(calls) and type(calls[i - 1]).name(calls[i - 1]) == name)
               for i, name in call_names.items())
