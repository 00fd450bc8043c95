"""Graph passes over a captured backward: eager's node order, accumulation placement, dead-code
elimination and the CUDA-graph scalar move."""

from __future__ import annotations

import heapq
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import fx

from aotkit.compiled_autograd.runtime import (
    IMPURE,
    Op,
    call_accumulate_grad,
    call_cpp_tensor_pre_hooks,
    call_hook,
)
from aotkit.partition.graph import is_impure


def eliminate_dead_code(graph: fx.Graph) -> None:
    """Drop unused values (size reads, dummy getitems) but keep every call with effects."""

    def impure(node: fx.Node) -> bool:
        return (node.op == "call_function" and node.target in IMPURE) or is_impure(node)

    graph.eliminate_dead_code(impure)


def _is_input_read(node: fx.Node) -> bool:
    return node.op == "placeholder" or (
        node.target is operator.getitem and node.args[0].op == "placeholder"  # type: ignore[union-attr]
    )


def place_accumulations_eagerly(graph: fx.Graph) -> None:
    """Move each ``.grad`` accumulation (with the tensor hooks on that gradient, and its
    post-accumulate-grad hooks) right after its gradient is computed.

    The engine visits leaves in its own order when capturing, often last, while eager
    accumulates a leaf, running its hooks, as soon as its gradient is ready; hooks observing
    ``.grad`` would otherwise run in another order, and gradients would live longer.
    """
    placed: dict[fx.Node, fx.Node] = {}  # a node -> the last node moved right after it
    for node in list(graph.nodes):
        if node.target is call_accumulate_grad or _feeds_accumulation(node):
            _move_after_inputs(node, placed)
    hooks = [n for n in graph.find_nodes(op="call_function", target=call_hook)
             if n.kwargs.get("hook_type") == "post_acc_grad_hook"]
    for hook in reversed(hooks):  # reversed + append after acc keeps the hooks' relative order
        param = hook.args[1]
        acc = next((u for u in param.users if u.target is call_accumulate_grad), None)  # type: ignore[union-attr]
        if acc is not None:
            acc.append(hook.args[0])  # type: ignore[arg-type]
            hook.args[0].append(hook)  # type: ignore[union-attr]


def _feeds_accumulation(node: fx.Node) -> bool:
    """A tensor hook on a leaf's gradient (``param.register_hook``, ``retain_grad``), possibly
    followed by more hooks before the accumulation."""
    is_tensor_hook = node.target is call_cpp_tensor_pre_hooks or (
        node.target is call_hook and node.kwargs.get("hook_type") == "tensor_pre_hook")
    return is_tensor_hook and any(
        u.target is call_accumulate_grad or _feeds_accumulation(u) for u in node.users)


def _move_after_inputs(node: fx.Node, placed: dict[fx.Node, fx.Node]) -> None:
    """Move ``node`` right after the last value it reads (after nodes already moved there, in
    their order); reads of graph inputs come along, just before it."""
    deps = [a for a in node.all_input_nodes if not _is_input_read(a)]
    if not deps:
        return
    target = max(deps)
    anchor = placed.get(target, target)
    reads = [a for a in node.all_input_nodes if _is_input_read(a) and a.op != "placeholder"]
    anchor.append(node)
    for read in reads:
        if read > node:
            node.prepend(read)
    placed[target] = node


def follow_node_order(graph: fx.Graph, ranks: Mapping[int, int]) -> None:
    """Reorder the calls recorded for each autograd node by that node's rank in ``ranks`` (a
    NodeCall index -> eager position; see Note [Eager node order] in engine_order), keeping each
    node's calls in their order and every value after the values it reads.

    A value recorded without a node of its own (a getitem, a size computation) belongs to the
    node being recorded when it was made; a value is due as early as its earliest reader. A
    pre-hook (``nodecall`` None: engines differ on whether they name the node before or after
    running its pre-hooks) belongs to the node reading its result. The graph's nodes need not
    be in a valid order beforehand (``sum_in_eager_order`` leaves them out of it).

    A gradient sum belongs to the latest producer of its addends: eager adds a gradient to the
    input buffer when its producer runs. The engine records the sum while capturing whichever
    producer it reaches second, possibly eager's earlier one, which made the sum, and through it
    the later producer's whole branch, due too early (a leaf's hooks ran before those of a
    branch eager runs first)."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    own = _recorded_ranks(nodes, ranks)
    for node in nodes:  # a sum's addend sums come first, their own ranks already their latest
        if _is_buffer_sum(node):
            own[node] = max((own.get(a, -1.0) for a in node.all_input_nodes), default=own[node])
    due: dict[fx.Node, float] = {}
    for node in reversed(nodes):
        readers = [due[u] for u in node.users if u in due]
        if readers and _is_pre_hook_value(node):
            due[node] = min(readers)
        else:
            due[node] = min([own[node], *readers])
    position = {node: i for i, node in enumerate(nodes)}
    waiting = {n: sum(a in position for a in n.all_input_nodes) for n in nodes}
    ready = [(due[n], position[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    output = graph.output_node()
    while ready:
        _, _, node = heapq.heappop(ready)
        output.prepend(node)
        for user in node.users:
            if user in waiting:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, (due[user], position[user], user))


def _is_pre_hook_value(node: fx.Node) -> bool:
    """A pre-hook call (``nodecall`` None), or an item of its result."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return "nodecall" in node.meta and node.meta["nodecall"] is None


def _recorded_ranks(nodes: list[fx.Node], ranks: Mapping[int, int]) -> dict[fx.Node, float]:
    """The eager rank of the autograd node being recorded when each of ``nodes`` was made."""
    own: dict[fx.Node, float] = {}
    current = -1.0
    for node in nodes:
        if node.meta.get("nodecall") is not None:
            current = ranks.get(node.meta["nodecall"], current)
        own[node] = current
    return own


# Note [Gradient sums in eager's order]
# When several nodes send a gradient to one input of a node, the engine sums them in its input
# buffer as they arrive: ``(g1 + g2) + g3`` in the order their producers run. Float addition is
# not associative, and the engine captures nodes in another order than eager runs them, so the
# captured chain may group the same gradients differently (a parallel residual,
# ``mlp(x) + attn(x) + x``, differed from eager by 1e-8..1e-5). Each chain's addends are put back
# in the order eager's producers run before the calls are reordered, the first two included:
# ``b + a`` has the values of ``a + b`` but ``b``'s layout, which hooks see and later
# reductions round by.
def sum_in_eager_order(graph: fx.Graph, ranks: Mapping[int, int]) -> None:
    """Regroup each input buffer's chain of captured sums so the gradients are added in the
    order eager produces them. See Note [Gradient sums in eager's order]. The nodes may end up
    out of order: ``follow_node_order`` must run next."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    made_at = _recorded_ranks(nodes, ranks)
    for head in [n for n in nodes if _is_buffer_sum(n) and not _continues_a_sum(n)]:
        chain = [head]
        while _is_buffer_sum(chain[-1].args[0]) and len(chain[-1].args[0].users) == 1:
            chain.append(chain[-1].args[0])  # type: ignore[arg-type]
        chain.reverse()
        addends = [chain[0].args[0], *(add.args[1] for add in chain)]
        ordered = sorted(addends, key=lambda a: made_at.get(a, -1.0))  # type: ignore[arg-type]
        if ordered == addends:
            continue  # (a + b == b + a, but the sum takes its first addend's layout, as eager's)
        for k, add in enumerate(chain):
            add.args = (chain[k - 1] if k else ordered[0], ordered[k + 1])


def _is_buffer_sum(node: object) -> bool:
    return isinstance(node, fx.Node) and node.meta.get("buffer_sum", False)


def _continues_a_sum(node: fx.Node) -> bool:
    """``node`` is the running total of a longer chain: its one reader adds the next gradient."""
    return len(node.users) == 1 and all(_is_buffer_sum(u) and u.args[0] is node for u in node.users)


@dataclass
class ScalarMove:
    """Which CPU scalar inputs move to CUDA, and why each other one stays."""

    moved: list[int] = field(default_factory=list)
    kept: dict[int, str] = field(default_factory=dict)
    has_cuda_inputs: bool = False


def _input_reads(graph: fx.Graph) -> list[tuple[int, fx.Node]]:
    """``(index, node)`` for each ``inputs[index]`` read in the graph."""
    placeholder = next(n for n in graph.nodes if n.op == "placeholder" and n.target == "inputs")
    return [
        (user.args[1], user)
        for user in placeholder.users
        if user.target is operator.getitem and isinstance(user.args[1], int)
    ]


def _feeds_only_aten(node: fx.Node) -> fx.Node | None:
    """The first user that is not an ATen/prims op or built-in formula, or ``None``."""
    for user in node.users:
        target = user.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims"):
            continue
        if isinstance(target, Op) and not target.is_custom_function:
            continue
        return user
    return None


def cpu_scalars_to_move(graph: fx.Graph) -> ScalarMove:
    """Plan moving CPU 0-dim tensor inputs to CUDA so a CUDA graph can capture the backward.

    Eager autograd keeps Python scalars of the forward as CPU 0-dim tensors (``DivBackward0``'s
    ``other``); ATen ops accept a CUDA 0-dim tensor in their place, but user code (hooks, custom
    Functions) might not, so only inputs that feed ATen ops alone move. A graph with no CUDA
    input is left alone: it would not be CUDA-graphed anyway.

        >>> plan = cpu_scalars_to_move(graph)  # doctest: +SKIP
        >>> plan.moved, plan.kept  # doctest: +SKIP
        ([3], {5: 'feeds call_hook'})
    """
    plan = ScalarMove()
    candidates: list[int] = []
    for index, node in _input_reads(graph):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if val.device.type == "cuda":
            plan.has_cuda_inputs = True
        elif val.device.type == "cpu" and val.dim() == 0:
            blocker = _feeds_only_aten(node)
            if blocker is None:
                candidates.append(index)
            else:
                plan.kept[index] = f"feeds {blocker.name}, which is not an ATen op"
    if plan.has_cuda_inputs:
        plan.moved = sorted(candidates)
    else:
        plan.kept.update({i: "the graph has no CUDA inputs" for i in candidates})
    return plan
