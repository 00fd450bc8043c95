"""Joint-graph helpers every partitioner shares: classify nodes, extract sub-graphs."""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from aotkit.errors import ArgumentError


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (node and module meta dicts copied, their
    values shared), for whoever rewrites the graph (a compiler, a pass cutting a variant): the
    caller's stays as traced."""
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    copied.meta.update(gm.meta)
    return copied


@dataclass
class JointParts:
    """The pieces of a joint graph ``(primals, tangents) -> (fw outputs, grads)``."""

    primals: list[fx.Node]
    tangents: list[fx.Node]
    fw_outputs: list[fx.Node | None]
    bw_outputs: list[fx.Node | None]
    # Everything a tangent feeds, or a random or side-effecting op of the backward's formulas
    tangent_side: set[fx.Node] = field(default_factory=set)
    # Random and side-effecting ops: those of the backward run in it, the rest run in the
    # forward, once each, as in eager (Note [Effects of the backward]).
    fw_effects: list[fx.Node] = field(default_factory=list)
    bw_effects: list[fx.Node] = field(default_factory=list)
    # SymInts no tangent feeds (sizes of primals and of forward values): the forward computes
    # those the backward reads and saves them, so no tensor is kept only for its sizes.
    fw_syms: set[fx.Node] = field(default_factory=set)
    # Floats and bools computed from those alone, which the backward computes again (Note [Size
    # arithmetic is recomputed]); not in fw_syms.
    size_arithmetic: set[fx.Node] = field(default_factory=set)


def split_joint(joint: fx.GraphModule, num_fwd_outputs: int) -> JointParts:
    """Name the parts of a joint graph; refuse anything else with a message saying why.
    Repeated reads of one graph constant become one (Note [Constants the backward reads])."""
    _read_constants_once(joint)
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    outputs = joint.graph.output_node().args[0]
    parts = JointParts(
        primals=[p for p in placeholders if p.name.startswith("primals")],
        tangents=[p for p in placeholders if p.name.startswith("tangents")],
        fw_outputs=list(outputs[:num_fwd_outputs]) if isinstance(outputs, (list, tuple)) else [],
        bw_outputs=list(outputs[num_fwd_outputs:]) if isinstance(outputs, (list, tuple)) else [],
    )
    # Note [Effects of the backward]
    parts.tangent_side = descendants([*parts.tangents, *(
        n for n in joint.graph.nodes if has_effects(n) and n.meta.get("in_backward"))])
    for node in joint.graph.nodes:
        if has_effects(node):
            (parts.bw_effects if node in parts.tangent_side else parts.fw_effects).append(node)
        elif is_sym(node) and node not in parts.tangent_side:
            parts.fw_syms.add(node)
    parts.size_arithmetic = size_arithmetic(n for n in joint.graph.nodes if n in parts.fw_syms)
    parts.fw_syms -= parts.size_arithmetic
    problem = _not_a_joint(parts, placeholders, outputs, num_fwd_outputs)
    if problem:
        raise ArgumentError(
            f"not a joint graph: {problem}.\nFix: partitioners take the joint graph AOT autograd "
            "traces, (primals_*, tangents_*) -> (forward outputs, one grad per primal), and "
            "num_fwd_outputs, the number of forward outputs."
        )
    return parts


# Note [Effects of the backward]
# A random or side-effecting op runs where eager runs it: ``torch.rand_like(x)`` in a custom
# Function's backward draws when backward() runs, after whatever the caller drew in between.
# Placed by what feeds it, it depends on no tangent and ran in the forward instead: the caller's
# draws between forward and backward, and the gradient, came out other than eager's (PyTorch's
# AOT autograd too). The joint trace marks the nodes recorded while it takes the gradients
# (``in_backward``); such an op, with everything it feeds, is on the backward's side.


# Note [Constants the backward reads]
# A tensor the function closes over is a graph constant (``get_attr``), and the joint trace
# reads it twice: in the forward, and again where a backward formula uses the value autograd
# saved (``x * C`` saves C). Read in the backward graph, it held the tensor's value at backward
# time: a caller changing C between forward and backward got gradients from the new C, where
# eager either used the saved value or raised ("modified by an inplace operation"). The reads
# are merged, so a constant the forward reads is a forward value like an input: what the
# backward needs of it is saved (through save_for_backward, version-checked as eager's saved
# tensors are), never read again; min-cut may save it, free like an input, to recompute
# ``x + C`` (so changing C before backward() raises where eager, which saved the sum, does not,
# as for inputs). A constant only the backward reads (a custom Function's backward) is read
# when the backward runs, as eager reads it. One the forward reads too is saved even where a
# custom Function's backward reads it itself, which eager reads anew: the graph cannot tell
# that read from a saved one (marking every read inside a custom backward as live made the
# saved reads of ATen formulas and ctx.save_for_backward live too, silently).
def _read_constants_once(joint: fx.GraphModule) -> None:
    first: dict[str, fx.Node] = {}
    for node in list(joint.graph.find_nodes(op="get_attr")):
        if not is_constant(node):
            continue
        if node.target in first:
            node.replace_all_uses_with(first[node.target])
            joint.graph.erase_node(node)
        else:
            first[node.target] = node  # type: ignore[index]


def is_constant(node: fx.Node) -> bool:
    """A graph constant holding a tensor (not a higher-order op's body)."""
    return node.op == "get_attr" and isinstance(
        getattr(node.graph.owning_module, str(node.target), None), torch.Tensor)


def is_input(node: fx.Node) -> bool:
    """Held by the caller (a primal) or by the graph (a tensor constant)."""
    return node.op == "placeholder" or is_constant(node)


# Note [Saving inputs the function mutates]
# Saving an input costs no memory: the caller holds it anyway. Not so for an input the function
# changes in place (``buf.add_(1)``): the runtime copies the graph's new value into it after the
# forward, so a saved input would be overwritten, and the runtime saves a clone of it instead
# (aotkit.aot.runtime). Min-cut counted such an input as free and saved a 1000x1000 buffer to
# recompute a 1000-element slice of it. The joint trace marks these placeholders, and saving one
# costs its bytes like any activation.
def free_to_save(node: fx.Node) -> bool:
    """Saving ``node`` adds no memory: an input the function does not mutate, or a constant."""
    return is_input(node) and not node.meta.get("mutated_input", False)


def viewed_once(node: fx.Node) -> fx.Node | None:
    """The value ``node`` is a view of, or None if it is no view (``_unsafe_view``, which
    matmul's decomposition returns, shares its input's memory without being marked a view; a
    chunk of ``split``/``unbind`` is a view of what they split)."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        if not (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view):
            return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and (
            target.is_view or target is torch.ops.aten._unsafe_view.default) \
            and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def view_root(node: fx.Node) -> fx.Node:
    """The value ``node`` is a chain of views of (``node`` itself if it is no view)."""
    while (base := viewed_once(node)) is not None:
        node = base
    return node


def _not_a_joint(parts: JointParts, placeholders: list[fx.Node], outputs: object,
                 num_fwd_outputs: int) -> str | None:
    others = [p.name for p in placeholders if p not in {*parts.primals, *parts.tangents}]
    if others:
        return f"inputs {others} are neither primals_* nor tangents_*"
    if not isinstance(outputs, (list, tuple)):
        return "it does not return a list or tuple"
    if not 0 <= num_fwd_outputs <= len(outputs):
        return f"num_fwd_outputs={num_fwd_outputs} but the graph has {len(outputs)} outputs"
    if len(parts.bw_outputs) != len(parts.primals):
        return (f"{len(parts.bw_outputs)} outputs after the {num_fwd_outputs} forward ones, but "
                f"{len(parts.primals)} primals (one grad per primal)")
    return None


def ancestors(roots: Iterable[fx.Node | None], stop: set[fx.Node] = frozenset()) -> set[fx.Node]:  # type: ignore[assignment]
    """Every node ``roots`` depend on, the roots included, not walking past ``stop``."""
    seen: set[fx.Node] = set()
    todo = [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in stop:
            todo.extend(node.all_input_nodes)
    return seen


def descendants(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.users)
    return seen


def with_getitems(nodes: set[fx.Node]) -> set[fx.Node]:
    """``nodes`` plus every ``getitem`` of a multi-output node among them.

    A tuple-valued node cannot cross the forward/backward boundary (``save_for_backward`` takes
    tensors), so the items the backward reads are taken apart where the tuple is made.
    """
    items = {u for n in nodes for u in n.users if u.op == "call_function" and u.target is operator.getitem}
    return nodes | items


# Note [Binding symbols in the backward]
# A code generator for the backward (Inductor) learns each symbol of its inputs' sizes from an
# input: a SymInt input that is the symbol, or a tensor input with a size that is the symbol. A
# symbol may reach the backward only inside expressions, from which it cannot be learnt: the
# backward of ``cat([x, y])`` under dynamic shapes reads x's size s0 and the total s0 + s1 (a
# saved SymInt, the tangent's size), never s1 alone; a size read from data in the forward (u2 =
# masked_select's count) arrives as u2 + 5. The forward then also saves the SymInt that is the
# symbol itself (a SymInt input under Dynamo, or a size the forward reads); where the forward
# reads none (``F.pad(x, (1, 2))`` of an input of size s0: the backward gets s0 + 3 only, and
# aot_function's graphs take no SymInt inputs), it reads the input's size for that.
def syms_binding_backward(fw_syms: Iterable[fx.Node], bw_inputs: Sequence[fx.Node],
                          primals: Sequence[fx.Node]) -> list[fx.Node]:
    """Forward SymInt nodes, in ``fw_syms``' order, to save as well so that every symbol in the
    backward inputs' sizes is bound by one of its inputs; for a symbol no such node is, a
    ``sym_size``/``sym_stride`` node of a primal added to the primals' graph."""
    bound: set[sympy.Symbol] = set()
    needed: set[sympy.Symbol] = set()
    for node in bw_inputs:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            binding, other = [val], []
        elif isinstance(val, torch.Tensor):
            binding, other = list(val.shape), [*val.stride(), val.storage_offset()]
        else:
            continue
        for size in (*binding, *other):
            if isinstance(size, torch.SymInt):
                needed |= _resolved(size).free_symbols
        bound |= {e for e in map(_resolved, binding) if isinstance(e, sympy.Symbol)}
    missing = needed - bound
    extra = []
    for node in fw_syms:
        val = node.meta.get("val")
        if not isinstance(val, torch.SymInt):
            continue
        expr = _resolved(val)
        if expr in missing:
            extra.append(node)
            missing.discard(expr)
    return extra + [read for symbol in sorted(missing, key=str)
                    if (read := _read_symbol(symbol, primals)) is not None]


def _read_symbol(symbol: sympy.Symbol, primals: Sequence[fx.Node]) -> fx.Node | None:
    """A new node reading ``symbol`` off a primal's size or stride, if one is exactly it."""
    for primal in primals:
        val = primal.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for op, sizes in ((torch.ops.aten.sym_size.int, val.shape),
                          (torch.ops.aten.sym_stride.int, val.stride())):
            for dim, size in enumerate(sizes):
                if isinstance(size, torch.SymInt) and _resolved(size) == symbol:
                    graph = primal.graph
                    with graph.inserting_after(graph.find_nodes(op="placeholder")[-1]):
                        read = graph.call_function(op, (primal, dim))
                    read.meta["val"] = size
                    return read
    return None


def _resolved(size: int | torch.SymInt) -> sympy.Expr:
    """A size's expression after the ShapeEnv's renamings (Note [Tangents of data-dependent sizes])."""
    if not isinstance(size, torch.SymInt):
        return sympy.Integer(size)
    return size.node.shape_env.replace(size.node.expr)


def is_sym(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


# Note [Size arithmetic is recomputed]
# A float or bool the backward computes from sizes alone (batch norm's 1 / (N * H * W), the
# ``x.shape[-1] ** 0.5`` of attention) is recomputed in the backward from the SymInts it comes
# from, which are saved, rather than saved itself: a code generator keys its caches on its
# inputs, and Inductor's cache cannot pickle a SymFloat input such as ``FloatTrueDiv(1.0,
# IntTrueDiv(8*s0*s1**2, 8))`` (it logged a traceback and compiled without its cache); SymInts
# it handles, and PyTorch's partitioners save those only.
def size_arithmetic(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """The float and bool results among ``nodes`` (in graph order) computed from SymInts and
    such results only (Note [Size arithmetic is recomputed])."""
    found: set[fx.Node] = set()
    for node in nodes:
        if node.op == "call_function" and isinstance(node.meta.get("val"), (torch.SymFloat, torch.SymBool)) \
                and node.all_input_nodes and all(
                    u in found or isinstance(u.meta.get("val"), torch.SymInt) for u in node.all_input_nodes):
            found.add(node)
    return found


# Side effects FX's list misses: effect tokens' ops, torch._assert_async without a
# message (its .msg overload is listed), which eager raises from and graphs dropped as dead, and
# reading a tensor's value (x.item()) whose result the trace made a constant
# (``torch._check(n == 3)``) or never used: the checks on it (Note [Data-dependent sizes]) need
# the value read at every call.
_ALSO_IMPURE = {torch.ops.prims._sink_tokens.default, torch.ops.aten._assert_async.default,
                torch.ops.aten._local_scalar_dense.default,
                # Ordered effects (Note [Effect tokens do not cross to the backward]); torch 2.11
                # does not register linalg's error check as one, and its graphs dropped it.
                torch.ops.higher_order.with_effects, torch.ops.aten._linalg_check_errors.default}


def is_impure(node: fx.Node) -> bool:
    """FX's impurity plus the side effects it does not know: dead-code elimination with this
    predicate keeps ordered side effects such as linalg error checks and async asserts."""
    return node.is_impure() or node.target in _ALSO_IMPURE


def has_effects(node: fx.Node) -> bool:
    """Random ops and side effects: run once, in the forward, never dropped or recomputed."""
    return node.op == "call_function" and is_impure(node)


def extract(
    joint: fx.GraphModule,
    inputs: Sequence[fx.Node],
    outputs: Sequence[fx.Node | None],
    names: Sequence[str] | None = None,
    effects: Sequence[fx.Node] = (),
) -> fx.GraphModule:
    """A new graph computing ``outputs`` from ``inputs`` with copies of the joint's nodes, and
    running the side-effecting nodes ``effects`` although no output depends on them."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(names[i] if names else node.name)
        env[node].meta = dict(node.meta)
        if node.op == "call_function":  # a value the other graph computed: which op's output
            made_by = node.args[0] if node.target is operator.getitem else node
            output = node.args[1] if node.target is operator.getitem else 0
            env[node].meta["computed_by"] = (getattr(made_by, "target", None), output)
    needed = ancestors([*outputs, *effects], stop=set(inputs))
    for node in joint.graph.nodes:
        if node in needed and node not in env and node.op != "output":
            if node.op == "placeholder":
                raise AssertionError(f"{node.name} is needed but not an input of the sub-graph")
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output([env[o] if isinstance(o, fx.Node) else o for o in outputs])
    graph.eliminate_dead_code(is_impure_node=is_impure)
    return fx.GraphModule(joint, graph)
