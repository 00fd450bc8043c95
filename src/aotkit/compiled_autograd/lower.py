"""Lowering a captured backward to ATen: the formulas' own ops instead of opaque formula calls.

Note [Lowering captured backwards]
A captured graph calls each C++ backward formula (``AddmmBackward0``) and the engine's
``validate_outputs`` as opaque functions: correct for any sizes, but each call costs ~10 us of
argument conversion, and no compiler can see into it. Lowering runs the captured graph once on
fake tensors of one backward's real inputs and records what each formula does as ATen ops
(``mm``, ``t``, ``sum``). Calls with effects stay calls (hooks, custom Function backwards,
``.grad`` accumulation), and so does every formula fed by one of them: a hook may return a
gradient of other strides than the one it received, and a formula traced on the wrong strides
would bake in the wrong view/copy decisions.

The fakes have static sizes: tracing on symbolic ones took seconds per capture in sympy (a
Transformer layer's ~250 distinct sizes), and its guards, one per size, cost more per replay
than lowering saved. So a lowered graph holds for the exact sizes, strides, dtypes and devices of
its inputs and the exact ``sizes``/``scalars`` lists it was traced with; a ``SizeGuard`` checks
them on every replay (the engine replays its cached graph for any sizes). Values it rejects run
the captured graph under ``enable(dynamic=True)``, which is meant to serve every size with one
graph (a fallback, recorded once), or get a graph lowered for them under ``dynamic=False`` (a
recompile, recorded), up to ``aotkit.config.recompile_limit``.

A gradient that only ``.grad`` accumulation reads, made by an ATen op that writes nothing, may
become ``.grad`` without a copy when ``.grad`` is empty, as eager's AccumulateGrad steals a
gradient no one else holds (see ``runtime.call_accumulate_grad``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from aotkit.compiled_autograd import passes, runtime
from aotkit.compiled_autograd.builder import GraphBuilder


@dataclass
class Example:
    """The values one backward ran with: what a lowered graph is traced on and guarded by."""

    inputs: list[Any]
    sizes: list[Any]
    scalars: list[Any]


class SizeGuard:
    """The inputs' sizes, strides, dtypes and devices, and the ``sizes`` and ``scalars`` lists, a
    lowered graph was traced with; checked on every replay as six list comparisons (no sympy)."""

    def __init__(self, example: Example) -> None:
        self.expected: dict[str, Any] = {"sizes": list(example.sizes),
                                         "scalars": list(example.scalars)}
        for what, read in (("shape", lambda x: x.shape), ("stride()", lambda x: x.stride()),
                           ("dtype", lambda x: x.dtype), ("device", lambda x: x.device)):
            self.expected[what] = [read(x) for x in example.inputs]
        want = self.expected
        sizes, scalars = want["sizes"], want["scalars"]
        shapes, strides, dtypes, devices = (want[k] for k in ("shape", "stride()", "dtype", "device"))

        def accepts(inputs: list[Any], got_sizes: list[Any], got_scalars: list[Any]) -> bool:
            return (got_sizes == sizes and got_scalars == scalars
                    and [x.shape for x in inputs] == shapes
                    and [x.stride() for x in inputs] == strides
                    and [x.dtype for x in inputs] == dtypes
                    and [x.device for x in inputs] == devices)

        self._accepts = accepts

    def accepts(self, example: Example) -> bool:
        return bool(self._accepts(example.inputs, example.sizes, example.scalars))

    def why_not(self, example: Example) -> str:
        """What differs from the values the graph was lowered for, e.g. ``inputs[1].shape is
        (6, 8), lowered for (4, 8)``."""
        for key, want in self.expected.items():
            if key in ("sizes", "scalars"):
                got = getattr(example, key)
            else:
                got = [eval(f"x.{key}", {}, {"x": x}) for x in example.inputs]
            if got == want:
                continue
            name = key if key in ("sizes", "scalars") else "inputs"
            if len(got) != len(want):
                return f"{name} has {len(got)} values, lowered for {len(want)}"
            k = next(k for k, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
            where = f"{name}[{k}]" if name != "inputs" else f"inputs[{k}].{key}"
            return f"{where} is {_show(got[k])}, lowered for {_show(want[k])}"
        return "its values differ from those it was lowered for"


def _show(value: Any) -> Any:
    return tuple(value) if isinstance(value, torch.Size) else value


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


#: Python-level calls of the captured graph that are plain tensor code, safe to trace.
_TRACEABLE = frozenset({torch.add, runtime.copy_slices_prologue, runtime.copy_slices_epilogue})


def _traceable(target: Any) -> bool:
    if isinstance(target, runtime.Op):
        return target.is_traceable and not target.is_custom_function
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
        with self.stack, self.fake_mode, self.proxy_mode:
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
        _mark_stealable(graph)
        return fx.GraphModule(self.tracer.root, graph, captured.__class__.__name__ + "Lowered")

    def _call(self, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        target = node.target
        if target is operator.getitem and not isinstance(args[0], _Opaque):
            return args[0][args[1]]
        if _traceable(target) and not _any_opaque((args, kwargs)):
            fn = target.fn if isinstance(target, runtime.Op) else target
            return fn(*args, **kwargs)
        proxy = self.tracer.create_proxy("call_function", target, self.to_proxy(args),
                                         self.to_proxy(kwargs))
        proxy.node.meta.update((k, node.meta[k]) for k in ("autograd_node", "nodecall")
                               if k in node.meta)
        return _Opaque(proxy)


def _any_opaque(tree: Any) -> bool:
    if isinstance(tree, _Opaque):
        return True
    if isinstance(tree, (list, tuple)):
        return any(_any_opaque(x) for x in tree)
    if isinstance(tree, dict):
        return any(_any_opaque(x) for x in tree.values())
    return False


def lower(captured: fx.GraphModule, example: Example) -> Lowered:
    """Lower ``captured`` for values like ``example``. See Note [Lowering captured backwards]."""
    return Lowered(_Lowering(example).run(captured), SizeGuard(example))


# ---- stealing gradients into .grad ----------------------------------------------------------


def _mark_stealable(graph: fx.Graph) -> None:
    """Let accumulation take a gradient only it reads, fresh from a non-writing ATen op and in
    ``.grad``'s layout, without a copy. See Note [Lowering captured backwards]."""
    for acc in graph.find_nodes(op="call_function", target=runtime.call_accumulate_grad):
        variable, grad = acc.args[0], acc.args[1]
        if (isinstance(grad, fx.Node) and len(grad.users) == 1
                and isinstance(grad.target, torch._ops.OpOverload)
                and not grad.target._schema.is_mutable
                and isinstance(variable, fx.Node)
                and _obeys_layout(grad.meta.get("val"), variable.meta.get("val"))):
            acc.update_kwarg("stealable", True)


def _surely(condition: Any) -> bool:
    return statically_known_true(condition)


def _obeys_layout(grad: Any, variable: Any) -> bool:
    """Whether ``grad`` surely has the strides eager's gradient layout contract asks of a
    gradient of ``variable`` (a contiguous variable: its strides, ignoring size-1 dims that
    are not broadcast)."""
    if not (isinstance(grad, torch.Tensor) and isinstance(variable, torch.Tensor)):
        return False
    if grad.layout != torch.strided or variable.layout != torch.strided:
        return False
    if grad.dim() != variable.dim() or not _surely_contiguous(variable):
        return False
    for size, g, v in zip(grad.shape, grad.stride(), variable.stride(), strict=True):
        if _surely(size == 1):
            if not _surely(g != 0):
                return False
        elif not _surely(g == v):
            return False
    return True


def _surely_contiguous(x: torch.Tensor) -> bool:
    expected: Any = 1
    for size, stride in zip(reversed(x.shape), reversed(x.stride()), strict=True):
        if not (_surely(size == 1) or _surely(stride == expected)):
            return False
        expected = expected * size
    return True

