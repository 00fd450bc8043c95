"""Compilers that run the graph as Python: ``nop`` and the inspection compilers."""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from aotkit import counters
from aotkit.aot.boxing import make_boxed_func, run_boxed
from aotkit.aot.ops import LAID_OUT_AFTER
from aotkit.compilers.bind import bind_aten_calls
from aotkit.errors import ArgumentError, MetadataMismatchError
from aotkit.partition.draw import draw_graph

log = logging.getLogger("aotkit.compilers")


def require_graph_module(gm: Any, who: str) -> None:
    """Compilers take a GraphModule: one called on a function (taken for a decorator, as
    ``nnc_jit`` is) says so."""
    if not isinstance(gm, fx.GraphModule):
        raise ArgumentError(
            f"{who} is a compiler: it takes an FX GraphModule and example inputs, got "
            f"{type(gm).__name__}.\nFix: pass it as a compiler, aotkit.aot_function(fn, "
            f"aotkit.compilers.{who}) (aotkit.compilers.nnc_jit is the decorator).")


def nop(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
    """Run the graph as it is, through its generated Python code, calling each ATen op through
    PyTorch's Python binding for it where that binding makes the same dispatcher call
    (:func:`aotkit.compilers.bind.bind_aten_calls`; ``aotkit.config.bind_aten_calls``).

    Example::

        >>> import torch, aotkit
        >>> f = aotkit.aot_function(torch.sin, aotkit.compilers.nop)
        >>> f(torch.zeros(1))
        tensor([0.])
    """
    require_graph_module(gm, "nop")
    return run_boxed(bind_aten_calls(gm))  # Note [Freeing inputs as the graph goes]


def print_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
    """Print the graph's code (with dtypes and shapes), then run it like :func:`nop`.

    Example::

        >>> import torch, aotkit
        >>> f = aotkit.aot_function(torch.sin, aotkit.compilers.print_compile)
        >>> f(torch.zeros(1))  # doctest: +ELLIPSIS
        class ...(torch.nn.Module):
            def forward(self, primals_1: "f32[1]"):
        ...
                sin: "f32[1]" = torch.ops.aten.sin.default(primals_1);  primals_1 = None
                return [sin]
        <BLANKLINE>
        tensor([0.])
    """
    require_graph_module(gm, "print_compile")
    print(gm.print_readable(print_output=False))
    return nop(gm, example_inputs)


#: Image formats a name may ask for that draw_graph does not write.
_OTHER_FORMATS = frozenset({".pdf", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp",
                            ".ps", ".eps", ".gv"})


_NUMBERS: dict[str, int] = {}  # the last number given, by path


def next_number(path: str | os.PathLike[str]) -> int:
    """0, 1, 2, ... for the files written under ``path`` in this process, whoever writes
    them: two compilers given one name write apart."""
    key = os.path.abspath(path)
    _NUMBERS[key] = _NUMBERS.get(key, -1) + 1
    return _NUMBERS[key]


def draw_graph_compile(name: str) -> Callable[[fx.GraphModule, Sequence[Any]], Any]:
    """A compiler that draws every graph it gets to ``{name}_{n}.svg`` (``n`` counts from 0 per
    name in the process, so the forward and backward get their own files, also from two
    compilers of one name; ``name="g.png"`` draws ``g_{n}.png``), then runs it like :func:`nop`.

    Without Graphviz the DOT source is written instead and a ``"fallback"`` decision is recorded.

    Example::

        >>> import os, tempfile, torch, aotkit
        >>> prefix = os.path.join(tempfile.mkdtemp(), "sin")
        >>> f = aotkit.aot_function(torch.sin, aotkit.compilers.draw_graph_compile(prefix))
        >>> f(torch.zeros(1, requires_grad=True)).sum().backward()
        >>> sorted(os.path.splitext(p)[0] for p in os.listdir(os.path.dirname(prefix)))
        ['sin_0', 'sin_1']
    """
    if not isinstance(name, (str, os.PathLike)):
        raise ArgumentError(f"draw_graph_compile takes a file name prefix, got "
                            f"{type(name).__name__} {name!r}.\nFix: pass a str such as "
                            "'graphs/model' (drawn to graphs/model_0.svg, ...).")
    stem, suffix = os.path.splitext(os.fspath(name))
    if suffix.lower() in _OTHER_FORMATS:  # not part of a name such as "resnet.layer1"
        raise ArgumentError(
            f"draw_graph_compile({name!r}): it cannot draw {suffix!r} files.\nFix: end the name "
            "in .svg, .png or .dot, or give none for SVG.")
    if suffix.lower() not in (".svg", ".png", ".dot"):
        stem, suffix = os.fspath(name), ".svg"

    def draw_and_run(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
        result = draw_graph(gm, f"{stem}_{next_number(stem)}{suffix}")
        log.info("draw_graph_compile: drew the graph to %s", result.path)
        if result.fallback:  # See Note [draw_graph fallback]
            counters.record("fallback", f"draw_graph_compile({name})", result.fallback, logger=log)
        return nop(gm, example_inputs)

    draw_and_run.__name__ = f"draw_graph_compile({name!r})"
    return draw_and_run


def debug_nop(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
    """Run the graph node by node (slowly), checking each tensor a node produces against the fake
    value traced for it: dtype, device, shape and significant strides (those of dimensions longer
    than 1). Symbolic sizes are resolved from the real inputs at every call. A difference raises
    :class:`aotkit.errors.MetadataMismatchError` naming the node, its op and the user's code.

    Example::

        >>> import torch, aotkit
        >>> f = aotkit.aot_function(lambda x: x.t() @ x, aotkit.compilers.debug_nop, dynamic=True)
        >>> f(torch.ones(3, 2)).shape
        torch.Size([2, 2])
    """

    require_graph_module(gm, "debug_nop")
    recorded: set[str] = set()  # Note [Mismatches PyTorch is known to have]: once per node

    def run(*args: Any) -> Any:
        return _CheckingInterpreter(gm, recorded).run(*args)  # fresh: no values kept

    return make_boxed_func(run)


class _CheckingInterpreter(fx.Interpreter):
    """An ``fx.Interpreter`` comparing every real value with the node's ``meta["val"]``."""

    def __init__(self, gm: fx.GraphModule, recorded: set[str]) -> None:
        super().__init__(gm)
        self.bindings: dict[sympy.Symbol, int] = {}
        self.recorded = recorded
        self.ambiguous: set[fx.Node] = set()  # Note [Strides that differ in dims of size 1]

    def run_node(self, n: fx.Node) -> Any:
        real = super().run_node(n)
        if "val" not in n.meta:
            return real
        fake = n.meta["val"]
        if n.op == "placeholder":
            _bind(fake, real, self.bindings)
        fakes, reals = pytree.tree_leaves(fake), pytree.tree_leaves(real)
        if len(fakes) != len(reals):
            self._fail(n, f"it returned {len(reals)} value(s), traced {len(fakes)}")
        inherited = any(a in self.ambiguous for a in n.all_input_nodes)
        for i, (f, r) in enumerate(zip(fakes, reals, strict=True)):
            problem = _difference(f, r, self.bindings)
            if (problem is None or problem.startswith("strides")) and (
                    inherited or problem is None) and not _same_strides(f, r, self.bindings):
                self.ambiguous.add(n)
                problem = None
            if problem and _known_to_pytorch(n, i, f, r, problem):
                self._record_known(n, f"output {i}: {problem}")
            elif problem:
                self._fail(n, problem if len(fakes) == 1 else f"output {i}: {problem}")
        return real

    def _record_known(self, n: fx.Node, problem: str) -> None:
        if n.name not in self.recorded:
            self.recorded.add(n.name)
            op = (f"placeholder: output {n.meta['computed_by'][1]} of "
                  f"{n.meta['computed_by'][0]}" if n.op == "placeholder" else n.target)
            counters.record("known_mismatch", "debug_nop", (
                f"node {n.name!r} ({op}) gave {problem}: a difference of PyTorch's own "
                "kernels from their shape functions (Note [Mismatches PyTorch is known to "
                "have]), not of aotkit's graph"), logger=log)

    def _fail(self, n: fx.Node, problem: str) -> None:
        self.extra_traceback = False  # fx would append "While executing <node>": ours names it
        raise MetadataMismatchError(_mismatch_message(n, problem, self.bindings))


# Note [Mismatches PyTorch is known to have]
# debug_nop exists to find values whose metadata differ from the trace's. Some differences are
# PyTorch's own: under reduced precision, batch norm's CPU kernels return the saved mean and
# inverse standard deviation (and running statistics) in another dtype than their fake kernels
# say (2.13), so every AMP CNN failed the check although eager and the graph agree. Those are
# recorded once per node as a ``known_mismatch`` decision instead of raised. So are the strides
# of batch norm's result where its fake kernel lays it out otherwise than the real one: aotkit
# runs it on its input as it is (eager's reduction order) and lays the result out in the next
# node (Note [Kernels whose fake strides differ]).
_BATCH_NORMS = frozenset({
    torch.ops.aten._native_batch_norm_legit_no_training.default,
    torch.ops.aten._native_batch_norm_legit_functional.default,
    torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit.no_stats,
    torch.ops.aten.native_batch_norm.default,
    # Layer and group norm too: their CPU kernels give a bfloat16 input's mean and rstd in
    # float32, their fake kernels in bfloat16 (autocast's LayerNorm after a bf16 Linear).
    torch.ops.aten.native_layer_norm.default,
    torch.ops.aten.native_group_norm.default})


_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
# Group norm's backward, given float32 statistics for a bfloat16 input, returns its gradients
# in bfloat16; the fake kernel, given the bfloat16 statistics it said, in float32.
_NORM_BACKWARDS = frozenset({torch.ops.aten.native_group_norm_backward.default})


def _known_to_pytorch(n: fx.Node, output: int, fake: Any, real: Any, problem: str) -> bool:
    """See Note [Mismatches PyTorch is known to have]: dtype only, never the normalized output
    (also where a ``getitem`` takes one of the others out, or the backward graph gets one as
    a saved value: its placeholder's ``computed_by``, set by aotkit's partitioners; and a
    ``detach`` of one of those)."""
    while n.target in _ALIASES and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    target = n.target
    if n.op == "placeholder" and "computed_by" in n.meta:
        target, output = n.meta["computed_by"]
    elif target is operator.getitem and isinstance(n.args[0], fx.Node):
        target, output = n.args[0].target, n.args[1]
    if target in LAID_OUT_AFTER and output == 0 and problem.startswith("strides"):
        return True  # batch norm's result, laid out by the next node (aotkit.aot.ops)
    return isinstance(output, int) and isinstance(real, torch.Tensor) \
        and fake.dtype != real.dtype and ((target in _BATCH_NORMS and output > 0)
                                          or target in _NORM_BACKWARDS)


def _bind(fake: Any, real: Any, bindings: dict[sympy.Symbol, int]) -> None:
    """Map the bare symbols of a placeholder's traced sizes (``s0``) to the real input's values."""
    pairs: list[tuple[Any, Any]] = []
    if isinstance(fake, torch.SymInt) and isinstance(real, int):
        pairs = [(fake, real)]
    elif (isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor)
          and fake.dim() == real.dim()):
        pairs = [*zip(fake.shape, real.shape, strict=True),
                 *zip(fake.stride(), real.stride(), strict=True),
                 (fake.storage_offset(), real.storage_offset())]
    for sym, value in pairs:
        if isinstance(sym, torch.SymInt) and isinstance(sym.node.expr, sympy.Symbol):
            bindings.setdefault(sym.node.expr, int(value))


def _resolve(size: Any, bindings: dict[sympy.Symbol, int]) -> int | None:
    """A traced size as a number, or None when it depends on a symbol no input binds."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = sympy.sympify(size.node.expr.xreplace(bindings))
    return int(expr) if expr.is_number else None


def _difference(fake: Any, real: Any, bindings: dict[sympy.Symbol, int]) -> str | None:
    """What differs between a traced value and the real one (None: nothing we can check)."""
    if isinstance(fake, (int, torch.SymInt)) and isinstance(real, int) and not isinstance(real, bool):
        expected = _resolve(fake, bindings)
        if expected in (None, real):
            return None
        symbolic = f"{fake} = " if isinstance(fake, torch.SymInt) else ""
        return f"value {real}, traced {symbolic}{expected}"
    if not (isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor)):
        return None
    if fake.dtype != real.dtype:
        return f"dtype {real.dtype}, traced {fake.dtype}"
    if fake.device != real.device:
        return f"device {real.device}, traced {fake.device}"
    shape = [_resolve(s, bindings) for s in fake.shape]
    if len(shape) != real.dim() or any(
            e not in (None, r) for e, r in zip(shape, real.shape, strict=True)):
        return f"shape {tuple(real.shape)}, traced {_show(fake.shape, shape)}"
    if real.numel() == 0:
        return None
    strides = [_resolve(s, bindings) for s in fake.stride()]
    differs = [d for d, (e, r) in enumerate(zip(strides, real.stride(), strict=True))
               if real.shape[d] > 1 and e not in (None, r)]
    if differs:
        return (f"strides {real.stride()}, traced {_show(fake.stride(), strides)} (dims "
                f"{differs} differ; dims of size <= 1 are not compared) for shape "
                f"{tuple(real.shape)}")
    return None


# Note [Strides that differ in dims of size 1]
# A tensor with a dimension of size 1 is laid out alike by several stride tuples (a tensor of
# one channel is both contiguous and channels_last), so a real input may carry other strides
# than the traced one in that dimension only, which the check allows. Ops that choose their
# output's layout from the input's strides (pixel_unshuffle, convolution) then lay it out
# otherwise than traced, through no fault of their fake kernels: a node taking such a value
# has its strides left unchecked, and passes the allowance on.
def _same_strides(fake: Any, real: Any, bindings: dict[sympy.Symbol, int]) -> bool:
    if not (isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor)) \
            or fake.dim() != real.dim():
        return True
    return all(_resolve(f, bindings) in (None, r)
               for f, r in zip(fake.stride(), real.stride(), strict=True))


def _show(traced: Sequence[Any], resolved: Sequence[int | None]) -> str:
    """``(4, 8)``, or ``(s0, 8) = (4, 8)`` when symbolic."""
    numbers = tuple(r if r is not None else t for t, r in zip(traced, resolved, strict=True))
    if any(isinstance(t, torch.SymInt) for t in traced):
        return f"({', '.join(map(str, traced))}) = {numbers}"
    return str(numbers)


def _mismatch_message(n: fx.Node, problem: str, bindings: dict[sympy.Symbol, int]) -> str:
    op = n.op if n.op in ("placeholder", "output") else str(n.target)
    lines = [f"debug_nop: node {n.name!r} ({op}) gave {problem}."]
    if bindings:
        lines.append("Symbolic sizes resolved from the inputs: "
                     + ", ".join(f"{s}={v}" for s, v in sorted(bindings.items(), key=str)) + ".")
    trace = n.meta.get("stack_trace")
    if trace:
        frames = trace.strip().splitlines()[-6:]
        lines.append("User code:\n" + "\n".join("    " + f.strip() for f in frames))
    else:
        lines.append("User code: not recorded (set aotkit.config.record_stack_traces = True or "
                     "AOTKIT_RECORD_STACK_TRACES=1 before the function is first called, or "
                     "compile it again, to see it).")
    if n.op == "placeholder":
        lines.append("Fix: the graph was called with an input unlike the one it was traced with. "
                     "If the call came through aotkit, this is an aotkit bug: please report it "
                     "with this message.")
    else:
        lines.append("Fix: the op's fake (meta) implementation disagrees with its real kernel. "
                     "For a custom op, make its torch.library.register_fake function return the "
                     "dtype, shape and strides the kernel returns; for a PyTorch op, report it at "
                     "https://github.com/pytorch/pytorch/issues with this message. Compilers that "
                     "trust traced layouts (Inductor, CUDA graphs) may compute wrong results "
                     "here; aotkit.compilers.nop runs the graph as eager does.")
    return "\n".join(lines)


def closed_over_tensors(gm: fx.GraphModule) -> list[tuple[fx.Node, torch.Tensor]]:
    """The ``get_attr`` nodes reading a tensor the caller holds (a closed-over mask, a plain
    tensor attribute), with the tensor: what the caller may change in place between calls, so
    a compiler must read it at run time, never fold it. A constant the function makes itself
    (``torch.tensor([1., 2.])``, read only through ``lift_fresh_copy``) is not one."""
    found = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value: Any = gm
        for name in node.target.split("."):  # type: ignore[union-attr]
            value = getattr(value, name)
        fresh = node.users and all(u.target is torch.ops.aten.lift_fresh_copy.default
                                   for u in node.users)
        if isinstance(value, torch.Tensor) and not fresh:
            found.append((node, value))
    return found
