"""Run a graph's ATen calls through PyTorch's Python bindings when they dispatch the same call.

Note [Binding ATen calls]
~~~~~~~~~~~~~~~~~~~~~~~~~
A traced graph calls ATen overloads: ``torch.ops.aten.mm.default(a, b)``. From Python, an
``OpOverload`` call takes the boxed path: a Python ``__call__``, then pybind11 converting each
argument through the schema. ``torch.mm(a, b)`` reaches the same dispatcher entry through
PyTorch's generated argument parser, 1-1.5 us sooner per call on this project's CPU machine.
Eager PyTorch runs a backward's ops from C++; a graph running a small Transformer's backward op
by op from Python paid about a tenth of a training step for the boxed path alone.

So the compilers that run a graph as Python (``nop`` and the inspection compilers built on it)
call :func:`bind_aten_calls` first, which rewrites a call to its binding (a C function of
``torch``/``torch._C._nn``/..., or a ``Tensor`` method called as ``torch.Tensor.view(x, ...)``
so that no subclass override runs) only when the binding is shown to make
the very same dispatcher call: both are called once on stand-in arguments of the node's
argument types under a dispatch mode that stops at the first ATen call, and the two calls must
agree on overload and arguments. PyTorch's argument parser picks an overload from the
arguments' Python types alone, so the answer is cached per (overload, argument types).

Left as written: a binding that resolves to another overload (``torch.mul(x, 2.0)`` dispatches
``mul.Tensor``, not ``mul.Scalar``); bindings written in Python (``torch.split``); ops without a
binding (most ``*_backward`` ops); ops that mutate an argument; ops without a tensor argument or
with a ``device`` argument (factories, which the default device's ``TorchFunctionMode`` may
rewrite); nodes whose argument values were not traced.

A ``TorchFunctionMode`` active while a bound graph runs sees the binding (``torch.mm``) where it
saw the overload (``torch.ops.aten.mm.default``); a mode that changes what an op computes may
then act on a call it let through before. Such a mode can set
``aotkit.config.bind_aten_calls = False``.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import _get_qualified_name
from torch.utils._python_dispatch import TorchDispatchMode

from aotkit import config

log = logging.getLogger("aotkit.compilers")

_FUNCTION_NAMESPACES = (torch._C._VariableFunctions, torch._C._nn, torch._C._linalg,
                        torch._C._special, torch._C._fft)

Binding = Callable[..., Any]  # a C function or Tensor method: torch.mm, torch.Tensor.view


def bind_aten_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose ATen calls go through PyTorch's Python bindings where those dispatch
    exactly the traced call (Note [Binding ATen calls]); ``gm`` itself is not changed. With
    ``aotkit.config.bind_aten_calls`` off, ``gm`` is returned as it is. The copy is for running:
    FX cannot pickle a graph calling ``torch.Tensor`` methods, so serialize ``gm`` instead.

    Example::

        >>> import torch, torch.fx as fx
        >>> from aotkit.compilers.bind import bind_aten_calls
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(lambda a, b: (a @ b).sum(0) * 2.0)(torch.ones(2, 3), torch.ones(3, 4))
        >>> print(bind_aten_calls(gm).code.strip())  # doctest: +NORMALIZE_WHITESPACE
        def forward(self, a_1, b_1):
            mm = torch.mm(a_1, b_1);  a_1 = b_1 = None
            sum_1 = torch.sum(mm, [0]);  mm = None
            mul = torch.mul(sum_1, 2.0);  sum_1 = None
            return mul
    """
    if not config.bind_aten_calls:
        return gm
    graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    graph.set_codegen(gm.graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    kept: Counter[str] = Counter()
    with torch._C.DisableTorchFunction():  # a user's TorchFunctionMode must not see our checks
        for n in gm.graph.nodes:
            env[n] = graph.node_copy(n, env.__getitem__)
            binding = _binding_for(n)
            if binding is not None:
                env[n].target = binding
            elif isinstance(n.target, torch._ops.OpOverload):
                kept[str(n.target)] += 1
    if kept:
        log.debug("bind_aten_calls: kept as traced (no binding makes the same call): %s",
                  ", ".join(f"{op} x{count}" for op, count in sorted(kept.items())))
    return fx.GraphModule(gm, graph)


def _binding_for(n: fx.Node) -> Binding | None:
    """The binding to call instead of ``n``'s ATen overload, or None to keep the overload."""
    if n.op != "call_function" or not _bindable(n.target):
        return None
    if not any(isinstance(a.meta.get("val"), torch.Tensor) for a in n.all_input_nodes):
        return None
    returns = n.target._schema.returns
    if (len(returns) != 1 or isinstance(returns[0].type, torch.ListType)) and any(
            u.op != "call_function" or u.target is not operator.getitem for u in n.users):
        return None  # a binding returns a tuple or named tuple where the op returns a list/tuple
    kinds = _kinds((n.args, n.kwargs))
    if kinds is None:
        return None
    key = (n.target, kinds)
    if key not in _VERIFIED:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), _stand_in)
        _VERIFIED[key] = _verified_binding(n.target, args, kwargs)
    return _VERIFIED[key]


def _bindable(target: Any) -> bool:
    """An ATen overload that mutates nothing and takes no device (see the Note)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    schema = target._schema
    return not schema.is_mutable and all(a.name != "device" for a in schema.arguments)


# The type a node's value has when the graph runs, by its traced value: a tensor (of no dimension,
# since a 0-dim tensor may also pass for a number), or a Python number for a symbolic one.
_NUMBER_KINDS = (((torch.SymBool, bool), "bool"), ((torch.SymInt, int), "int"),
                 ((torch.SymFloat, float), "float"))
_STAND_INS: dict[str, Callable[[], Any]] = {
    "Tensor": lambda: torch.empty(0, device="meta"),
    "Tensor0": lambda: torch.empty((), device="meta"),
    "bool": lambda: True, "int": lambda: 1, "float": lambda: 1.0,
}


def _node_kind(n: fx.Node) -> str | None:
    traced = n.meta.get("val")
    if isinstance(traced, torch.Tensor):
        return "Tensor0" if traced.dim() == 0 else "Tensor"
    for types, kind in _NUMBER_KINDS:
        if isinstance(traced, types):
            return kind
    return None  # unknown (no traced value, or an opaque object): keep the call as traced


def _kinds(value: Any) -> Any:
    """A hashable key of the Python types of a node's arguments when the graph runs; None when a
    node's type is unknown."""
    if isinstance(value, fx.Node):
        return _node_kind(value)
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        parts = tuple((k, _kinds(v)) for k, v in items)
        if any(kind is None for _, kind in parts):
            return None
        return ("dict" if isinstance(value, dict) else "list" if isinstance(value, list)
                else "tuple", *parts)
    if type(value) is int and not -(2**63) <= value < 2**63:
        return "int beyond int64"  # the two calls fail differently: never reuse a verdict
    return type(value).__name__


def _stand_in(n: fx.Node) -> Any:
    """A fresh value of ``n``'s kind to call a binding with."""
    return _STAND_INS[_node_kind(n)]()


_VERIFIED: dict[tuple[torch._ops.OpOverload, Any], Binding | None] = {}


def _verified_binding(op: torch._ops.OpOverload, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Binding | None:
    """The first candidate binding of ``op`` that makes the same dispatcher call as ``op`` itself
    on these stand-in arguments."""
    expected = _first_dispatch(lambda: op(*args, **kwargs))
    if expected is None or expected[0] is not op:
        return None
    for binding in _candidates(op):
        got = _first_dispatch(lambda b=binding: b(*args, **kwargs))
        if got is not None and got[0] is op and _same(got[1:], expected[1:]):
            return binding
    return None


def _candidates(op: torch._ops.OpOverload) -> list[Binding]:
    """C-level bindings named like ``op``: a function, then a ``Tensor`` method (called as
    ``torch.Tensor.view(x, ...)``, so a subclass's override is not picked up), each reachable by
    the qualified name FX writes into the code."""
    name = op._schema.name.split("::", 1)[1]
    found = [getattr(namespace, name, None) for namespace in _FUNCTION_NAMESPACES]
    found.append(getattr(torch._C.TensorBase, name, None))
    return [fn for fn in found if fn is not None and _named_by_fx(fn)]


def _named_by_fx(fn: Any) -> bool:
    """Whether the name FX writes for ``fn`` (``torch.mm``, ``torch.Tensor.view``) names ``fn``
    itself and not, say, a Python wrapper of the same name (``torch.split``)."""
    try:
        head, *path = _get_qualified_name(fn).split(".")
    except (AttributeError, RuntimeError):  # FX cannot name it (a method torch.Tensor overrides)
        return False
    obj: Any = torch if head == "torch" else None
    for part in path:
        obj = getattr(obj, part, None)
    return obj is fn


class _Dispatched(Exception):
    """Raised by :class:`_FirstDispatch` to stop a call at its first ATen op."""


class _FirstDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise _Dispatched(func, args, kwargs or {})


def _first_dispatch(call: Callable[[], Any]) -> tuple[Any, Any, Any] | None:
    """``(overload, args, kwargs)`` of the first ATen call ``call`` makes, or None if it makes none
    or fails before making one."""
    try:
        with _FirstDispatch():
            call()
    except _Dispatched as dispatched:
        return dispatched.args
    except Exception:  # the binding does not accept these arguments: not a candidate
        return None
    return None


def _same(a: Any, b: Any) -> bool:
    """Equal dispatcher arguments: the same tensor objects, equal values of the same types."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and (a == b or (a != a and b != b))  # nan is nan here
