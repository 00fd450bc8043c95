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

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: Orders of several backward roots tried when matching the engine's order (roots are rare).
MAX_ROOT_ORDERS = 24


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
    found: dict[int, int] | None = None
    for ordered_roots in itertools.islice(itertools.permutations(roots), MAX_ROOT_ORDERS):
        calls = _capture_order(ordered_roots, incoming, rank)
        if not _same_names(calls, call_names):
            continue
        ranks = {0: -1} | {i: rank[node] for i, node in enumerate(calls, start=1)}
        if found is not None and ranks != found:
            return None  # roots alike in structure: names cannot tell which order the engine took
        found = ranks
    return found


def _capture_order(roots: Sequence[Any], incoming: Counter[Any],
                   rank: Mapping[Any, int]) -> list[Any]:
    """The engine's capture order after the graph root, which pushes ``roots`` in order."""
    waiting = Counter(incoming)
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
