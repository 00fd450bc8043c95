"""Common-subexpression elimination on ATen graphs (ours: importing it costs nothing, where
PyTorch's partitioner pulls in Inductor for its CSE pass)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.fx as fx

from aotkit.partition.graph import is_impure


def cse(gm: fx.GraphModule, keep: Collection[fx.Node] = ()) -> fx.GraphModule:
    """A copy of ``gm`` in which pure nodes applying the same op to the same arguments appear
    once. Random and side-effecting nodes are never merged, nor the nodes in ``keep`` (the
    tensors a caller receives: two outputs must stay two tensors, and a value the backward
    recomputes must not become the caller's, which the caller may change in place).

    Example::

        >>> import torch, torch.fx as fx
        >>> from aotkit.partition.cse import cse
        >>> g = fx.Graph(); x = g.placeholder("x")
        >>> a = g.call_function(torch.ops.aten.sin.default, (x,))
        >>> b = g.call_function(torch.ops.aten.sin.default, (x,))
        >>> _ = g.output(g.call_function(torch.ops.aten.add.Tensor, (a, b)))
        >>> [n.name for n in cse(fx.GraphModule({}, g)).graph.nodes]
        ['x', 'sin_default', 'add_tensor', 'output']
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    first: dict[Any, fx.Node] = {}
    for node in gm.graph.nodes:
        key = None if node in keep else _key(node, env)
        if key is not None and key in first:
            env[node] = first[key]
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
        if key is not None:
            first[key] = env[node]
    return fx.GraphModule(gm, graph)


def _key(node: fx.Node, env: dict[fx.Node, fx.Node]) -> Any:
    """What makes two nodes compute the same value, or None when they must stay apart."""
    # Effect tokens start chains of their own (Note [Effect tokens do not cross to the
    # backward]): merged, the backward's chain began at the forward's token, which min-cut saved.
    if node.op != "call_function" or is_impure(node) \
            or node.target is torch.ops.prims._make_token.default:
        return None
    args = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
    key = (node.target, _frozen(args[0]), _frozen(tuple(sorted(args[1].items()))),
           node.meta.get("custom_backward"),  # Note [Custom backwards run on zeros]
           node.meta.get("custom_formula"))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _frozen(value: Any) -> Any:
    """A hashable stand-in that tells apart what ``==`` does not: ``1``, ``1.0`` and ``True``
    give different dtypes, ``0.0`` and ``-0.0`` different signs."""
    if isinstance(value, (list, tuple)):
        return (type(value), *(_frozen(v) for v in value))
    if isinstance(value, fx.Node):
        return value
    if isinstance(value, float):
        return (float, repr(value))
    return (type(value), value)
