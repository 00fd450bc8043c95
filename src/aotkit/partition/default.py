"""The default partitioner: the forward computes its outputs; whatever the backward needs from
the forward is saved, and nothing is recomputed except forward-only nodes the outputs don't need
(and, in graphs with activation-checkpointed regions, those regions' values)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from aotkit.partition.graph import (
    ancestors,
    extract,
    is_sym,
    split_joint,
    syms_binding_backward,
    with_getitems,
)
from aotkit.partition.min_cut import has_checkpointed_regions, min_cut_rematerialization_partition


def default_partition(
    joint_gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split a joint graph into forward and backward graphs, saving what the backward uses.

    The forward returns ``fw outputs + saved tensors + saved symints``; the backward takes
    ``saved symints + saved tensors + tangents`` and returns one grad per primal.

    Example::

        >>> import torch, aotkit
        >>> f = aotkit.aot_function(lambda x: x.sin().sin(), aotkit.compilers.nop,
        ...                         partition_fn=aotkit.default_partition)
        >>> f(torch.ones(2, requires_grad=True)).sum().backward()

    A joint graph with activation-checkpointed regions (``torch.utils.checkpoint`` under
    ``torch.compile``) is partitioned by :func:`min_cut_rematerialization_partition`, which
    recomputes those regions as eager's checkpoint does (Note [Activation checkpointing]); the
    partition report says so.
    """
    if has_checkpointed_regions(joint_gm):
        fw_gm, bw_gm = min_cut_rematerialization_partition(  # the budget is min-cut's option
            joint_gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, activation_memory_budget=1.0)
        fw_gm.meta["partition"] = dataclasses.replace(
            fw_gm.meta["partition"], partitioner="default_partition (checkpointed regions are "
            "recomputed: partitioned by min_cut_rematerialization_partition)")
        return fw_gm, bw_gm
    parts = split_joint(joint_gm, num_fwd_outputs)
    fw_effects, bw_effects = parts.fw_effects, parts.bw_effects
    forward = with_getitems(ancestors([*parts.fw_outputs, *fw_effects]) | set(parts.primals))
    # A size the backward reads comes from the forward as a SymInt, never through the tensor;
    # floats computed from sizes are computed again (Note [Size arithmetic is recomputed]).
    computed_in_fw = (forward | parts.fw_syms) - parts.size_arithmetic
    backward = ancestors([*parts.bw_outputs, *bw_effects], stop=computed_in_fw) - computed_in_fw
    returned = set(parts.bw_outputs)  # a custom backward may return a saved input as is
    used_by_backward = [
        n for n in joint_gm.graph.nodes
        if n in computed_in_fw and (n in returned or any(u in backward for u in n.users))
    ]
    saved_syms = [n for n in used_by_backward if is_sym(n)]
    saved = [n for n in used_by_backward if not is_sym(n)]
    saved_syms += syms_binding_backward(  # Note [Binding symbols in the backward]
        [n for n in joint_gm.graph.nodes if n in parts.fw_syms and n not in saved_syms],
        [*saved_syms, *saved, *parts.tangents], parts.primals)
    fw_gm = extract(joint_gm, parts.primals, [*parts.fw_outputs, *saved, *saved_syms],
                    effects=fw_effects)
    bw_gm = extract(joint_gm, [*saved_syms, *saved, *parts.tangents], parts.bw_outputs,
                    effects=bw_effects)
    return fw_gm, bw_gm
