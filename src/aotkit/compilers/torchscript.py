"""TorchScript compilers and ``memory_efficient_fusion``.

TorchScript is deprecated upstream but still ships with PyTorch; these compilers keep working
code that used functorch's ``ts_compile``/``memory_efficient_fusion`` running on aotkit's graphs.
See Note [TorchScript warnings] for what is silenced.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._decomp import get_decompositions

from aotkit.aot import AotFunction, AotModule, aot_function, aot_module
from aotkit.aot.boxing import require_boxed
from aotkit.compilers.basic import closed_over_tensors, require_graph_module
from aotkit.errors import ArgumentError, CompilerError
from aotkit.partition import min_cut_rematerialization_partition
from aotkit.partition.graph import copy_graph_module

log = logging.getLogger("aotkit.compilers")
aten = torch.ops.aten

#: The decompositions ``memory_efficient_fusion`` traces with: each op becomes pointwise ATen
#: ops that a fuser can merge with its neighbours and that the min-cut partitioner may
#: recompute in the backward instead of saving. They are the backward formulas of activations
#: (one pointwise expression each, e.g. ``gelu_backward``), piecewise activations that are a
#: ``where``/``clamp`` away from their definition, ``masked_fill``, and bookkeeping ops the
#: fuser cannot see through (``detach``, ``conj_physical``, ``is_same_size``, cuDNN batch norm
#: in its native form). Ops with reductions (softmax, layer norm) and random ops (dropout) are
#: kept whole: their eager kernels are faster than the expanded form, and dropout must draw
#: the same random numbers as eager. So is ``logit_backward``: its decomposition loses eager's
#: result in low precision (bfloat16 gradients of 0 where eager's are 1000 or inf) and writes
#: ``nan`` as a literal TorchScript cannot read.
default_decompositions: dict[Any, Callable[..., Any]] = get_decompositions([
    aten.detach,
    aten.conj_physical,
    aten.is_same_size,
    aten.gelu_backward,
    aten.leaky_relu_backward,
    aten.sigmoid_backward,
    aten.threshold_backward,
    aten.hardtanh_backward,
    aten.hardsigmoid_backward,
    aten.hardswish_backward,
    aten.tanh_backward,
    aten.silu_backward,
    aten.elu_backward,
    aten.mish_backward,
    aten.softplus_backward,
    aten.native_dropout_backward,
    aten.elu,
    aten.leaky_relu,
    aten.hardtanh,
    aten.hardswish,
    aten.hardsigmoid,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.cudnn_batch_norm,
    aten.cudnn_batch_norm_backward,
])

# Note [TorchScript warnings]
# torch.jit.script and torch.jit.freeze warn on every call that TorchScript is deprecated, and
# scripting a GraphModule warns about its instance annotations, which TorchScript never reads.
# Users who pick a TorchScript compiler chose it knowingly: those two warnings are filtered by
# message while we compile (every other warning and every error passes through), and the
# deprecation is logged once under aotkit.compilers.
_FILTERED_WARNINGS = (
    (DeprecationWarning, r"`torch\.jit\.\w+` is deprecated"),
    (UserWarning, r"The TorchScript type system doesn't support instance-level annotations"),
)


@contextlib.contextmanager
def _torchscript() -> Iterator[None]:
    """Compile with TorchScript: its own autocast pass off (aotkit graphs already carry the
    casts autocast made while tracing) and its deprecation warnings filtered."""
    _log_deprecation_once()
    previous = torch._C._jit_set_autocast_mode(False)
    try:
        with warnings.catch_warnings():
            for category, message in _FILTERED_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        torch._C._jit_set_autocast_mode(previous)


@functools.cache
def _log_deprecation_once() -> None:
    log.info("TorchScript is deprecated upstream; aotkit's TorchScript compilers use it while "
             "PyTorch still ships it. aotkit.compilers.inductor is the maintained code generator.")


def _strip_overloads(gm: fx.GraphModule) -> None:
    """``aten.add.Tensor`` -> ``aten.add``: TorchScript resolves overloads itself. It knows no
    ``view(dtype)`` and reads a dtype as an int: ``x.view(torch.int32)`` ran as ``view(x, [3])``
    (a raw error at run time, or a wrong shape), so such a graph is refused."""
    for node in gm.graph.nodes:
        if node.target is aten.view.dtype:
            raise CompilerError(
                "TorchScript cannot compile a view that reinterprets a tensor's dtype "
                f"({node.format_node()}: x.view(torch.int32) and the like); it would run it as a "
                "view to a shape.\nFix: compile this function with aotkit.compilers.nop or "
                "inductor, or keep the dtype view outside it.")
        if isinstance(node.target, torch._ops.OpOverload):
            node.target = node.target.overloadpacket


def _keep_checks(gm: fx.GraphModule) -> None:
    """The graph's checks (``torch._check(n.item() >= 0)``, ``torch._assert_async``) as
    functions that raise: TorchScript drops ATen's assert ops as if they computed nothing, and
    ran on where eager raises."""
    for node in gm.graph.find_nodes(op="call_function", target=aten._assert_scalar.default):
        node.target = _check_scalar
    for target in (aten._assert_async.default, aten._assert_async.msg):
        for node in gm.graph.find_nodes(op="call_function", target=target):
            node.target = _check_tensor
            node.args = (node.args[0], node.args[1] if len(node.args) > 1 else
                         "Expected Tensor with single nonzero value, but got zero")


def _check_scalar(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_tensor(condition: torch.Tensor, message: str) -> None:
    if not bool(condition):
        raise RuntimeError(message)


def _normalize_for_torchscript(gm: fx.GraphModule) -> None:
    """Rewrite what TorchScript cannot take: typed placeholders (a SymInt input is an ``int``,
    not a Tensor), ``torch.device`` keyword values as strings with their index (``"cuda:1"``:
    a bare ``"cuda"`` would run on whichever device is current), a tuple output (TorchScript
    lists hold one type; outputs mix tensors, ints and None), and dtype-changing ``_to_copy``
    as ``to`` (which TorchScript's fusers understand)."""
    graph = gm.graph
    for node in graph.find_nodes(op="placeholder"):
        node.type = _script_type(node.meta.get("val"))
    for node in graph.nodes:  # size arithmetic: x / x.shape[-1] ** 0.5, std's backward
        if node.op == "call_function" and node.target in _SIZE_FUNCTIONS:
            node.target = _SIZE_FUNCTIONS[node.target]
        elif node.op == "call_function" and node.target in _BUILTINS_OF_SIZES:
            _script_builtin(node)
        elif node.target is torch.sym_sum:  # narrow(0, n.item(), 2)'s end
            _as_additions(graph, node)
        elif node.target is torch.sym_ite:
            is_int = isinstance(node.meta.get("val"), (int, torch.SymInt))
            node.target = _choose_int if is_int else _choose_float
        elif node.target is operator.pow and isinstance(node.meta.get("val"), (int, torch.SymInt)):
            node.target = _int_pow  # TorchScript's int ** int is a float
    for node in list(graph.nodes):  # FX writes a NaN as ``nan``, a name TorchScript lacks
        if node.op == "call_function" and any(
                isinstance(a, float) and math.isnan(a) for a in (*node.args, *node.kwargs.values())):
            with graph.inserting_before(node):
                nan = graph.call_function(float, ("nan",))
            node.args = tuple(nan if isinstance(a, float) and math.isnan(a) else a
                              for a in node.args)
            node.kwargs = {k: nan if isinstance(v, float) and math.isnan(v) else v
                           for k, v in node.kwargs.items()}
    for node in graph.find_nodes(op="call_function", target=aten._to_copy.default):
        if _is_cast(node):
            node.target = aten.to.dtype
            node.args, node.kwargs = (node.args[0], node.kwargs["dtype"]), {}
    for node in graph.nodes:
        if any(isinstance(v, torch.device) for v in node.kwargs.values()):
            node.kwargs = {k: str(v) if isinstance(v, torch.device) else v
                           for k, v in node.kwargs.items()}
    output = graph.output_node()
    if isinstance(output.args[0], (list, tuple)):  # not one value (fx.symbolic_trace's)
        output.args = (tuple(output.args[0]),)


#: torch's functions of symbolic sizes, as the Python builtins TorchScript knows; under
#: dynamic=True a graph holds them where eager computes with plain ints.
_SIZE_FUNCTIONS: dict[Any, Any] = {torch.sym_float: float, torch.sym_int: int,
                                   torch.sym_max: max, torch.sym_min: min,
                                   torch.sym_sqrt: math.sqrt}


#: Python builtins a graph calls on symbolic sizes that TorchScript lacks or types otherwise
#: (its round(float) is a float, rounding halves away from zero).
_BUILTINS_OF_SIZES = (round, abs, operator.abs, math.trunc)


def _script_builtin(node: fx.Node) -> None:
    """``round(n / 2)``, ``abs(n - 7)``, ``math.trunc(n / 2)`` of sizes, as functions
    TorchScript compiles, typed by what the argument is (an int or a float)."""
    is_int = isinstance(node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node)
                        else node.args[0], (int, torch.SymInt))
    if node.target is round and node.args[1:] not in ((), (None,)):
        raise CompilerError(
            f"ts_compile: the graph rounds a size to digits ({node.format_node()}: "
            "round(x.shape[0] / 3, 2) and the like), which TorchScript has no function for.\n"
            "Fix: compile this function with aotkit.compilers.nop or inductor, or round "
            "outside it.")
    if node.target is round:
        node.target, node.args = (int if is_int else _round_half_to_even), node.args[:1]
    elif node.target in (abs, operator.abs):
        node.target = _abs_int if is_int else _abs_float
    elif node.target is math.trunc:
        node.target = int


def _round_half_to_even(x: float) -> int:
    """Python's ``round(x)``: the nearest int, a half to the even one."""
    low = math.floor(x)
    rest = x - low
    return low + 1 if rest > 0.5 or (rest == 0.5 and low % 2 == 1) else low


def _abs_int(x: int) -> int:
    return -x if x < 0 else x


def _abs_float(x: float) -> float:
    return -x if x < 0 else x


def _as_additions(graph: fx.Graph, node: fx.Node) -> None:
    """``sym_sum([a, b, c])`` as ``a + b + c``, which TorchScript types per operand."""
    (values,) = node.args
    total = values[0]
    with graph.inserting_before(node):
        for value in values[1:]:
            total = graph.call_function(operator.add, (total, value))
    for user in list(node.users):
        user.replace_input_with(node, total)
    graph.erase_node(node)


def _choose_int(condition: bool, if_true: int, if_false: int) -> int:
    return if_true if condition else if_false


def _choose_float(condition: bool, if_true: float, if_false: float) -> float:
    return if_true if condition else if_false


def _int_pow(base: int, exponent: int) -> int:
    """``base ** exponent`` of two sizes, an int as in Python (``n ** 2``); past int64, which
    Python's ints are not bound by, an error rather than a wrapped value."""
    result = 1
    for _ in range(exponent):
        if base != 0 and abs(result) > 9223372036854775807 // abs(base):
            raise ValueError("ts_compile: an integer power of a size is past int64, which "
                             "TorchScript's ints cannot hold; compile with nop or inductor")
        result *= base
    return result


def _script_type(val: Any) -> type | None:
    if isinstance(val, (bool, torch.SymBool)):
        return bool
    if isinstance(val, (int, torch.SymInt)):
        return int
    if isinstance(val, (float, torch.SymFloat)):
        return float
    return torch.Tensor if isinstance(val, torch.Tensor) else None


def _is_cast(node: fx.Node) -> bool:
    """``_to_copy(x, dtype=d)`` and nothing else, with ``d`` different from x's dtype (a ``to``
    to the same dtype would alias x instead of copying)."""
    source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return (len(node.args) == 1 and set(node.kwargs) == {"dtype"}
            and isinstance(source, torch.Tensor) and source.dtype != node.kwargs["dtype"])


def _script(gm: fx.GraphModule, what: str, remove_mutation: bool) -> torch.jit.ScriptModule:
    """Script and freeze ``gm``, turning TorchScript's errors into a CompilerError. Closed-over
    tensors (a mask, a frozen teacher's buffers) stay attributes: freezing would fold them, and
    what is computed from them alone, into constants, and changes made to them in place later
    would not show."""
    gm.recompile()
    tensors = sorted({node.target for node, _ in closed_over_tensors(gm)})
    try:
        scripted = torch.jit.script(gm)
        if remove_mutation:
            torch._C._jit_pass_remove_mutation(scripted.graph)
        return torch.jit.freeze(scripted.eval(), preserved_attrs=tensors)
    except Exception as exc:
        simple = "ts_compile (which prepares symbolic sizes, device keywords and mixed " \
            "outputs for TorchScript), " if what == "simple_ts_compile" else ""
        raise CompilerError(
            f"{what}: TorchScript could not compile the graph: {type(exc).__name__}: "
            f"{str(exc).strip()}\nFix: use {simple}aotkit.compilers.inductor (TorchScript is "
            "deprecated and misses newer ops), or aotkit.compilers.nop."
        ) from exc


def _boxed(scripted: torch.jit.ScriptModule, what: str) -> Callable[[list[Any]], Any]:
    def run(*call: Any) -> Any:
        require_boxed(call, f"{what}'s compiled graph")
        (args,) = call
        previous = torch._C._jit_set_autocast_mode(False)
        try:
            return scripted(*args)
        except torch.jit.Error as exc:  # no RuntimeError, which eager's failed op or check is
            raise RuntimeError(f"{what}'s compiled graph failed: {exc}") from exc
        finally:
            torch._C._jit_set_autocast_mode(previous)

    run._boxed_call = True  # type: ignore[attr-defined]
    run.scripted = scripted  # type: ignore[attr-defined]
    return run


def ts_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
    """Compile ``gm`` with TorchScript: overloads stripped, placeholders typed, device keywords
    and outputs normalized for the TorchScript type system, then scripted, in-place ops removed
    where nothing aliases them, and frozen. Returns a boxed callable (its ``scripted``
    attribute is the frozen ``ScriptModule``). TorchScript fuses ops only where its fuser is
    enabled for the device (by default CUDA, not CPU).

    Example::

        >>> import torch, aotkit
        >>> from aotkit.compilers import ts_compile
        >>> f = aotkit.aot_function(lambda x: (x.sin() * 2).sum(), ts_compile)
        >>> x = torch.zeros(3, requires_grad=True)
        >>> f(x).backward()
        >>> x.grad
        tensor([2., 2., 2.])
    """
    require_graph_module(gm, "ts_compile")
    with _torchscript():
        copied = copy_graph_module(gm)
        _keep_checks(copied)
        _strip_overloads(copied)
        _normalize_for_torchscript(copied)
        return _boxed(_script(copied, "ts_compile", remove_mutation=True), "ts_compile")


def simple_ts_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
    """Script and freeze ``gm`` with only the overloads stripped (TorchScript cannot call
    ``OpOverload`` objects) and its checks kept; graphs with symbolic sizes, ``torch.device`` keywords or mixed
    outputs need :func:`ts_compile`. Returns a boxed callable.

    Example::

        >>> import torch, aotkit
        >>> from aotkit.compilers import simple_ts_compile
        >>> f = aotkit.aot_function(lambda x: x.cos() + 1, simple_ts_compile)
        >>> f(torch.zeros(2))
        tensor([2., 2.])
    """
    require_graph_module(gm, "simple_ts_compile")
    with _torchscript():
        copied = copy_graph_module(gm)
        _keep_checks(copied)
        _strip_overloads(copied)
        return _boxed(_script(copied, "simple_ts_compile", remove_mutation=False),
                      "simple_ts_compile")


def nnc_jit(f: Callable[..., Any]) -> AotFunction:
    """Decorator: compile ``f`` ahead of time, forward and backward, with :func:`ts_compile`
    (TorchScript, whose NNC fuser runs where it is enabled).

    Example::

        >>> import torch
        >>> from aotkit.compilers import nnc_jit
        >>> @nnc_jit
        ... def f(x):
        ...     return x.sin() * x
        >>> f(torch.zeros(2))
        tensor([0., 0.])
    """
    return aot_function(f, ts_compile)


def memory_efficient_fusion(fn_or_module: Callable[..., Any] | nn.Module,
                            **overrides: Any) -> AotFunction | AotModule:
    """Compile a function (``aot_function``) or module (``aot_module``) for low activation
    memory: the min-cut partitioner recomputes cheap pointwise chains in the backward instead
    of saving them, graphs are traced with :data:`default_decompositions` so that those chains
    are plain pointwise ops, and both graphs are compiled with :func:`ts_compile`.

    ``overrides`` replace any of these choices (``fw_compiler``, ``bw_compiler``,
    ``partition_fn``, ``decompositions``) or pass other keyword arguments of
    ``aot_function``/``aot_module`` (e.g. ``dynamic=True``).

    Example::

        >>> import torch
        >>> from aotkit.compilers import memory_efficient_fusion
        >>> model = memory_efficient_fusion(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()))
        >>> model(torch.randn(2, 4)).sum().backward()
    """
    is_module = isinstance(fn_or_module, nn.Module)
    target = aot_module if is_module else aot_function
    valid = list(inspect.signature(target).parameters)[1:]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ArgumentError(
            f"memory_efficient_fusion got unknown keyword argument(s) {', '.join(unknown)}.\n"
            f"Fix: pass only keyword arguments of {target.__name__}: {', '.join(valid)}."
        )
    options: dict[str, Any] = {
        "fw_compiler": ts_compile,
        "bw_compiler": ts_compile,
        "partition_fn": min_cut_rematerialization_partition,
        "decompositions": default_decompositions,
        **overrides,
    }
    return target(fn_or_module, **options)
