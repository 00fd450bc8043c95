"""Tensor subclasses at the graph boundary: jagged nested tensors, ``TwoTensor``, and any other
subclass that implements ``__tensor_flatten__``/``__tensor_unflatten__``.

Note [Tensor subclasses]
Graphs hold plain tensors only. A subclass argument is flattened into the plain tensors it is
made of (a jagged tensor's values and offsets), and the traced function rebuilds the subclass
from them before calling the user's code, whose subclass operations (the subclass's
``__torch_dispatch__``) trace into ATen operations on those plain tensors; subclass outputs are
flattened the same way and rebuilt when the compiled graph returns. Both crossings are
``autograd.Function``s (``_Rebuild``, ``_Unwrap``): the gradient of a rebuilt subclass is
flattened into gradients of its plain tensors, and gradients of an output's plain tensors are
rebuilt into a subclass gradient, while tracing the joint graph and when the compiled function
runs alike. So autograd sees subclass inputs and outputs, as in eager, and the compiled graphs
never see a subclass. Only a subclass's floating-point (or complex) parts with elements carry
gradients; its other parts (offsets, the empty tensors that hold cached lengths in their sizes)
are inputs that need none. A subclass's symbolic outer sizes (a jagged tensor's ragged size under
Dynamo, which is no part's size) are graph inputs after the parts, and a subclass output's are
graph outputs, from which it is rebuilt with its runtime sizes.

The compiled entry is keyed on each subclass's type, its flatten context and its parts'
signatures, not on its outer sizes: a jagged tensor's ragged size is a fresh nested int on
every tensor, and what the graph computes depends on the parts only.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.sym_node import SymNode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from aotkit.errors import UnsupportedError

_PLAIN_TYPES = frozenset({torch.Tensor, nn.Parameter, nn.Buffer})


_PLAIN_TORCH_FUNCTIONS = (torch.Tensor.__torch_function__.__func__,  # type: ignore[attr-defined]
                          torch._C._disabled_torch_function_impl)


def overrides_torch_function(x: torch.Tensor) -> bool:
    """Is ``x`` of a subclass with a __torch_function__ of its own, other than one made of plain
    tensors (Note [Subclasses with __torch_function__] in aotkit.aot.api)?"""
    override = getattr(type(x).__torch_function__, "__func__", type(x).__torch_function__)
    return override not in _PLAIN_TORCH_FUNCTIONS and not is_subclass(x)


def is_subclass(x: Any) -> bool:
    """Is ``x`` a tensor subclass made of plain tensors (``__tensor_flatten__``)?"""
    kind = type(x)  # not isinstance: a dead weakref.proxy argument raises when asked
    return kind not in _PLAIN_TYPES and issubclass(kind, torch.Tensor) \
        and is_traceable_wrapper_subclass(x)


def python_subclass(x: torch.Tensor) -> str | None:
    """What ``x`` is where it is a tensor of a plain Python subclass (``class MyParam(
    nn.Parameter)``, which libraries use to mark weights): PyTorch's tracing modes take none."""
    from aotkit.compat import FakeTensor, FunctionalTensor

    if type(x) in _PLAIN_TYPES or is_traceable_wrapper_subclass(x) \
            or isinstance(x, (FakeTensor, FunctionalTensor)):
        return None
    return f"is a {type(x).__name__}, a Python subclass of {type(x).__mro__[1].__name__}"


@dataclass(eq=False)
class Layout:
    """How one subclass tensor is made of plain tensors: its type, the names of its parts
    (each a plain tensor or, nested, another subclass), its other flattened attributes
    (``constants``: a DTensor's device mesh), the flatten context, its outer size and stride
    (the latest seen; see ``key``) and whether it requires grad."""

    cls: type
    attrs: tuple[str, ...]
    constants: dict[str, Any]
    ctx: Any
    size: Sequence[Any]
    stride: Sequence[Any]
    children: tuple[Layout | None, ...]
    requires_grad: bool
    # Per plain part (``parts`` order): does it carry the subclass's gradient?
    grads: tuple[bool, ...]
    key: Hashable = field(init=False)
    num_plain: int = field(init=False)
    num_symbols: dict[bool, int] = field(init=False)  # by ``exprs``

    def __post_init__(self) -> None:
        self.key = (self.cls, self.attrs, _freeze(self.ctx), self.requires_grad,
                    tuple(c.key if c is not None else None for c in self.children), self.grads,
                    _freeze(self.constants))
        self.num_plain = sum(1 if c is None else c.num_plain for c in self.children)
        self.num_symbols = {exprs: len(self.symbols(exprs)) for exprs in (False, True)}

    def symbols(self, exprs: bool) -> list[torch.SymInt]:
        """Its symbolic outer sizes and strides, then its children's; with ``exprs``, also
        those that are expressions of symbols (see ``_is_symbol``)."""
        own = [s for s in (*self.size, *self.stride) if _is_symbol(s, exprs)]
        return own + [s for c in self.children if c is not None for s in c.symbols(exprs)]

    def with_symbols(self, values: Iterator[Any], exprs: bool) -> Layout:
        """This layout with the values of ``symbols(exprs)``, in order, taken from ``values``."""
        if not self.num_symbols[exprs]:
            return self
        size = [next(values) if _is_symbol(s, exprs) else s for s in self.size]
        stride = [next(values) if _is_symbol(s, exprs) else s for s in self.stride]
        children = tuple(c and c.with_symbols(values, exprs) for c in self.children)
        return Layout(self.cls, self.attrs, self.constants, self.ctx, size, stride, children,
                      self.requires_grad, self.grads)


def layout_of(t: torch.Tensor) -> Layout:
    names, ctx = t.__tensor_flatten__()
    values = {a: getattr(t, a) for a in names}
    attrs = tuple(a for a in names if isinstance(values[a], torch.Tensor))
    constants = {a: v for a, v in values.items() if a not in attrs}
    children = tuple(layout_of(values[a]) if is_subclass(values[a]) else None for a in attrs)
    grads = []
    for a, child in zip(attrs, children, strict=True):
        grads.extend(child.grads if child is not None else [_carries_grad(t, values[a])])
    return Layout(type(t), attrs, constants, ctx, t.size(), t.stride(), children,
                  t.requires_grad, tuple(grads))


def _carries_grad(t: torch.Tensor, part: torch.Tensor) -> bool:
    """Only floating-point parts carry a subclass's gradient: not a jagged tensor's offsets,
    nor the empty tensors that hold its cached sequence lengths in their sizes (an empty part
    of a subclass that has elements; a subclass with no elements has empty parts that still
    carry its gradient)."""
    return t.requires_grad and (part.is_floating_point() or part.is_complex()) and (
        part.numel() != 0 or t.numel() == 0)


def _is_symbol(s: Any, exprs: bool) -> bool:
    """A size the graphs compute with: symbolic, a traced jagged size included (a runtime
    jagged tensor's nested int, which is no symbol, is not). Inputs take symbols only (a
    graph input's value is a symbol; Inductor cannot take ``4*s0`` as one), outputs also
    expressions (``exprs``)."""
    return (isinstance(s, torch.SymInt) and isinstance(s.node, SymNode)
            and (exprs or s.node.expr.is_Symbol))


def symbol_values(t: torch.Tensor, layout: Layout) -> list[Any]:
    """``t``'s values of ``layout.symbols(exprs=False)``, for the graphs' inputs."""
    own = [v for v, s in zip((*t.size(), *t.stride()), (*layout.size, *layout.stride),
                             strict=True) if _is_symbol(s, exprs=False)]
    return own + [v for a, c in zip(layout.attrs, layout.children, strict=True) if c is not None
                  for v in symbol_values(getattr(t, a), c)]


def parts(t: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The plain tensors ``t`` is made of, depth first in ``layout``'s order."""
    out: list[torch.Tensor] = []
    for attr, child in zip(layout.attrs, layout.children, strict=True):
        inner = getattr(t, attr)
        out.extend(parts(inner, child) if child is not None else [inner])
    return out


def rebuild(layout: Layout, plain: Iterator[torch.Tensor]) -> torch.Tensor:
    """The subclass ``layout`` describes, made of the next ``layout.num_plain`` tensors."""
    inner = {a: rebuild(c, plain) if c is not None else next(plain)
             for a, c in zip(layout.attrs, layout.children, strict=True)}
    inner.update(layout.constants)
    return layout.cls.__tensor_unflatten__(inner, layout.ctx, layout.size, layout.stride)


def _freeze(x: Any) -> Hashable:
    """A hashable stand-in for a flatten context (dicts, lists, specs)."""
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x


class _Rebuild(torch.autograd.Function):
    """Plain parts -> subclass; the subclass's gradient flows back to its parts."""

    @staticmethod
    def forward(ctx: Any, layout: Layout, *plain: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.layout = layout
        ctx.set_materialize_grads(False)
        # As in eager, a subclass's inner tensors carry no autograd history of their own
        # (``x.a`` of a TwoTensor that requires grad does not): its gradient flows through
        # this Function alone. Parts without grad stay the objects they are (a jagged
        # tensor's offsets are tagged with its ragged size).
        return rebuild(layout, (p.detach() if p.requires_grad else p for p in plain))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        layout: Layout = ctx.layout
        if grad is None:
            return (None,) * (1 + layout.num_plain)
        return (None, *_grad_parts(grad, layout))


# Note [Gradients in another layout]
# A subclass's gradient may have other metadata than the tensor it is the gradient of: the
# gradient of a replicated DTensor weight multiplied by a sharded input is Partial (each rank
# holds a summand), and an incoming gradient may come Replicate for a Partial output. The
# graphs compute with plain parts, whose meaning depends on that metadata: rebuilt with the
# input's (Replicate), a Partial gradient's summand was taken for the whole sum, silently, and
# a Replicate gradient of a Shard(0) input failed on its parts' sizes. So a gradient whose type
# can be brought to another's metadata (``__coerce_same_metadata_as_tangent__``, as PyTorch's
# AOT autograd asks of tangents) is brought to the metadata of the tensor it is the gradient
# of, both where the joint graph is traced (inputs: a DTensor redistribution, a collective, in
# the backward graph) and where the compiled function runs (outputs: the incoming gradient).
# Values are eager's; an input's gradient then comes in the input's placements, where eager may
# leave it Partial (reduced later, when it is used). A gradient that cannot be brought so (a
# Replicate one for a Partial output or input: DTensor keeps that redistribution for itself)
# is refused on a mesh of several ranks; on one rank a Partial tensor is its own sum, and the
# gradient is taken as it comes.
def _grad_parts(grad: torch.Tensor, layout: Layout) -> list[torch.Tensor | None]:
    if type(grad) is layout.cls and hasattr(grad, "__coerce_same_metadata_as_tangent__"):
        grad = _coerced(grad, layout)
    if type(grad) is not layout.cls:
        name = layout.cls.__name__
        kind = "a plain tensor" if not is_subclass(grad) else f"a {type(grad).__name__}"
        raise UnsupportedError(
            f"the gradient of a {name} input is {kind} (its __torch_dispatch__ returns such "
            f"results, so eager's .grad is one too); aotkit passes a subclass input's gradient "
            f"to the plain tensors the {name} is made of, which needs it to be a {name}.\nFix: "
            f"make __torch_dispatch__ wrap its results in {name}, pass the plain tensors it is "
            "made of as the arguments instead, or run this function eagerly."
        )
    return [g if carries else None for g, carries in zip(parts(grad, layout), layout.grads, strict=True)]


def _coerced(grad: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``grad`` with the metadata of the tensor it is the gradient of (Note [Gradients in
    another layout])."""
    try:
        coerced = grad.__coerce_same_metadata_as_tangent__(layout.ctx)
    except RuntimeError as exc:  # DTensor: Replicate to Partial is for its internal use only
        mesh = getattr(grad, "device_mesh", None)
        if mesh is not None and mesh.size() == 1:  # one rank: a Partial is its own sum
            return grad
        name = layout.cls.__name__
        raise UnsupportedError(
            f"a gradient of a {name} that aotkit compiled comes with other metadata than the "
            f"{name} itself, and cannot be brought to it ({exc}); the compiled graphs compute "
            f"with the {name}'s metadata.\nFix: make the {name}s the function takes and "
            "returns Replicate or Shard, not Partial (.redistribute(placements=[Replicate()]) "
            "of an output inside the function, of an input before the call), or run this "
            "function eagerly.") from None
    return grad if coerced is None else coerced


class _Unwrap(torch.autograd.Function):
    """Subclass -> its plain parts (aliases); their gradients are rebuilt into the
    subclass's gradient."""

    @staticmethod
    def forward(ctx: Any, layout: Layout, t: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        plain = parts(t, layout)
        ctx.layout, ctx.plain = layout, plain
        if t.grad_fn is not None:  # its hooks, as backward finds them (aotkit.aot.unreached)
            ctx.source = (weakref.ref(t), bool(t._backward_hooks))
        ctx.set_materialize_grads(False)
        out = tuple(p.detach() for p in plain)  # new tensor objects: the subclass's stay as they are
        ctx.mark_non_differentiable(*(o for o, d in zip(out, layout.grads, strict=True) if not d))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        if all(g is None for g in grads):
            return None, None
        filled = [p if not d else g if g is not None else torch.zeros_like(p)
                  for p, g, d in zip(ctx.plain, grads, ctx.layout.grads, strict=True)]
        if torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):
            # create_graph=True: the subclass's gradient stays connected to its parts', so a
            # second backward reaches the compiled backward's refusal instead of a detached
            # leaf (None, or zeros added). Note [Refusing double backward]
            return None, _Rebuild.apply(ctx.layout, *filled)
        return None, rebuild(ctx.layout, iter(filled))


# The nodes of the two Functions above: given no gradient, they pass none on.
PASSING_NONE = (_Rebuild._backward_cls, _Unwrap._backward_cls)


def unwrap(layout: Layout, t: torch.Tensor) -> list[torch.Tensor]:
    return list(_Unwrap.apply(layout, t))


@dataclass(eq=False)
class Boundary:
    """Where one compiled signature's subclass arguments and outputs are flattened and
    rebuilt (Note [Tensor subclasses]). ``inputs``: each argument's layout, None for plain
    tensors; ``outputs``: the same for the traced function's flat outputs.

    The graphs take every subclass argument's parts, then the symbolic sizes and strides of
    the subclasses themselves (a jagged tensor's ragged size is no part's size), and return
    the same for subclass outputs, from which they are rebuilt with their runtime sizes."""

    inputs: list[Layout | None]
    outputs: list[Layout | None] = field(default_factory=list)

    @staticmethod
    def of(args: Sequence[Any]) -> Boundary | None:
        """The boundary for ``args``, or None when no argument is a subclass."""
        layouts = [layout_of(a) if is_subclass(a) else None for a in args]
        return Boundary(layouts) if any(layouts) else None

    def subclass_parts(self) -> list[int]:
        """Positions, among the graphs' inputs, of the subclass arguments' parts."""
        positions, i = [], 0
        for layout in self.inputs:
            n = 1 if layout is None else layout.num_plain
            if layout is not None:
                positions.extend(range(i, i + n))
            i += n
        return positions

    def trace_inputs(self, args: Sequence[Any]) -> list[Any]:
        """The graphs' inputs for ``args`` (fake or real): each subclass replaced by its parts
        (the differentiable parts of a subclass that requires grad as new tensors that
        require grad), then the subclasses' symbolic sizes."""
        out: list[Any] = []
        for a, layout in zip(args, self.inputs, strict=True):
            if layout is None:
                out.append(a)
                continue
            plain = parts(a, layout)
            # Parts that need no grad stay the objects they are (a fake jagged tensor's offsets
            # keep the ragged size they are tagged with).
            out.extend(p.detach().requires_grad_() if d else p
                       for p, d in zip(plain, layout.grads, strict=True))
        return out + [s for x in self.inputs if x is not None for s in x.symbols(exprs=False)]

    def wrap_fn(self, flat_fn: Callable[..., tuple[list[Any], Any]]) -> Callable[..., tuple[list[Any], Any]]:
        """``flat_fn`` as a function of the graphs' inputs (see ``trace_inputs``)."""

        def plain_fn(*plain: Any) -> tuple[list[Any], Any]:
            outs, spec = flat_fn(*_rebuild_all(self.inputs, plain, exprs=False))
            self.outputs = [layout_of(o) if is_subclass(o) else None for o in outs]
            symbols = [s for x in self.outputs if x is not None for s in x.symbols(exprs=True)]
            return self._flatten(outs, self.outputs) + symbols, spec

        return plain_fn

    def call(self, run: Callable[[list[Any]], list[Any]], args: Sequence[Any]) -> list[Any]:
        """Run the compiled graphs (``run``, on the graphs' inputs) on subclass arguments."""
        layouts = [None if x is None else layout_of(a) for a, x in zip(args, self.inputs, strict=True)]
        symbols = [v for a, x in zip(args, self.inputs, strict=True) if x is not None
                   for v in symbol_values(a, x)]
        outs = run(self._flatten(args, layouts) + symbols)
        originals = [p for a, x in zip(args, layouts, strict=True) if x is not None
                     for p in parts(a, x)]
        return _rebuild_all(self.outputs, _shared_parts(self.outputs, outs, originals),
                            exprs=True)

    @staticmethod
    def _flatten(values: Sequence[Any], layouts: Sequence[Layout | None]) -> list[Any]:
        out: list[Any] = []
        for v, layout in zip(values, layouts, strict=True):
            out.extend([v] if layout is None else unwrap(layout, v))
        return out


# Note [Parts outputs share with inputs]
# ``n * 2`` on a jagged tensor keeps n's offsets: eager's output holds the very same offsets
# tensor, whose identity names the ragged size (j1), so the output composes with n (``out +
# n``). The graph hands back an alias of the offsets (a detach), a new tensor object, and the
# rebuilt output got a ragged size of its own (j2): ``out + n`` raised. A jagged output's
# offsets (or lengths) that are exactly an input part's memory (same address, dtype, sizes and
# strides) are therefore that input part. Only those: other parts are new tensors in eager too
# (``x.detach()`` of a TwoTensor has parts of its own, which the caller may change in place).
_IDENTITY_PARTS = ("_offsets", "_lengths")


def _shared_parts(layouts: Sequence[Layout | None], flat: list[Any],
                  inputs: Sequence[Any]) -> list[Any]:
    """See Note [Parts outputs share with inputs]."""
    by_memory = {_memory(t): t for t in inputs
                 if isinstance(t, torch.Tensor) and not t.requires_grad}
    if not by_memory:
        return flat
    flat, start = list(flat), 0
    for layout in layouts:
        if layout is not None and layout.cls.__name__ == "NestedTensor":
            for k, (attr, child) in enumerate(zip(layout.attrs, layout.children, strict=True)):
                if attr in _IDENTITY_PARTS and child is None:  # parts of NJT are all plain
                    flat[start + k] = by_memory.get(_memory(flat[start + k]), flat[start + k])
        start += 1 if layout is None else layout.num_plain
    return flat


def _memory(t: torch.Tensor) -> tuple[Any, ...]:
    return t.data_ptr(), t.dtype, t.device, t.shape, t.stride()


def _rebuild_all(layouts: Sequence[Layout | None], flat: Sequence[Any], exprs: bool) -> list[Any]:
    """The values ``layouts`` describe (subclasses rebuilt, the rest as they are) from
    ``flat``: their parts, then their symbolic sizes, as the graphs take (``exprs`` False)
    and return them."""
    num_parts = len(flat) - sum(x.num_symbols[exprs] for x in layouts if x is not None)
    it, symbols = iter(flat[:num_parts]), iter(flat[num_parts:])
    return [next(it) if layout is None
            else _Rebuild.apply(layout.with_symbols(symbols, exprs),
                                *itertools.islice(it, layout.num_plain))
            for layout in layouts]
