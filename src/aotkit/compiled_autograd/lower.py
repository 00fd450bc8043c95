"""Lowering a captured backward to ATen: the formulas' own ops instead of opaque formula calls.

Note [Lowering captured backwards]
A captured graph calls each C++ backward formula (``AddmmBackward0``) and the engine's
``validate_outputs`` as opaque functions: correct for any sizes, but each call costs ~10 us of
argument conversion, and no compiler can see into it. Lowering runs the captured graph once on
fake tensors of the backward's real inputs, its sizes and scalars symbolic, and records what each
formula does as ATen ops (``mm``, ``t``, ``sum``). Calls with effects stay opaque (hooks, custom
Function backwards, ``.grad`` accumulation), and so does every formula fed by one of them: a
hook may return a gradient of other strides than the one it received, and a formula traced on the
wrong strides would bake in the wrong view/copy decisions.

Tracing on symbolic sizes still bakes in decisions (a broadcast summed away, sizes 0 and 1
specialized), which the ShapeEnv states as guards over the engine's lists. The engine replays
its cached graph for any sizes, so a lowered graph is only run for values that pass its guards;
others get a graph lowered for them (a recompile, recorded) and, past
``aotkit.config.recompile_limit``, the captured graph itself (a fallback, recorded).

A gradient that only ``.grad`` accumulation reads, made by an ATen op that writes nothing, may
become ``.grad`` without a copy when ``.grad`` is empty, as eager's AccumulateGrad steals a
gradient no one else holds (see ``runtime.call_accumulate_grad``).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._sympy.printers import PythonPrinter

from aotkit import compat
from aotkit.compiled_autograd import passes, runtime
from aotkit.compiled_autograd.builder import GraphBuilder
from aotkit.errors import TraceError


@dataclass
class Example:
    """The values one backward ran with: what a lowered graph is traced on and guarded by."""

    inputs: list[Any]
    sizes: list[Any]
    scalars: list[Any]


class SizeGuard:
    """The sizes, strides and values a lowered graph assumes, checked by one generated function.

    Each tensor input is compared whole with what the trace assumed (``inputs[3]`` has sizes
    ``(s0, s1)`` and strides ``(s1, 1)``), and ``sizes`` and ``scalars`` each as one list, every
    symbol read where it first appears; then the symbols' ranges and the ShapeEnv's guards that
    the ranges do not already imply. A replay's check is one comparison per tensor, a few
    microseconds, where one guard per size (``produce_guards``) took ~0.3 us each.
    """

    def __init__(self, shape_env: Any, example: Example, fakes: Example) -> None:
        printer = PythonPrinter()
        defined: dict[sympy.Symbol, str] = {}  # symbol -> where it is read, readable
        reads: list[str] = []
        self.checks: list[tuple[str, str]] = []  # (code, readable)

        def expected(read: str, readable: str, value: Any) -> str:
            expr = (shape_env.replace(value.node.expr)
                    if isinstance(value, (torch.SymInt, torch.SymFloat)) else sympy.sympify(value))
            if isinstance(expr, sympy.Symbol) and expr not in defined:
                defined[expr] = readable
                reads.append(f"{expr} = {read}")
            return printer.doprint(expr)

        for i, fake in enumerate(fakes.inputs):
            reads.append(f"z{i} = inputs[{i}].size(); d{i} = inputs[{i}].stride()")
            for what, got, dims in (("size", f"z{i}", fake.shape), ("stride", f"d{i}", fake.stride())):
                wants = [expected(f"{got}[{k}]", f"inputs[{i}].{what}()[{k}]", d)
                         for k, d in enumerate(dims)]
                want = f"({', '.join(wants)}{',' if len(wants) == 1 else ''})"
                self.checks.append((f"{got} == {want}", f"inputs[{i}].{what}() == {want}"))
        for name in ("sizes", "scalars"):
            wants = [expected(f"{name}[{k}]", f"{name}[{k}]", v)
                     for k, v in enumerate(getattr(fakes, name))]
            self.checks.append((f"{name} == [{', '.join(wants)}]", ""))
            self.checks.extend((f"{name}[{k}] == {w}", f"{name}[{k}] == {w}")
                               for k, w in enumerate(wants))  # readable; implied by the list
        finite = (sympy.Integer, sympy.Float)  # not the infinities of an open range
        for symbol in defined:
            bounds = shape_env.var_to_range.get(symbol)
            if bounds is not None and isinstance(bounds.lower, finite):
                self.checks.append((f"{bounds.lower} <= {symbol}",) * 2)
            if bounds is not None and isinstance(bounds.upper, finite):
                self.checks.append((f"{symbol} <= {bounds.upper}",) * 2)
        seen = set()
        for guard in shape_env.guards:
            expr = shape_env.simplify(guard.expr)
            if expr in seen or compat.implied_by_ranges(shape_env, expr):
                continue
            seen.add(expr)
            self.checks.append((printer.doprint(expr),) * 2)
        self.symbols = {str(k): v for k, v in defined.items()}
        body = "\n    ".join(reads) or "pass"
        fast = [c for c, readable in self.checks if not readable.startswith(("sizes[", "scalars["))]
        source = (f"def read(inputs, sizes, scalars):\n    {body}\n    return locals()\n"
                  f"def accepts(inputs, sizes, scalars):\n    {body}\n    return "
                  + " and ".join(f"({c})" for c in fast) + "\n")
        namespace = compat.guard_globals()
        exec(compile(source, "<aotkit compiled-autograd size guard>", "exec"), namespace)
        self._accepts, self._read = namespace["accepts"], namespace["read"]
        if not self.accepts(example):  # a guard this class cannot state faithfully
            raise TraceError("the lowered graph's size guard rejects the values it was lowered "
                             f"for ({self.why_not(example)})")

    def accepts(self, example: Example) -> bool:
        return bool(self._accepts(example.inputs, example.sizes, example.scalars))

    def why_not(self, example: Example) -> str:
        """The first assumption ``example`` breaks, readable: ``inputs[3].size() == (s0, 4) with
        s0 = inputs[1].size()[0] = 6``."""
        env = {**compat.guard_globals(),
               **self._read(example.inputs, example.sizes, example.scalars)}
        for code, readable in self.checks:
            if readable and not eval(code, env):
                where = ", ".join(f"{k} = {self.symbols[k]} = {env[k]}" for k in sorted(self.symbols)
                                  if re.search(rf"\b{k}\b", readable))
                return ("this backward breaks an assumption of its lowered graph: "
                        f"{readable}" + (f" with {where}" if where else ""))
        return "this backward fails the size guard of its lowered graph"


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
        super().__init__()
        inputs_p, sizes_p, scalars_p, hooks_p, packed_p = self.start_graph()
        self.stack.enter_context(enable_python_dispatcher())  # SymInts must not be hashed
        self.inputs = [self.fake(x, i) for i, x in enumerate(example.inputs)]
        self.bind(self.inputs, inputs_p)
        self.sizes = [self.symbol(v, "sizes", i, sizes_p) for i, v in enumerate(example.sizes)]
        self.scalars = [self.symbol(v, "scalars", i, scalars_p)
                        for i, v in enumerate(example.scalars)]
        self.placeholders = {"inputs": self.inputs, "sizes": self.sizes, "scalars": self.scalars,
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
    lowering = _Lowering(example)
    gm = lowering.run(captured)
    fakes = Example(lowering.inputs, lowering.sizes, lowering.scalars)
    return Lowered(gm, SizeGuard(lowering.shape_env, example, fakes))


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

