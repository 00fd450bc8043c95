"""The min-cut rematerialization partitioner: save the fewest activation bytes, and let the
backward recompute cheap pointwise and view ops instead of loading them.

Note [Min-cut partitioning]
Every forward value the backward reads must reach it: saved by the forward, or recomputed by
the backward from values that reach it. As a flow network, each forward tensor node n is an
edge n_in -> n_out whose capacity is the cost of saving n; data edges u_out -> v_in are
unbounded; the source feeds n_in of every node the backward may not recompute (graph inputs,
random, side-effecting and RNN ops, and expensive ops: matmul, convolution, attention, large
reductions), and n_out of every forward node the backward reads feeds the sink. A minimum cut
crosses exactly the nodes to save; a node whose n_in lies on the sink side is recomputed.
Costs are bytes (symbolic sizes through their hints); graph inputs and the forward's outputs
(and the values outputs are views of) cost no bytes: the caller holds them anyway. Such a value
the backward reads, itself or through views (autograd's ``detach``), is always saved, never
recomputed: eager's formula reads it so (``exp``'s backward its result), and changing it in
place before ``backward()`` must raise eager's "modified by an inplace operation", not give
gradients of the value before the change (reading it counts where a value only the backward
needs is computed from it: sin's backward reads ``cos(y)``, eager's reads ``y``). One it does
not read (nor a view of it) is saved only where nothing else can be (a random op's output a
checkpointed region returns): eager holds no reference to it, so the caller may change it in
place and backward() must still run. For the same reason common-subexpression elimination
leaves the outputs, and the values they view, apart from everything else. Values only the
backward needs, however expensive, are computed there. Ties go to later nodes, which leaves
fewer ops to recompute.
SymInts stay out of the network: every forward SymInt the backward needs is saved.

Note [Activation checkpointing]
``torch.utils.checkpoint`` under ``torch.compile`` reaches us as nodes tagged with a
``CheckpointPolicy`` (``node.meta["recompute"]``) and the id of their checkpointed region
(``ac_graph_id``). As eager's checkpoint does, a region's values are recomputed by the
backward, expensive ones included: a node tagged MUST/PREFER_RECOMPUTE cannot be saved, except
random ops (never recomputed: a second draw would differ) and the region's outputs (values read
by forward code outside the region), which are never recomputed: eager holds them as ordinary
tensors, and recomputing one would rerun its whole region for the next one, quadratic in the
number of layers. A value the region only returns to the caller is recomputed, even where the
backward reads it (exp's result): eager's checkpoint saves the region's inputs, not its
outputs, so the caller may change it in place (or through ``.data``) before backward(). A node
tagged MUST/PREFER_SAVE (a selective-checkpointing policy) is never recomputed, and belongs to its region: the values
it reads there are recomputed from the region's inputs, as eager's selective checkpoint does
(taken for region outputs, they were saved too: twice what eager saves).
"""

from __future__ import annotations

import functools
import numbers
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from aotkit import config
from aotkit.errors import ConfigError, UnsupportedError
from aotkit.partition.cse import cse
from aotkit.partition.graph import (
    ancestors,
    extract,
    free_to_save,
    has_effects,
    is_constant,
    is_input,
    is_sym,
    split_joint,
    syms_binding_backward,
    view_root,
    viewed_once,
)
from aotkit.partition.report import held_bytes, nbytes, report

aten = torch.ops.aten

#: Not pointwise or views, yet cheap to recompute: factories, copies and gathers (whose
#: output may be far larger than what they read: ``x[idx]`` with many indices).
_CHEAP_OPS = frozenset({
    aten.full, aten.zeros, aten.ones, aten.empty, aten.empty_strided, aten.scalar_tensor,
    aten.arange, aten.full_like, aten.zeros_like, aten.ones_like, aten.empty_like,
    aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty, aten.clone, aten._to_copy,
    aten.lift_fresh_copy, aten.copy, aten.index, aten.index_select, aten.gather,
})

#: RNN kernels: their workspace/reserve outputs belong to the very call that made them, so a
#: backward that recomputed the kernel would hand its backward op a workspace from another
#: call. They are never recomputed, whatever the budget. (oneDNN's, whose workspace is even
#: undefined, does not reach training graphs: Note [Python dispatcher] in aotkit.aot.trace.)
_RNN_KERNELS = frozenset({aten.mkldnn_rnn_layer, aten._cudnn_rnn, aten.miopen_rnn})

#: A reduction whose input is this many times larger than its output is never recomputed.
_LARGE_REDUCTION = 4


def min_cut_rematerialization_partition(
    joint_gm: fx.GraphModule,
    joint_inputs: Any,
    *,
    num_fwd_outputs: int,
    activation_memory_budget: float | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split a joint graph so the forward saves the fewest activation bytes; the backward
    recomputes cheap pointwise and view chains (never random ops, matmuls, convolutions,
    attention or large reductions). See Note [Min-cut partitioning].

    ``activation_memory_budget`` (default ``aotkit.config.activation_memory_budget``, 1.0)
    trades compute for memory: below 1 the backward may also recompute expensive ops, until the
    saved bytes are at most ``least + budget * (default - least)``, where ``least`` is what
    recomputing everything but random ops and RNN kernels saves. Saved bytes never grow as the
    budget falls.

    Regions under ``torch.utils.checkpoint`` (traced through ``torch.compile``) are recomputed
    whatever their cost, as eager's checkpoint does (Note [Activation checkpointing]).

    What was saved and recomputed is in ``fw_gm.meta["partition"]`` and ``aotkit.explain()``.

    Example::

        >>> import torch, aotkit
        >>> from aotkit.partition import min_cut_rematerialization_partition as min_cut
        >>> f = aotkit.aot_function(lambda x: x.cos().cos().cos(), aotkit.compilers.nop,
        ...                         partition_fn=min_cut)
        >>> f(torch.ones(3, requires_grad=True)).sum().backward()
        >>> print(aotkit.explain().of_kind("partition")[-1].why)  # doctest: +ELLIPSIS
        min_cut_rematerialization_partition: saved 1 tensor(s) (1 of them inputs), 0 activation bytes, ...
    """
    budget = config.activation_memory_budget if activation_memory_budget is None \
        else activation_memory_budget
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not 0 <= budget <= 1:
        raise ConfigError(
            f"activation_memory_budget must be a number in [0, 1], got {budget!r}.\nFix: 1 keeps "
            "the default cut, 0 recomputes everything but random ops; values between trade the two."
        )
    joint = cse(joint_gm, keep=_handed_out(joint_gm, num_fwd_outputs))
    _dropout_outputs_from_masks(joint)
    network = _Network(joint, num_fwd_outputs)
    saved = network.cut(network.expensive)
    if budget < 1.0:
        saved = _within_budget(network, budget, saved)
    return network.split(saved)


@dataclass
class _Cut:
    saved: list[fx.Node]
    activation_bytes: int


class _Network:
    """The flow network of one joint graph (Note [Min-cut partitioning])."""

    def __init__(self, joint: fx.GraphModule, num_fwd_outputs: int) -> None:
        self.joint = joint
        self.parts = split_joint(joint, num_fwd_outputs)
        tangent_side = self.parts.tangent_side
        self.fw_effects, self.bw_effects = self.parts.fw_effects, self.parts.bw_effects
        nodes = [n for n in joint.graph.nodes if n.op != "output"]
        self.index = {n: i for i, n in enumerate(nodes)}
        forward = [n for n in nodes if n not in tangent_side]
        # Saved where the backward reads them (effectful ones, x.item()'s, too), but for Note
        # [Size arithmetic is recomputed].
        self.fw_syms = {n for n in forward if is_sym(n)} - self.parts.size_arithmetic
        # Other get_attr nodes are the bodies of higher-order ops (torch.cond branches): the
        # backward reads them as its own attributes, never as saved values. Tensor constants
        # the forward reads are inputs (Note [Constants the backward reads]).
        self.fw_tensors = [n for n in forward if not is_sym(n) and (n.op != "get_attr" or (
            is_constant(n) and any(u not in tangent_side for u in n.users)))]
        self.pinned = [n for n in self.fw_tensors if _pinned(n)]
        pinned = set(self.pinned)
        self.held = {view_root(n) for n in self.parts.fw_outputs if isinstance(n, fx.Node)}
        # See Note [Activation checkpointing].
        forward_code = ancestors([*self.parts.fw_outputs, *self.fw_effects])
        self.checkpointed, region_outputs = _checkpointed_regions(
            self.fw_tensors, pinned, forward_code)
        self.read_by_bw = self._read_by_backward(tangent_side)
        # What eager's backward formulas read: besides what the backward graph reads, the
        # inputs of values only the backward needs (sin's backward computes cos(y) from y).
        backward_only = {n for n in self.fw_tensors if n not in forward_code}
        read_whole = {view_root(u) for u in self.read_by_bw | {
            u for n in backward_only for u in n.all_input_nodes} if u not in backward_only}
        self.unsaveable = {n for n in self.fw_tensors if not is_input(n)
                           and view_root(n) in self.held and view_root(n) not in read_whole}
        self.last_resort = sum(nbytes(n) for n in self.fw_tensors) + 2  # bytes, see _capacity
        self.must_save = [n for n in self.fw_tensors if n not in self.unsaveable and (
            n.meta.get("recompute") in _SAVE or n in region_outputs
            or (n in self.held and n in read_whole and n not in self.checkpointed))]
        # Values only the backward needs (a custom Function's backward reading x @ x.T) are
        # computed there, whatever they cost.
        self.expensive = [n for n in self.fw_tensors if n in forward_code
                          and n not in pinned and n not in self.checkpointed and not _cheap(n)]

    def _read_by_backward(self, tangent_side: set[fx.Node]) -> set[fx.Node]:
        bw_nodes = ancestors([*self.parts.bw_outputs, *self.bw_effects]) & tangent_side
        read = {u for n in bw_nodes for u in n.all_input_nodes}
        read |= {o for o in self.parts.bw_outputs if isinstance(o, fx.Node)}
        return (read - tangent_side - self.fw_syms) & set(self.fw_tensors)  # attributes: its own

    def cut(self, banned: Sequence[fx.Node]) -> _Cut:
        """The cheapest set of nodes to save when ``banned`` (and the pinned nodes) may not be
        recomputed."""
        if not self.read_by_bw:
            return _Cut([], 0)
        graph = self._flow_graph({*self.pinned, *self.must_save, *banned})
        try:
            _, (source_side, _) = nx.minimum_cut(graph, "source", "sink")
        except nx.NetworkXUnbounded as exc:
            raise UnsupportedError(
                "min_cut_rematerialization_partition found a value the backward needs that can "
                "neither be saved nor recomputed (a tuple-valued op read whole by the backward?)."
                "\nFix: use aotkit.default_partition for this function."
            ) from exc
        saved = [n for n in self.fw_tensors
                 if (n, "in") in source_side and (n, "out") not in source_side]
        return _Cut(saved, held_bytes(saved))

    def _flow_graph(self, banned: set[fx.Node]) -> nx.DiGraph:
        graph = nx.DiGraph()
        members = set(self.fw_tensors)
        scale = len(self.index) ** 2 + 1  # tie-breaks summed over any cut stay below one byte
        for node in self.fw_tensors:
            capacity = self._capacity(node, scale)
            if capacity is None:
                graph.add_edge((node, "in"), (node, "out"))
            else:
                graph.add_edge((node, "in"), (node, "out"), capacity=capacity)
            if node in banned:
                graph.add_edge("source", (node, "in"))
            for user in node.users:
                if user in members:
                    graph.add_edge((node, "out"), (user, "in"))
            if node in self.read_by_bw:
                graph.add_edge((node, "out"), "sink")
        graph.add_node("source")
        return graph

    def _capacity(self, node: fx.Node, scale: int) -> int | None:
        """Bytes (scaled) plus a tie-break for later nodes; None where a node cannot be saved.
        An output the backward does not read costs more than every other value together: saved
        only where nothing else can be (a checkpointed region's dropout output it returns)."""
        if isinstance(node.meta.get("val"), (list, tuple)) or node in self.checkpointed:
            return None
        if node in self.unsaveable:
            size = self.last_resort
        elif free_to_save(node) or node in self.held:
            size = 0
        else:  # a saved view of an intermediate keeps all of it (held_bytes); one of an input
            # is free there, but weighed at its size here, so the input itself is saved instead
            root = view_root(node)
            size = nbytes(node) if free_to_save(root) else max(nbytes(node), nbytes(root))
        return size * scale + len(self.index) - self.index[node]

    def split(self, cut: _Cut) -> tuple[fx.GraphModule, fx.GraphModule]:
        parts = self.parts
        stop = {*cut.saved, *parts.tangents, *self.fw_syms}
        region = ancestors([*parts.bw_outputs, *self.bw_effects], stop=stop)
        saved = [n for n in cut.saved if n in region]
        saved_syms = [n for n in self.index if n in self.fw_syms and n in region]
        saved_syms += syms_binding_backward(  # Note [Binding symbols in the backward]
            [n for n in self.index if n in self.fw_syms and n not in saved_syms],
            [*saved_syms, *saved, *parts.tangents], parts.primals)
        forward = ancestors([*parts.fw_outputs, *self.fw_effects, *saved, *saved_syms])
        recomputed = [n for n in self.fw_tensors if n in region and n in forward
                      and n not in stop and n.target is not operator.getitem]
        fw_gm = extract(self.joint, parts.primals, [*parts.fw_outputs, *saved, *saved_syms],
                        effects=self.fw_effects)
        bw_gm = extract(self.joint, [*saved_syms, *saved, *parts.tangents], parts.bw_outputs,
                        effects=self.bw_effects)
        fw_gm.meta["partition"] = report(
            "min_cut_rematerialization_partition", [*saved, *saved_syms], recomputed)
        return fw_gm, bw_gm


_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


# Note [Dropout in checkpointed regions]
# A random op is never recomputed, so a checkpointed region's native_dropout kept both its
# results: the mask and the full-size output the next op reads (eager's recompute keeps neither:
# it replays the generator). The output is the input times the mask times 1 / (1 - p), two
# pointwise ops that give the kernel's values bit for bit in float32 and float64 (not in bfloat16
# or float16, where the CPU kernel rounds otherwise: those keep both); computed from the mask
# that way, it is recomputed with its region and only the (bool) mask is saved.
def _dropout_outputs_from_masks(joint: fx.GraphModule) -> None:
    """See Note [Dropout in checkpointed regions]."""
    for node in list(joint.graph.find_nodes(op="call_function",
                                            target=torch.ops.aten.native_dropout.default)):
        results = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        (x, p, *rest), train = node.args, node.kwargs.get("train")
        if node.meta.get("recompute") not in _RECOMPUTE or 0 not in results or 1 not in results \
                or results[0].meta["val"].dtype not in (torch.float32, torch.float64) \
                or (rest[0] if rest else train) is False or not isinstance(p, (int, float)):
            continue  # train=False: the output is a copy, the mask all ones
        out, mask = results[0], results[1]
        with joint.graph.inserting_after(mask):
            masked = joint.graph.call_function(torch.ops.aten.mul.Tensor, (x, mask))
        with joint.graph.inserting_after(masked):
            scaled = joint.graph.call_function(torch.ops.aten.mul.Tensor,
                                               (masked, 0.0 if p == 1 else 1 / (1 - p)))
        masked.meta, scaled.meta = dict(out.meta), dict(out.meta)
        out.replace_all_uses_with(scaled)
        joint.graph.erase_node(out)
    joint.recompile()


def has_checkpointed_regions(joint: fx.GraphModule) -> bool:
    """Whether ``joint`` holds values ``torch.utils.checkpoint`` asks to recompute, in a region
    Dynamo numbered (``aot_function`` traces a selective checkpoint's policy tags without one:
    nothing is recomputed there, and the report said regions were)."""
    return any(n.meta.get("recompute") in _RECOMPUTE and n.meta.get("ac_graph_id") is not None
               for n in joint.graph.nodes)


def _checkpointed_regions(fw_tensors: Sequence[fx.Node], pinned: set[fx.Node],
                          forward_code: set[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """The forward values checkpointed regions recompute, and the regions' outputs (values
    read by forward code, not the backward's formulas, outside their region), which are saved.
    Random ops and their outputs are neither. See Note [Activation checkpointing]."""
    def region(node: fx.Node) -> Any:  # a node saved by policy is in its region too
        return node.meta.get("ac_graph_id") if node.meta.get("recompute") is not None else None

    def random(node: fx.Node) -> bool:
        return node in pinned or (node.target is operator.getitem and node.args[0] in pinned)

    tagged = [n for n in fw_tensors if n.meta.get("recompute") in _RECOMPUTE
              and region(n) is not None and not random(n)]
    outputs = {n for n in tagged
               if any(region(u) != region(n) for u in n.users if u in forward_code)}
    return set(tagged) - outputs, outputs


def _within_budget(network: _Network, budget: float, default: _Cut) -> _Cut:
    """Let the backward recompute expensive ops, largest outputs first, until the saved bytes
    fit the budget: the fewest such ops that do (a binary search: fewer banned ops save no more
    bytes, so the result shrinks as the budget falls). The cut weighs each value by its own
    size, or its base's for a view, which can still misjudge a view sharing its base with
    another saved value: a result keeping more than the default does is never taken."""
    order = sorted(network.expensive, key=lambda n: (-nbytes(n), network.index[n]))
    least = network.cut([])
    target = least.activation_bytes + budget * (default.activation_bytes - least.activation_bytes)
    lo, hi, best = 0, len(order), least
    while lo < hi:
        mid = (lo + hi) // 2
        attempt = network.cut(order[mid:])
        if attempt.activation_bytes <= target:
            hi, best = mid, attempt
        else:
            lo = mid + 1
    return best if best.activation_bytes <= default.activation_bytes else default


def _handed_out(joint: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    """The forward's outputs and the values they are views of: tensors the caller holds."""
    outputs = joint.graph.output_node().args[0]
    handed = set()
    for node in outputs[:num_fwd_outputs] if isinstance(outputs, (list, tuple)) else ():
        while isinstance(node, fx.Node) and node not in handed:
            handed.add(node)
            node = viewed_once(node)
    return handed


def _pinned(node: fx.Node) -> bool:
    """Never recomputed, whatever the budget: inputs, random, side-effecting and RNN ops, and
    higher-order ops (``torch.cond``) whose bodies hold one or that wrap a random op (a random
    custom op that writes its input, under ``auto_functionalized``): recomputing a branch that
    drops out drew a new mask for the backward."""
    if is_input(node):
        return True
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):  # also auto_functionalized(op, ...)
        wrapped = [a for a in node.args if isinstance(a, torch._ops.OpOverload)]
        return has_effects(node) or any(map(_pinned, _body_nodes(node))) or any(
            torch.Tag.nondeterministic_seeded in op.tags for op in wrapped)
    if isinstance(target, torch._ops.OpOverload) and target.overloadpacket in _RNN_KERNELS:
        return True
    random = isinstance(target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in target.tags
    if random and _dropout_p(node) == 0:
        return False  # an attention kernel without dropout draws no random numbers
    return random or has_effects(node)


def _body_nodes(node: fx.Node) -> Iterator[fx.Node]:
    """The ops of the subgraphs a higher-order op runs (its ``get_attr`` arguments)."""
    owner = node.graph.owning_module
    for arg in node.all_input_nodes:
        if arg.op == "get_attr" and owner is not None:
            body = functools.reduce(getattr, str(arg.target).split("."), owner)
            if isinstance(body, fx.GraphModule):
                yield from (n for n in body.graph.nodes if n.op == "call_function")


def _dropout_p(node: fx.Node) -> Any:
    """The ``dropout_p`` argument of an op that has one (attention kernels), else None."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            if "dropout_p" in node.kwargs:
                return node.kwargs["dropout_p"]
            return node.args[i] if i < len(node.args) else arg.default_value
    return None


def _cheap(node: fx.Node) -> bool:
    """Recomputed freely: views, pointwise ops, factories, small reductions, tuple items."""
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target.is_view or torch.Tag.pointwise in target.tags or target.overloadpacket in _CHEAP_OPS:
        return True
    return torch.Tag.reduction in target.tags and not _shrinks_a_lot(node)


def _shrinks_a_lot(node: fx.Node) -> bool:
    out = nbytes(node)
    ins = max((nbytes(a) for a in node.all_input_nodes), default=0)
    return ins > _LARGE_REDUCTION * max(out, 1)
