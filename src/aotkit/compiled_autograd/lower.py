"""Lowering a captured backward to ATen: the formulas' own ops instead of opaque formula calls.

Note [Lowering captured backwards]
A captured graph calls each C++ backward formula (``AddmmBackward0``) and the engine's
``validate_outputs`` as opaque functions: correct for any sizes, but each call costs ~10 us of
argument conversion, and no compiler can see into it. Lowering runs the captured graph once on
fake tensors of one backward's real inputs and records what each formula does as ATen ops
(``mm``, ``t``, ``sum``). Calls with effects stay calls (hooks, custom Function backwards,
``.grad`` accumulation), and so does every formula fed by one of them: a hook may return a
gradient of other strides than the one it received, and a formula traced on the wrong strides
would bake in the wrong view/copy decisions. So do the few formulas whose traced ops round
differently from eager's kernel (``_EAGER_PATH_FORMULAS``), and the formulas they feed.

The fakes have static sizes: tracing on symbolic ones took seconds per capture in sympy (a
Transformer layer's ~250 distinct sizes), and its guards, one per size, cost more per replay
than lowering saved. So a lowered graph holds for the exact sizes, strides, dtypes, devices,
requires_grad and dispatch keys of its inputs and the exact ``sizes``/``scalars`` lists it was
traced with; a ``SizeGuard`` checks them on every replay, the inputs with one C++ check (the
engine replays its cached graph for any sizes). Dispatch keys include the thread's autocast
state: a backward run under ``torch.autocast`` records the casts autocast makes, and must not
replay outside it (nor one lowered outside replay inside). Values it rejects run the captured
graph under
``enable(dynamic=True)``, which is meant to serve every size with one graph (a fallback,
recorded once), or get a graph lowered for them under ``dynamic=False`` (a recompile,
recorded), up to ``aotkit.config.recompile_limit``.

A gradient that only ``.grad`` accumulation reads, made by an ATen op that writes nothing (or
an output of one that returns several), may become ``.grad`` without a copy when ``.grad`` is
empty, as eager's AccumulateGrad steals a gradient no one else holds (see
``runtime.call_accumulate_grad``).

View chains that end where they started (the ``t(t(mm))`` of a Linear weight's gradient, its
formula's transpose undone by ``TBackward0``) are dropped as in AOT graphs (Note [Views that
undo themselves] in ``aotkit.aot.simplify``): eager pays for them in C++, a graph run from
Python ~1 us per call.

Gradients summed for a tensor that several nodes use (the engine's input buffers, captured as
``runtime.add_gradients``, traced as ``aten.add``) are summed in place when one addend is owned
by the sum: made by a traced ATen op, read by nothing else, sharing its memory with no other
value of the graph (the fake values show which share memory), and laid out as the sum would
be. Eager's input buffers do the same; an out-of-place sum allocates a gradient-sized tensor
each time.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from aotkit import compat
from aotkit.aot.ops import EagerLayouts
from aotkit.aot.signature import AUTOCAST_DEVICES, AutocastState, autocast_state
from aotkit.aot.simplify import drop_noop_views
from aotkit.aot.trace import quiet_fake_failures
from aotkit.compiled_autograd import passes, runtime
from aotkit.compiled_autograd.builder import GraphBuilder


@dataclass
class Example:
    """The values one backward ran with: what a lowered graph is traced on and guarded by."""

    inputs: list[Any]
    sizes: list[Any]
    scalars: list[Any]


def changed_value(example: Example, before: Example, made: str = "lowered") -> str | None:
    """The first of ``example``'s sizes and scalars that differs from ``before``'s, e.g.
    ``sizes[0] is 24, lowered for 20``; None when they are equal."""
    for name, got, want in (("sizes", example.sizes, before.sizes),
                            ("scalars", example.scalars, before.scalars)):
        if len(got) != len(want):
            return f"{name} has {len(got)} values, {made} for {len(want)}"
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                return f"{name}[{k}] is {g}, {made} for {w}"
    return None


class SizeGuard:
    """The inputs' sizes, strides, dtypes, devices, requires_grad and dispatch keys, the
    ``sizes`` and ``scalars`` lists, and the dtype autocast casts to on each device (the
    dispatch keys say only whether it is on), a lowered graph was traced with; checked on every
    replay by three tuple or list comparisons and one C++ check of the inputs (no sympy, ~3 us
    for 34 inputs)."""

    def __init__(self, example: Example) -> None:
        self.sizes, self.scalars = list(example.sizes), list(example.scalars)
        self.num_inputs = len(example.inputs)
        self.inputs = compat.tensor_layout_check(example.inputs)
        self.autocast = autocast_state()

    def accepts(self, example: Example) -> bool:
        return (example.sizes == self.sizes and example.scalars == self.scalars
                and len(example.inputs) == self.num_inputs and autocast_state() == self.autocast
                and self.inputs.check(*example.inputs))

    def why_not(self, example: Example) -> str:
        """What differs from the values the graph was lowered for, e.g. ``sizes[0] is 24,
        lowered for 20`` or ``tensor 'inputs[3]' size mismatch at index 2. expected 64, actual
        65``."""
        if (why := changed_value(example, Example([], self.sizes, self.scalars))) is not None:
            return why
        if len(example.inputs) != self.num_inputs:
            return f"inputs has {len(example.inputs)} values, lowered for {self.num_inputs}"
        if (now := autocast_state()) != self.autocast:
            return (f"autocast is {_autocast_text(now)}, lowered with autocast "
                    f"{_autocast_text(self.autocast)}")
        names = [f"inputs[{k}]" for k in range(self.num_inputs)]
        verdict = self.inputs.check_verbose(*example.inputs, tensor_check_names=names)
        return "its values differ from those it was lowered for" if verdict is True else verdict


def _autocast_text(state: AutocastState) -> str:
    """``bfloat16 on cpu``, or ``off``."""
    on = [f"{str(dtype).removeprefix('torch.')} on {device}"
          for device, dtype in zip(AUTOCAST_DEVICES, state, strict=True) if dtype]
    return ", ".join(on) or "off"


@dataclass
class Lowered:
    """A captured graph lowered to ATen, and the values its guard lets it run with."""

    gm: fx.GraphModule
    guard: SizeGuard


class _Opaque:
    """A value lowering cannot see into: only its graph value is known."""

    __slots__ = ("proxy",)

    def __init__(self, proxy: fx.Proxy) -> None:
        self.proxy = proxy


#: Formulas whose traced ops round differently from the kernel eager runs, found by
#: ``scripts/opinfo_sweep.py --compiled-autograd``; they stay calls. Most take another path for
#: traced tensors (which they must treat as tensor subclasses): ``prod``'s gradient through
#: cumulative products instead of ``result / input``, ``masked_fill``'s value gradient through
#: ``where`` instead of ``masked_select``, ``cumprod``'s on torch < 2.13, a whole-tensor
#: ``max``/``min``/``median``'s through a mask multiplied by the gradient instead of zeros
#: filled with it (NaN everywhere for an infinite gradient: Note [Gradients of a selected
#: element]), ``ormqr``'s laid out row-major; the gradient of
#: ``torch.sparse.mm(..., reduce)`` traces to other ops than its fused kernel.
_EAGER_PATH_FORMULAS = frozenset({
    "ProdBackward0", "ProdBackward1", "MaskedFillBackward1", "CumprodBackward0",
    "SparseMmReduceImplBackward0", "MaxBackward1", "MinBackward1", "MedianBackward0",
    "NanmedianBackward0", "OrmqrBackward0",
})

#: Python-level calls of the captured graph that are plain tensor code, safe to trace.
_TRACEABLE = frozenset({runtime.add_gradients, runtime.copy_slices_prologue,
                        runtime.copy_slices_epilogue})


def _traceable(target: Any) -> bool:
    if isinstance(target, runtime.Op):
        return (target.is_traceable and not target.is_custom_function
                and target.__name__ not in _EAGER_PATH_FORMULAS)
    return target in _TRACEABLE


class _Lowering(GraphBuilder):
    def __init__(self, example: Example) -> None:
        super().__init__(static=True)
        inputs_p, _, _, hooks_p, packed_p = self.start_graph()
        inputs = [self.fake(x, i) for i, x in enumerate(example.inputs)]
        self.bind(inputs, inputs_p)
        # Sizes and scalars become constants of the graph; the guard checks them.
        self.placeholders = {"inputs": inputs, "sizes": example.sizes, "scalars": example.scalars,
                             "hooks": _Opaque(hooks_p), "packed_data": _Opaque(packed_p)}

    def to_proxy(self, value: Any) -> Any:
        if isinstance(value, _Opaque):
            return value.proxy
        return super().to_proxy(value)

    def run(self, captured: fx.GraphModule) -> fx.GraphModule:
        env: dict[fx.Node, Any] = {}
        with self.stack, quiet_fake_failures(), self.fake_mode, self.proxy_mode, EagerLayouts():
            for node in captured.graph.nodes:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                if node.op == "placeholder":
                    env[node] = self.placeholders[node.target]
                elif node.op == "output":
                    self.tracer.create_node("output", "output",
                                            (self.tracer.create_arg(self.to_proxy(args[0])),), {})
                else:
                    self.origin = node.meta.get("autograd_node", "")
                    env[node] = self._call(node, args, kwargs)
        graph = self.tracer.graph
        passes.eliminate_dead_code(graph)
        gm = fx.GraphModule(self.tracer.root, graph, captured.__class__.__name__ + "Lowered")
        drop_noop_views(gm)
        _sum_in_place(graph)
        _mark_stealable(graph)
        gm.recompile()
        return gm

    def _call(self, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        target = node.target
        if target is operator.getitem and not isinstance(args[0], _Opaque):
            return args[0][args[1]]
        if _traceable(target) and not pytree.tree_any(_is_opaque, (args, kwargs)):
            fn = target.fn if isinstance(target, runtime.Op) else target
            return fn(*args, **kwargs)
        proxy = self.tracer.create_proxy("call_function", target, self.to_proxy(args),
                                         self.to_proxy(kwargs))
        proxy.node.meta.update((k, node.meta[k]) for k in ("autograd_node", "nodecall")
                               if k in node.meta)
        return _Opaque(proxy)


def _is_opaque(value: Any) -> bool:
    return isinstance(value, _Opaque)


def lower(captured: fx.GraphModule, example: Example) -> Lowered:
    """Lower ``captured`` for values like ``example``. See Note [Lowering captured backwards]."""
    return Lowered(_Lowering(example).run(captured), SizeGuard(example))


# ---- gradient sums in place, stealing gradients into .grad -----------------------------------

_ADD, _ADD_ = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor


def _made_by_traced_op(node: fx.Node) -> bool:
    """``node`` is the result of an ATen op that writes nothing, or one output of such an op
    (not an input of the graph, not what an opaque call returned)."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.is_mutable


def _sum_in_place(graph: fx.Graph) -> None:
    """``add(a, b)`` -> ``add_(a, b)`` where the sum owns ``a`` (or ``b``).
    See Note [Lowering captured backwards]."""
    holders: dict[int, set[int]] = {}  # storage -> the tensor values that use it
    for node in graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, torch.Tensor):
                holders.setdefault(value.untyped_storage()._cdata, set()).add(id(value))

    def owned(addend: Any, total: torch.Tensor) -> bool:
        if not isinstance(addend, fx.Node) or len(addend.users) != 1:
            return False
        value = addend.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return False
        chain = _views_read_once(addend)
        root = chain[-1]
        return ((_made_by_traced_op(root) or root.meta.get("summed_in_place", False))
                and holders[value.untyped_storage()._cdata] == {id(n.meta["val"]) for n in chain}
                and (value.shape, value.stride(), value.dtype, value.device)
                == (total.shape, total.stride(), total.dtype, total.device))

    for node in graph.find_nodes(op="call_function", target=_ADD):
        total = node.meta.get("val")
        if node.kwargs or len(node.args) != 2 or not isinstance(total, torch.Tensor):
            continue
        a, b = node.args
        for into, other in ((a, b), (b, a)):
            if owned(into, total):
                node.target, node.args = _ADD_, (into, other)
                node.meta["summed_in_place"] = True  # owns into's memory, as into did
                break


def _views_read_once(node: fx.Node) -> list[fx.Node]:
    """``node``, then the value it views, and so on while that value feeds only the next view
    (``view(mm(...))``: [view, mm])."""
    chain = [node]
    while (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
           and isinstance(node.args[0], fx.Node) and len(node.args[0].users) == 1
           and isinstance(node.args[0].meta.get("val"), torch.Tensor)):
        node = node.args[0]
        chain.append(node)
    return chain


def _mark_stealable(graph: fx.Graph) -> None:
    """Let accumulation take a gradient only it reads, fresh from a non-writing ATen op (or
    summed in place) and in ``.grad``'s layout, without a copy. See Note [Lowering captured
    backwards]."""
    for acc in graph.find_nodes(op="call_function", target=runtime.call_accumulate_grad):
        variable, grad = acc.args[0], acc.args[1]
        if (isinstance(grad, fx.Node) and len(grad.users) == 1
                and (_made_by_traced_op(grad) or grad.meta.get("summed_in_place", False))
                and isinstance(variable, fx.Node)
                and _obeys_layout(grad.meta.get("val"), variable.meta.get("val"))):
            acc.update_kwarg("stealable", True)


def _obeys_layout(grad: Any, variable: Any) -> bool:
    """Whether ``grad`` has the strides eager's gradient layout contract asks of a gradient of
    ``variable`` (here, a contiguous variable: its strides, where a dim of size 1 may have any
    stride but 0)."""
    if not (isinstance(grad, torch.Tensor) and isinstance(variable, torch.Tensor)):
        return False
    if grad.layout != torch.strided or variable.layout != torch.strided:
        return False
    if grad.dim() != variable.dim() or not variable.is_contiguous():
        return False
    return all(g != 0 if size == 1 else g == v
               for size, g, v in zip(grad.shape, grad.stride(), variable.stride(), strict=True))
