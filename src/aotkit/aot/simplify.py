"""Clean-ups of traced graphs before they are partitioned and compiled."""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._prims_common import make_contiguous_strides_for
from torch.fx.experimental.symbolic_shapes import (
    free_symbols,
    free_unbacked_symbols,
    statically_known_true,
)

from aotkit import compat, counters
from aotkit.partition.graph import copy_graph_module, is_impure


# Note [Views that undo themselves]
# Autograd formulas transpose and reshape freely, so a traced joint graph is full of view chains
# that end where they started: the backward of ``x @ w.t()`` takes ``t(t(w))``, a bias grad is
# ``view(sum(g), shape)`` of an already-shaped tensor. Such a chain's last tensor is its first
# one, same storage, sizes, strides and offset, so its users may read the first tensor instead.
# Every compiler gains (each ATen call from Python costs a few microseconds, and the
# partitioner sees that the backward needs the weight itself, a free graph input, instead of a
# saved view of it). Forward outputs are left alone: whether an output is a fresh view of an
# input is part of what the runtime returns to the user (Note [Aliased outputs]).
def drop_noop_views(gm: fx.GraphModule, keep_outputs: int | None = None) -> int:
    """Let users of a view chain that ends where it started read its start instead, and remove
    the views nobody reads any more; the first ``keep_outputs`` graph outputs (all by default)
    keep their nodes. Returns the number of nodes removed. See Note [Views that undo themselves].

    Example::

        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> from aotkit.aot.simplify import drop_noop_views
        >>> gm = make_fx(lambda x: x.t().t() + 1)(torch.ones(2, 3))
        >>> drop_noop_views(gm)
        2
        >>> [n.name for n in gm.graph.nodes]
        ['x_1', 'add', 'output']
    """
    chains: dict[fx.Node, list[fx.Node]] = {}  # a view -> the views it was taken through
    for node in gm.graph.nodes:
        if not _is_view(node):
            continue
        base = node.args[0]
        chains[node] = [*chains.get(base, [base]), node]
        same = next((a for a in chains[node][:-1] if _same_view(a, node)), None)
        if same is not None:
            _replace_uses(node, same, keep_outputs)
    removed = 0
    for node in reversed(chains):  # views have no side effects: unread ones can go
        if not node.users:
            gm.graph.erase_node(node)
            removed += 1
    if removed:
        gm.recompile()
    return removed


# Views that flip a tensor's conjugate or negative bit change its values, not its layout (and
# fake values do not always carry those bits), and detach cuts autograd history a kept output
# may rely on (``W.detach()[1:]`` of a closed-over W): chains through them are not no-ops.
_NOT_NOOP_VIEWS = {torch.ops.aten.conj.default, torch.ops.aten._conj.default,
                   torch.ops.aten._neg_view.default, torch.ops.aten.detach.default}


def _is_view(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.is_view
        and node.target not in _NOT_NOOP_VIEWS
        and bool(node.args)
        and isinstance(node.args[0], fx.Node)
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


def _same_view(a: fx.Node, b: fx.Node) -> bool:
    """Whether two views of one storage are provably the same tensor (sizes may be symbolic)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    if va.layout != torch.strided or vb.layout != torch.strided:
        return False
    # A size read from data (``x[mask]``) may be 1 where the fake kernels assumed it is not:
    # ``squeeze(0)`` or ``expand`` of it looked like no view at all, and was dropped. Dynamo's
    # graphs have such a size replaced already (``x[m].expand_as(x)`` gives it x's symbol, a
    # runtime assumption, not a fact): an expand to symbolic sizes is kept.
    if free_unbacked_symbols((va.shape, vb.shape)) or (
            b.target is torch.ops.aten.expand.default and free_symbols(vb.shape)):
        return False
    return (
        va.dtype == vb.dtype
        and va.device == vb.device
        and known_equal(va.shape, vb.shape)
        and known_equal(va.stride(), vb.stride())
        and known_equal([va.storage_offset()], [vb.storage_offset()])
    )


def known_equal(xs: Any, ys: Any) -> bool:
    """Equal sizes (or strides), element by element, without adding a shape guard."""
    return len(xs) == len(ys) and all(statically_known_true(x == y) for x, y in zip(xs, ys, strict=True))


def _replace_uses(node: fx.Node, by: fx.Node, keep_outputs: int | None) -> None:
    for user in list(node.users):
        if user.op != "output":
            user.replace_input_with(node, by)
        elif keep_outputs is not None:
            outs = user.args[0]
            kept, rest = outs[:keep_outputs], [by if o is node else o for o in outs[keep_outputs:]]
            user.args = (type(outs)([*kept, *rest]), *user.args[1:])


# Note [Factories follow the default dtype]
# ``torch.ones(2)`` traces to ``aten.ones([2])`` with no dtype: run, it makes a tensor of the
# default dtype *then*. The signature holds the caller's default dtype, but a function that
# switches it inside (``torch.set_default_dtype(torch.float64)`` before a factory) had its
# factories run in the caller's dtype. So every op that makes a tensor from no tensor input and
# leaves its dtype to the default gets the dtype it traced to. Not in Dynamo's graphs: Dynamo may
# call its backend in the default dtype its own trace of such a function left, and its factories
# then run as PyTorch's AOT autograd runs them.
def pin_factory_dtypes(gm: fx.GraphModule) -> int:
    """Give factory calls without a dtype the dtype they traced to; returns how many changed.
    See Note [Factories follow the default dtype].

    Example::

        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> from aotkit.aot.simplify import pin_factory_dtypes
        >>> gm = make_fx(lambda x: torch.ones(2) + x)(torch.ones(2))
        >>> pin_factory_dtypes(gm)
        1
        >>> [n.kwargs.get("dtype") for n in gm.graph.nodes if n.name == "ones"]
        [torch.float32]
    """
    pinned = 0
    for node in gm.graph.nodes:
        target, value = node.target, node.meta.get("val")
        if node.op != "call_function" or not (isinstance(target, torch._ops.OpOverload) and isinstance(value, torch.Tensor)):
            continue
        if node.kwargs.get("dtype") is not None or not any(
                a.name == "dtype" and a.kwarg_only for a in target._schema.arguments):
            continue
        if any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
            continue  # dtype=None follows an input tensor (ones_like, sum), not the default
        node.kwargs = {**node.kwargs, "dtype": value.dtype}
        pinned += 1
    if pinned:
        gm.recompile()
    return pinned


# Note [Float arguments from Dynamo]
# Dynamo passes a Python float argument that changes between calls (a learning rate from a
# scheduler) as a 0-d float64 tensor input and reads it back with ``.item()`` in the graph, a
# ``_local_scalar_dense`` node with a backed SymFloat. It expects its backend to turn the float
# arithmetic on that SymFloat back into tensor ops on the input (``x * lr`` with ``lr`` a tensor),
# which is what torch.fx's tensorify pass does; Inductor cannot compile a ``.item()`` whose
# symbol it is not told how to bind, and every compiler gains a graph without a host read.
# Where the pass cannot rewrite a use, it specializes the float and makes Dynamo trace again
# with it as a constant (it raises ``TensorifyScalarRestartAnalysis``, which Dynamo handles).
# A read nothing uses (an eval-mode dropout's p) is dropped first: the pass would specialize it,
# a second trace for nothing. Trace-time dead-code elimination keeps such reads (Note
# [Data-dependent sizes]), but Dynamo writes its own checks on a value into the graph it hands
# us, so an unused read of one checks nothing.
def tensorify_float_inputs(gm: fx.GraphModule, mode: Any, name: str) -> None:
    """Rewrite arithmetic on floats Dynamo read from tensor inputs into tensor ops, in place.
    A no-op without symbolic shapes. See Note [Float arguments from Dynamo]."""
    reads = [n for n in gm.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default]
    for unused in (n for n in reads if not n.users):
        gm.graph.erase_node(unused)
    if mode.shape_env is None or not any(n.users for n in reads):
        gm.recompile()
        return
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch.fx.passes._tensorify_python_scalars import tensorify_python_scalars

    before = set(TensorifyState.force_specializations)
    try:
        tensorify_python_scalars(gm, mode.shape_env, mode)
    except TensorifyScalarRestartAnalysis:
        new = TensorifyState.force_specializations - before
        floats = sorted({compat.source_name(sources[0]) for symbol, sources in
                         mode.shape_env.var_to_sources.items() if str(symbol) in new and sources})
        which = f" ({', '.join(floats)})" if floats else ""
        counters.record("specialize", name, f"a Python float{which} that Dynamo passes in "
                        "as a value that may change (under dynamic=True every float; else one "
                        "that changed: a module attribute such as a dropout's p or a scale, an "
                        "optimizer's lr) is used where a tensor cannot stand in for it (an op's "
                        "Scalar argument such as alpha= or p=, a size); Dynamo traces again "
                        "with its value as a constant, so each new value compiles anew (the "
                        "recompile decisions name it: `self.p == 0.1`). Fix: if it does not "
                        "change, leave it (one compile); else pass it as a 0-d tensor where the "
                        "op takes one, and for an optimizer whose lr a scheduler changes "
                        "(SGD's alpha=lr), give the optimizer a tensor: lr=torch.tensor(0.01). "
                        "OneCycleLR and CyclicLR write Adam's betas[0] (the momentum) as a new "
                        "float at every step, tensors or not: pass cycle_momentum=False.")
        raise
    gm.recompile()


# Note [New values that are views]
# A gapped input the function writes through a view of it (``x.unsqueeze(0).add_(1)``) gets as
# its new value a view of the functional result (``squeeze(add)``), and a view the function
# returns of it (``x[0]``) is a view of that same result: its base is ``add``, not the new
# value, so its view ops could not be replayed on the caller's input (Note [Views of inputs
# with gaps]) and the call was refused, after the input had been written. The new value of
# such an input is detached where the graph makes it: the same memory, but a tensor of its own,
# which every later view (the returned one included) is taken from.
def detach_new_values(gm: fx.GraphModule, new_values: list[int], replayed: set[int]) -> None:
    """Make the graph's new value of each input in ``replayed`` (inputs whose returned views
    are replayed) a tensor of its own where it is a view; ``new_values``: the inputs whose new
    values lead the graph's outputs, in order. See Note [New values that are views]."""
    outs = gm.graph.output_node().args[0]
    views = {outs[k] for k, i in enumerate(new_values) if i in replayed
             if isinstance(outs[k], fx.Node) and outs[k].op == "call_function"
             and isinstance(outs[k].target, torch._ops.OpOverload) and outs[k].target.is_view}
    for node in views:
        with gm.graph.inserting_after(node):
            detached = gm.graph.call_function(torch.ops.aten.detach.default, (node,))
        detached.meta = dict(node.meta)
        node.replace_all_uses_with(detached, delete_user_cb=functools.partial(operator.is_not, detached))
    if views:
        gm.recompile()


# Note [Gradients backward does not bring]
# A backward from some outputs only runs the backward graph with zeros for the others'
# gradients (Note [Outputs backward does not reach] in aotkit.aot.runtime). Eager never runs
# the formulas behind those outputs, and a zero is not nothing there: where a derivative on
# their path is infinite (``sqrt`` or ``log`` at 0, ``x / y`` at ``y = 0``: a logged pairwise
# distance's zero diagonal), 0 * inf made the used outputs' gradients NaN. So for each set of
# missing gradients the backward graph is compiled again (once, on first use; up to
# ``recompile_limit`` sets) with those gradients left out: a value computed from them alone is
# absent, an op linear in such a value (a product, a quotient's numerator, a matrix product, a
# view, a sum, a pointwise formula's incoming gradient; decomposed for Inductor, a scatter of it
# into zeros or a ``where`` between it and zeros) is absent too, and a sum of a present and an
# absent value is the present one (a copy in the sum's layout and dtype where the present one
# is not a fresh value only the sum reads: a gradient is never an input's memory). Any other
# op computes as before, from the zeros still passed. Which inputs then get None is read off
# the variant (``tangent_masks``).
#
# Note [Custom backwards run on zeros]
# A custom autograd.Function's backward is not a formula of PyTorch's: eager runs it when any of
# its outputs gets a gradient, on zeros for the others (materialized), and not at all when none
# does. The trace tags the ops each run of one recorded (``custom_backward``, between the hooks
# the engine calls around it; a node may run twice, inside another's ``autograd.grad`` too)
# with the tangents whose presence makes its incoming gradients ones eager computes: those
# they depend on, those that make the custom backward that made them run, or all (``ALWAYS``)
# where one is made from no tangent (a synthetic loss's gradient, Inductor's zeros for
# ``round``). A run inside another custom backward runs whenever that one does; one given only
# None (the Function after it sends none) whenever a node after it runs, as eager's engine
# runs every node it reaches (on zeros). The variant follows eager: a custom backward none of
# those tangents reaches is absent whole (a synthetic gradient it makes too); one they reach
# computes everything it does, on zeros for the absent values it reads (``ga + 1`` is 1,
# ``x + gb`` is x, ``gb / x`` NaN where x is 0, as in eager), and what it makes is never None;
# one given None for them (``set_materialize_grads(False)``) is a formula where it runs. An op
# that computes reads zeros in place of an absent value (one made by an absent custom backward
# is no zero: ``g * 2 + 0.5``; ``0 / 0`` in another is NaN), laid out as traced. Past the
# variants' limit the whole graph runs on zeros, and which gradients are None follows the
# same rule (``tangent_masks``), except custom backwards eager skips: the variant without
# just the tangents that make them run (on zeros for the other missing ones) leaves them
# out, until twice the limit of variants in all.
_aten, _prims = torch.ops.aten, torch.ops.prims
#: Absent when any tensor argument is: products.
_ABSENT_IF_ANY = frozenset([_aten.mul.Tensor, _aten.mm.default, _aten.bmm.default,
                            _aten.matmul.default, _aten.mv.default, _aten.dot.default])
#: Absent when the first argument (the incoming gradient, or the numerator) is.
_ABSENT_IF_FIRST = frozenset([
    _aten.div.Tensor, _aten.div.Scalar, _aten.mul.Scalar, _aten.neg.default,
    _aten.clone.default, _aten._to_copy.default, _aten.sum.dim_IntList, _aten.sum.default,
    _aten.mean.dim, _aten.threshold_backward.default, _aten.tanh_backward.default,
    _aten.sigmoid_backward.default, _aten.gelu_backward.default, _aten.silu_backward.default,
    _aten._softmax_backward_data.default, _aten._log_softmax_backward_data.default,
    _aten.slice_backward.default, _aten.select_backward.default, _aten.expand.default,
    _aten.sum_to_size.default])
_SUMS = frozenset([_aten.add.Tensor, _aten.sub.Tensor])
#: Absent when the source is and the base is zeros (a slice's backward, decomposed for
#: Inductor: ``slice_scatter(full(0), grad)``).
_SCATTERS = frozenset([_aten.slice_scatter.default, _aten.select_scatter.default,
                       _aten.diagonal_scatter.default])
#: Zeros made from nothing: the other branch of a decomposed pointwise backward's ``where``.
_ZEROS = frozenset([_aten.zeros.default, _aten.new_zeros.default, _aten.zeros_like.default])
ABSENT, FROM_ZEROS = "aotkit_absent", "aotkit_from_zeros"  # node meta keys the variant sets


def _nothing(arg: Any, absent: set[fx.Node]) -> bool:
    """An absent value, or zeros made from nothing (``full(..., 0)``, ``scalar_tensor(0)``)."""
    if not isinstance(arg, fx.Node):
        return False
    return arg in absent or arg.target in _ZEROS or (
        arg.target is _aten.full.default and arg.args[1] == 0) or (
        arg.target is _aten.scalar_tensor.default and arg.args[0] == 0)


def _absent(node: fx.Node, absent: set[fx.Node]) -> bool:
    """Whether built-in formula ``node`` is linear in the absent values it reads."""
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    return node.op == "call_function" and (
        (node.target in _ABSENT_IF_ANY) or (tensors and tensors[0] in absent and (
            node.target in _ABSENT_IF_FIRST or _is_view(node)))
        or (node.target in _SUMS and len(node.args) == 2
            and all(t in absent for t in node.args))  # absent + zeros: zeros (a gradient)
        or (node.target in _SCATTERS and len(tensors) >= 2 and tensors[1] in absent
            and _nothing(node.args[0], absent))
        or (node.target is _aten.where.self
            and all(_nothing(a, absent) for a in node.args[1:3])))


def without_gradients(gm: fx.GraphModule, missing: list[int], num_tangents: int) -> fx.GraphModule:
    """A copy of backward graph ``gm``, whose last ``num_tangents`` placeholders are the
    tangents, with those at placeholder positions ``missing`` left out (Note [Gradients
    backward does not bring]).

    Example::

        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> from aotkit.aot.simplify import without_gradients
        >>> gm = make_fx(lambda x, ga, gb: ga * x.cos() + gb / x)(*torch.zeros(3, 3))
        >>> without_gradients(gm, [2], 2)(torch.zeros(3), torch.ones(3), torch.zeros(3))
        tensor([1., 1., 1.])
    """
    gm = copy_graph_module(gm)  # with its meta: a dump's index, a compiler's notes
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    absent = {placeholders[k] for k in missing}
    reach = set(absent)  # what the missing tangents reach, before any node reads zeros instead
    for node in gm.graph.nodes:
        if reach.intersection(node.all_input_nodes):
            reach.add(node)
    first = len(placeholders) - num_tangents
    present = sum(1 << k for k in range(num_tangents) if first + k not in missing)
    skipped: set[fx.Node] = set()  # absent values that are no zeros: a skipped custom's
    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            continue
        inputs = node.all_input_nodes
        custom = node.meta.get("custom_backward")  # Note [Custom backwards run on zeros]
        if runs_on_zeros(node, present):
            _on_zeros(node, absent)
        elif (custom is not None and not custom & present) or (
                absent.intersection(inputs) and _absent(node, absent)):  # or a formula
            absent.add(node)
            if custom is not None or skipped.intersection(inputs):
                skipped.add(node)
        elif absent.intersection(inputs) and node.target in _SUMS:
            _sum_of_present(node, absent)
        if node not in absent and absent.intersection(node.all_input_nodes):
            _read_zeros(node, absent, absent, skipped)  # what eager never computes
    for node in absent:
        node.meta[ABSENT] = True
    # What eager never computes goes, effects included (a draw, a check). The effects FX does
    # not know (linalg's error check, an assert without message) also go where a missing
    # gradient reaches them: eager gives its formulas, and backwards that take None, no
    # gradient there, and a trace under Dynamo cannot tell those from a backward eager runs on
    # zeros. Kept, such a check ran on the zeros passed for the missing gradient and raised
    # where eager does not.
    def kept(n: fx.Node) -> bool:
        if n.op != "call_function":
            return n.is_impure()
        return n not in absent and (n.is_impure() or (is_impure(n) and n not in reach))

    gm.graph.eliminate_dead_code(is_impure_node=kept)
    gm.recompile()
    return gm


def runs_on_zeros(node: fx.Node, present: int) -> bool:
    """Whether ``node`` is an op of a custom backward that eager runs when only the tangents of
    bit mask ``present`` come, on zeros for the others (Note [Custom backwards run on zeros]):
    not one given None for them (``set_materialize_grads(False)``), which is a formula."""
    custom = node.meta.get("custom_backward")
    return custom is not None and bool(custom & present) and not node.meta.get("custom_formula")


def _on_zeros(node: fx.Node, absent: set[fx.Node]) -> None:
    """Make custom backward op ``node`` read zeros for the absent values it reads, as eager's
    materialized ones (the missing tangents are passed as zeros already)."""
    _read_zeros(node, absent)
    node.meta[FROM_ZEROS] = True  # a value eager computes (Note [Custom backwards run on zeros])


def _read_zeros(node: fx.Node, values: set[fx.Node], absent: set[fx.Node] | None = None,
                skipped: set[fx.Node] | frozenset[fx.Node] = frozenset()) -> None:
    """Make ``node`` read zeros for the ``values`` it reads but placeholders (the missing
    tangents, passed as zeros), marked made from zeros; with ``absent`` (a formula reading
    values eager never computes: ``0 / 0`` in one made NaN of the rest), marked absent and
    laid out as traced, which a value of symbolic sizes that is not contiguous cannot be
    without a guard: that one is read as before, unless a ``skipped`` custom backward made it
    (``g * 2 + 0.5`` on zeros is no zero)."""
    kind = FROM_ZEROS if absent is None else ABSENT
    for value in [a for a in node.all_input_nodes if a in values]:
        if value.op != "placeholder" and isinstance(val := value.meta.get("val"), torch.Tensor):
            laid_out = absent is not None and not known_equal(
                val.stride(), make_contiguous_strides_for(val.shape))
            static = not free_symbols((val.shape, val.stride()))
            if laid_out and not static and value not in skipped:
                continue
            with node.graph.inserting_before(node):
                zeros = _zeros(node.graph, value, val, kind, laid_out and static)
            node.replace_input_with(value, zeros)
            if absent is not None:
                absent.add(zeros)


def _zeros(graph: fx.Graph, value: fx.Node, val: torch.Tensor, kind: str,
           strided: bool) -> fx.Node:
    """Zeros of ``value``'s traced sizes, contiguous or with its (static) strides (full:
    lowered by Inductor too, unlike zeros_like)."""
    options = {"dtype": val.dtype, "device": val.device}
    if strided:
        extent = 1 + sum((n - 1) * st for n, st in zip(val.shape, val.stride(), strict=True))
        flat = graph.call_function(_aten.full.default, ([extent if val.numel() else 0], 0), options)
        flat.meta.update(val=val.new_zeros(flat.args[0][0]), **{kind: True})
        zeros = graph.call_function(_aten.as_strided.default, (flat, list(val.shape),
                                                               list(val.stride())))
        zeros.meta.update(val=val.new_zeros(flat.args[0][0]).as_strided(
            val.shape, val.stride()), **{kind: True})
        return zeros
    sizes = [graph.call_function(_aten.sym_size.int, (value, d))
             if isinstance(n, torch.SymInt) else n for d, n in enumerate(val.shape)]
    for d, size in enumerate(sizes):
        if isinstance(size, fx.Node):
            size.meta.update(val=val.shape[d], **{kind: True})
    zeros = graph.call_function(_aten.full.default, (sizes, 0), options)
    zeros.meta.update(val=val.new_zeros(val.shape), **{kind: True})
    return zeros


def _sum_of_present(node: fx.Node, absent: set[fx.Node]) -> None:
    """Replace ``node``, a sum of a present value and an absent one, by the present one as the
    sum would have made it; left to compute where that cannot be made without a shape guard."""
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if len(tensors) != 2 or (tensors[0] in absent) == (tensors[1] in absent) or (
            tensors[0] in absent and (node.target is not _aten.add.Tensor
                                      or node.kwargs.get("alpha", 1) != 1)):
        return  # ``-gb + x`` or ``gb + 2 * x``: computed
    present = tensors[1] if tensors[0] in absent else tensors[0]
    value = _as_made_by(node, present)
    if value is not None:
        node.replace_all_uses_with(value)


def _as_made_by(node: fx.Node, present: fx.Node) -> fx.Node | None:
    """``present`` with ``node``'s sizes, strides and dtype, a value of its own: ``present``
    itself where it is one only ``node`` reads, else a copy (None: not known without a guard)."""
    out, val = node.meta.get("val"), present.meta.get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor)):
        return None
    fresh = present.op == "call_function" and not _is_view(present) and len(present.users) == 1
    if fresh and _same_meta(present, node):
        return present
    same_shape = known_equal(out.shape, val.shape)
    graph = node.graph
    with graph.inserting_before(node):  # ops Inductor lowers: the graph may be decomposed
        if same_shape and known_equal(out.stride(), val.stride()):  # preserve_format keeps them
            copy = graph.call_function(_aten.clone.default, (present,))
        elif same_shape and known_equal(out.stride(), make_contiguous_strides_for(out.shape)):
            copy = graph.call_function(_aten.clone.default, (present,), {
                "memory_format": torch.contiguous_format})
        elif not free_symbols((out.shape, out.stride())):
            empty = graph.call_function(_aten.empty_strided.default, (
                list(out.shape), list(out.stride())), {"dtype": out.dtype, "device": out.device})
            empty.meta["val"] = out
            copy = graph.call_function(_aten.copy.default, (empty, present))
        else:
            return None
        if val.dtype != out.dtype and copy.target is _aten.clone.default:
            copy.meta["val"] = out.to(val.dtype)
            copy = graph.call_function(_prims.convert_element_type.default, (copy, out.dtype))
    copy.meta["val"] = out
    return copy


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) \
        and va.dtype == vb.dtype and known_equal(va.shape, vb.shape) \
        and known_equal(va.stride(), vb.stride())


def tangent_masks(gm: fx.GraphModule, num_tangents: int, zeros: int = 0) -> list[int]:
    """Per output of backward graph ``gm``, whose last ``num_tangents`` placeholders are the
    tangents, a bit mask of the tangents it depends on. In a variant without some tangents
    (Note [Custom backwards run on zeros]), or in the whole graph run on zeros for the tangents
    of bit mask ``zeros``, what a custom backward made from their zeros (``gb + 1``) depends on
    its other values only, and an absent value on all of them."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    masks: dict[fx.Node, int] = {
        node: 1 << k for k, node in enumerate(placeholders[len(placeholders) - num_tangents:])}
    missing = sum(mask for node, mask in masks.items() if node.meta.get(ABSENT))
    computed = 1 << num_tangents  # by a custom backward eager runs: never None
    present = (computed - 1) & ~zeros
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            made = node.meta.get(FROM_ZEROS) or (zeros and runs_on_zeros(node, present))
            mask = missing if node.meta.get(ABSENT) else computed if made else 0
            for arg in node.all_input_nodes:
                if not (made and arg.meta.get(ABSENT)):
                    mask |= masks.get(arg, 0)
            masks[node] = mask
    return [masks.get(g, 0) if isinstance(g, fx.Node) else 0
            for g in gm.graph.output_node().args[0]]
