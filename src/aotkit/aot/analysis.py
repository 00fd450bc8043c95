"""The metadata pass: run the function once on functional fake tensors and record what it does.

What it records (``AotMeta``) decides the shape of every graph traced afterwards and of the
runtime epilogue: which inputs are mutated (data or metadata, visible to autograd or not), which
outputs require grad, and which outputs alias an input or each other.
See Note [Aliased outputs] below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree

from aotkit.aot.early_stop import NO_EARLY_STOP, EarlyStop, SaveWatch, WriteOrder, early_stop
from aotkit.aot.frames import current_user_line
from aotkit.aot.ops import requested_size
from aotkit.aot.simplify import known_equal
from aotkit.aot.subclass import is_subclass
from aotkit.aot.untraceable import (
    RefuseUntraceable,
    SavedAfterWrite,
    inputs_saved_after_write,
    versions_of,
)
from aotkit.compat import (
    FakeTensor,
    FunctionalTensor,
    FunctionalTensorMode,
    StorageWeakRef,
    fx_tracing,
    treespec_children,
)
from aotkit.errors import UnsupportedError


class Alias(enum.Enum):
    NONE = "none"              # a fresh tensor owned by the caller
    IS_INPUT = "is_input"      # the very input object (``return x``)
    OF_INPUT = "of_input"      # a view of input ``base``
    OF_OUTPUT = "of_output"    # a view of user output ``base``
    OF_INTERMEDIATE = "of_intermediate"  # a view of extra forward output ``base`` (an intermediate)
    CONSTANT = "constant"      # not a graph output: a Python value returned as is
    SAME_AS_OUTPUT = "same_as_output"  # the very object of an earlier user output ``base``


@dataclass(frozen=True)
class InputInfo:
    is_tensor: bool
    requires_grad: bool = False
    mutates_data: bool = False
    mutates_metadata: bool = False
    # Autograd saw none of the data mutations: they ran under no_grad / inference mode or
    # through a detached alias (``x.detach().add_(1)``, ``x.data.mul_(2)``).
    mutation_hidden: bool = False
    # After the call: ``x.add_(w)`` makes an input that did not require grad require it.
    requires_grad_after: bool = False
    # ``x.set_(y)`` (``x.data = y`` under Dynamo) hands the input another tensor's memory
    # (Note [Storage changes of inputs]).
    swaps_storage: bool = False
    # For a metadata mutation with static sizes: the input's sizes, strides and storage offset
    # (from its own) afterwards, taken from its traced layout (Note [Layout after t_()]).
    layout_after: tuple[tuple[int, ...], tuple[int, ...], int] | None = None
    # The function changed the input's shape or strides in place, to a layout the trace cannot
    # tell (dynamic sizes): see Note [Layout after t_()].
    layout_unknown: bool = False

    @property
    def mutated(self) -> bool:
        return self.mutates_data or self.mutates_metadata or self.swaps_storage

    # A view of it is returned that is placed through its new value, which the graph returns
    # then, also under keep_inference_input_mutations (_placed_from_new_values).
    views_need_new_value: bool = False

    @property
    def copied_in_graph(self) -> bool:
        """Under keep_inference_input_mutations the graph copies this mutation into the input
        itself; the others are returned and applied after the call."""
        return self.mutates_data and not self.mutates_metadata and not self.swaps_storage \
            and not self.views_need_new_value

    @property
    def mutation_is_differentiable(self) -> bool:
        return self.requires_grad_after and self.mutates_data and not self.mutation_hidden


@dataclass(frozen=True)
class OutputInfo:
    alias: Alias
    base: int | None = None
    requires_grad: bool = False
    is_tensor: bool = True
    constant: Any = None
    # Size, stride, and bytes from the base's first element to the view's: where the view sits
    # in its base, independent of the base's own offset (Note [Aliased outputs]).
    static_view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None
    # Has a grad_fn: autograd flows from this output into its base (a view), or into the inputs.
    linked: bool = True
    # A view taken under no_grad: eager gives it requires_grad but no grad_fn (no link to base).
    no_grad_view: bool = False
    # A view of a view taken under no_grad: eager gives it a grad_fn whose chain stops there,
    # so no gradient reaches the base (Note [Views cut by no_grad]).
    cut_view: bool = False
    # The view reads its storage conjugated / negated (``x.conj()``, ``x.conj().imag``); see
    # Note [Conjugate and negative views].
    is_conj: bool = False
    is_neg: bool = False
    # Eager's ``_is_view()``: ``x.detach()`` shares x's memory but is no view.
    is_view: bool = True
    # Placed by replaying its view ops on its input (Note [Views of inputs with gaps]).
    replay_only: bool = False
    # Made by nn.Parameter(...) or nn.Buffer(...) inside: "parameter", "buffer" or "buffer
    # (not persistent)"; eager returns one (Note [Leaves made inside]).
    made_as: str | None = None
    # The outputs computed from this one inside the function, a bit mask of their positions
    # (Note [Outputs other outputs are computed from]).
    feeds: int = 0
    # The returned view this view was taken from (``v, v[:5]``): the runtime makes it from that
    # output, as eager does (Note [Views taken from returned views]).
    through: int | None = None

    @property
    def made_leaf(self) -> bool:
        """A leaf made inside the function, maybe sharing memory with an input or another
        output (``x.detach().requires_grad_()``); Note [Leaves made inside]."""
        return self.is_tensor and self.requires_grad and not self.linked \
            and not self.no_grad_view and self.alias in _MAY_BE_MADE_LEAVES

    @property
    def fresh_leaf(self) -> bool:
        """A leaf made inside the function in memory of its own."""
        return self.made_leaf and self.alias is Alias.NONE


_MAY_BE_MADE_LEAVES = (Alias.NONE, Alias.OF_INPUT, Alias.OF_OUTPUT, Alias.OF_INTERMEDIATE)


@dataclass
class AotMeta:
    """What the metadata pass learned; every later stage reads it, none changes it."""

    inputs: list[InputInfo]
    outputs: list[OutputInfo]
    out_spec: pytree.TreeSpec
    intermediate_bases_requires_grad: list[bool] = field(default_factory=list)
    # Inputs autograd saved after the function wrote them (Note [Inputs saved after a write]).
    saved_after_write: dict[int, SavedAfterWrite] = field(default_factory=dict)
    early_stop: EarlyStop = NO_EARLY_STOP  # Note [Checkpoint's early stop]

    def __post_init__(self) -> None:
        self._returns_sizes = _has_size(self.out_spec)

    def unflatten(self, flat: list[Any]) -> Any:
        """The user's output structure around ``flat``; ``torch.Size`` comes back as
        ``torch.Size`` (PyTorch's pytree rebuilds it as a plain tuple)."""
        out = pytree.tree_unflatten(flat, self.out_spec)
        return _restore_sizes(out, self.out_spec) if self._returns_sizes else out

    @property
    def mutated_inputs(self) -> list[int]:
        return [i for i, info in enumerate(self.inputs) if info.mutated]

    @property
    def replayed_inputs(self) -> set[int]:
        """Inputs whose returned views are placed by replaying their view ops (Note [Views of
        inputs with gaps])."""
        return {o.base for o in self.outputs if o.replay_only}

    def graph_user_outputs(self) -> list[int]:
        """Indices of the user outputs the graph returns (everything but constants)."""
        return [i for i, o in enumerate(self.outputs) if o.alias is not Alias.CONSTANT]

    def fw_output_differentiable(self) -> list[bool]:
        """For each forward output (mutated inputs, user outputs, bases): does it get a tangent?"""
        mutations = [self.inputs[i].mutation_is_differentiable for i in self.mutated_inputs]
        users = [
            self.outputs[i].requires_grad and self.outputs[i].alias is Alias.NONE
            and not self.outputs[i].fresh_leaf
            for i in self.graph_user_outputs()
        ]
        return mutations + users + list(self.intermediate_bases_requires_grad)

    @property
    def num_fw_outputs(self) -> int:
        return (
            len(self.mutated_inputs)
            + len(self.graph_user_outputs())
            + len(self.intermediate_bases_requires_grad)
        )


def _has_size(spec: pytree.TreeSpec) -> bool:
    return spec.type is torch.Size or any(_has_size(c) for c in treespec_children(spec))


def _restore_sizes(value: Any, spec: pytree.TreeSpec) -> Any:
    if spec.type is torch.Size:
        return torch.Size(value)
    if not _has_size(spec):
        return value
    node = pytree.SUPPORTED_NODES[spec.type]
    children, context = node.flatten_fn(value)
    children = [_restore_sizes(v, c) for v, c in zip(children, treespec_children(spec), strict=True)]
    return node.unflatten_fn(children, context)


def to_fun(x: Any) -> Any:
    return FunctionalTensor.to_functional(x) if isinstance(x, torch.Tensor) else x


def from_fun(x: Any, eager_bits: bool = False) -> Any:
    """The value ``x`` wraps; with ``eager_bits``, without conj/neg bits eager's ``x`` has not
    (for outputs: Note [Conj bits of views after a write])."""
    if not isinstance(x, FunctionalTensor):
        return x
    torch._sync(x)
    inner = torch._from_functional_tensor(x.elem)
    if eager_bits and x._base is None:  # a root has eager's bits
        if inner.is_conj() and not x.is_conj():
            inner = inner.resolve_conj()
        if inner.is_neg() and not x.is_neg():
            inner = inner.resolve_neg()
    return inner


def analyze(
    flat_fn: Callable[..., tuple[list[Any], pytree.TreeSpec]], args: Sequence[Any],
    write_order: WriteOrder | None = None,
) -> tuple[AotMeta, list[Any]]:
    """Run ``flat_fn`` on functional wrappers of the fake ``args`` and describe what it did.

    ``flat_fn`` returns ``(flat_outputs, out_spec)``. Must run under the fake mode of ``args``.
    Also returns fake values of the forward outputs, the templates for the joint's tangents.
    ``write_order`` is what the trace's guard records of this pass's writes (Note [Checkpoint's
    early stop]).
    """
    with FunctionalTensorMode(_allow_token_discovery=True), _discarding_unbacked_symbols(args):
        f_args = [to_fun(a) for a in args]
        # Held, not just compared: a grad_fn object stays the same only while referenced.
        grad_fns = [f.grad_fn if isinstance(f, torch.Tensor) else None for f in f_args]
        versions = versions_of(f_args)
        watch = SaveWatch(write_order) if write_order is not None else contextlib.nullcontext()
        with _RefuseStorageChanges(args, f_args), RefuseUntraceable(args, f_args), \
                fx_tracing(), watch:  # as the traced pass will be
            f_outs, out_spec = flat_fn(*f_args)
        inputs = [_input_info(i, a, f, g) for i, (a, f, g)
                  in enumerate(zip(args, f_args, grad_fns, strict=True))]
        stop = early_stop(write_order, f_args, f_outs, grad_fns)
        saved = inputs_saved_after_write(f_args, versions, f_outs, grad_fns)
        _refuse_swaps_into_mutated_memory(inputs, args, f_args)
        outputs, bases = _output_infos(f_args, f_outs)
        _refuse_views_of_swapped_inputs(inputs, outputs)
        outputs = _views_of_relaid_inputs(args, f_args, inputs, outputs)
        inputs = _placed_from_new_values(inputs, outputs, f_args, f_outs)
        meta = AotMeta(inputs, outputs, out_spec, [b.requires_grad for b in bases], saved, stop)
        fw_outs = [
            *(f_args[i] for i in meta.mutated_inputs),
            *(f_outs[i] for i in meta.graph_user_outputs()),
            *bases,
        ]
        return meta, [from_fun(o) for o in fw_outs]


# Note [Views of inputs with gaps]
# An input with gaps in its strides (``x[:, ::2]``) that the function mutates gets a dense new
# value from functionalization, and views taken after the mutation take their strides from
# that value: placed by those strides in the caller's memory, a returned view ``x[0]`` would
# read other elements. Eager's view keeps the input's strides. So such a view records no place
# (``static_view``); the runtime replays the view ops the compiled graph ran on the new value
# (``select``, ``t``, ...) on the caller's input instead, after the mutation is written back.
# That needs the graph's new value returned, also under keep_inference_input_mutations, and
# its output to be a view of that value with view functions recorded (nop, TorchScript); such a
# graph of a compiler whose outputs are never those views (Inductor) runs as traced instead.
def _placed_from_new_values(inputs: list[InputInfo], outputs: Sequence[OutputInfo],
                            f_args: Sequence[Any], f_outs: Sequence[Any]) -> list[InputInfo]:
    """Inputs a returned view is placed in through their new value, which the graph must then
    return: views of Note [Views of inputs with gaps], and views in another dtype (``x.view(
    torch.int32)``, ``view_as_real``) with symbolic sizes, which a graph copying the write in
    cannot take from the input itself."""
    placed = {o.base for o, f in zip(outputs, f_outs, strict=True) if o.alias is Alias.OF_INPUT
              and (o.replay_only or (o.static_view is None and f.dtype != f_args[o.base].dtype))}
    return [dataclasses.replace(info, views_need_new_value=True) if i in placed else info
            for i, info in enumerate(inputs)]


def _views_of_relaid_inputs(args: Sequence[Any], f_args: Sequence[Any],
                            inputs: Sequence[InputInfo],
                            outputs: list[OutputInfo]) -> list[OutputInfo]:
    """See Note [Views of inputs with gaps]."""
    return [dataclasses.replace(out, static_view=None, replay_only=True)
            if out.alias is Alias.OF_INPUT and _relaid(inputs[out.base], args[out.base],
                                                       f_args[out.base])
            else out for out in outputs]


def _relaid(info: InputInfo, arg: Any, f_arg: Any) -> bool:
    return info.mutates_data and not info.mutates_metadata and not laid_out_alike(
        arg, from_fun(f_arg))


def laid_out_alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same strides wherever a stride matters (dims of size 1 step nowhere); sizes are
    ``a``'s."""
    keep = [d for d, n in enumerate(a.shape) if not statically_known_true(n <= 1)]
    return known_equal([a.stride(d) for d in keep], [b.stride(d) for d in keep])


@contextlib.contextmanager
def _discarding_unbacked_symbols(args: Sequence[Any]) -> Iterator[None]:
    """Sizes and values this pass reads from data (``x.item()``, ``nonzero`` when Dynamo
    captures them) are fresh unbacked symbols of the ShapeEnv; the pass's values are thrown
    away, so are those symbols, or the traced pass after it would find them unbound.

    The fake mode also remembers them on the input (``x.item()`` twice gives one symbol); a new
    epoch forgets that, so the traced pass binds its own symbols to the ops that make them.
    Otherwise a joint trace would bind them to the tangents (shaped like this pass's outputs),
    and the forward would read its sizes from a tangent."""
    mode = next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None)
    if mode is None or mode.shape_env is None:
        yield
        return
    with mode.shape_env.ignore_fresh_unbacked_symbols():
        yield
    mode.epoch += 1


def _input_info(index: int, arg: Any, f_arg: Any, grad_fn_before: Any) -> InputInfo:
    if not isinstance(arg, torch.Tensor):
        return InputInfo(is_tensor=False)
    torch._sync(f_arg)
    inner = f_arg.elem
    if torch._functionalize_was_storage_changed(inner):
        return _storage_swap_info(index, arg, f_arg, grad_fn_before)
    data = torch._functionalize_has_data_mutation(inner)
    metadata = restrided = torch._functionalize_has_metadata_mutation(inner)
    if _resized_out(inner, arg):
        metadata = True
        if not _fits(inner, arg):
            raise _storage_change_error(f"input {index} resized in place beyond its memory "
                                        "(an out= argument, resize_ or as_strided_; with "
                                        "dynamic shapes: beyond what its sizes and strides "
                                        "show)", "")
    # A mutation autograd saw changed the input's autograd history (its grad_fn); one made
    # under no_grad or through a detached alias left it as it was. Functionalization's own
    # no_grad flag is not used: a custom Function's forward mutates under no_grad and then
    # ``mark_dirty`` hands the input to autograd. Data only: a metadata-only mutation would
    # read as hidden.
    unseen = f_arg.grad_fn is grad_fn_before
    if f_arg.requires_grad and not arg.requires_grad and not data:
        raise UnsupportedError(
            f"the compiled function sets requires_grad on input {index} (requires_grad_() or "
            ".requires_grad = True), which aotkit cannot apply to the caller's tensor.\nFix: "
            "set requires_grad before calling, or use torch.compile(fn, backend='aotkit').")
    if arg.requires_grad and not f_arg.requires_grad:
        raise UnsupportedError(
            f"the compiled function detaches input {index} in place (detach_()), which aotkit "
            "cannot apply to the caller's tensor.\nFix: detach it before calling (or use "
            "x.detach() inside), or use torch.compile(fn, backend='aotkit').")
    layout = _layout_after(arg, f_arg) if restrided else None
    return InputInfo(True, arg.requires_grad, data, metadata, data and unseen, f_arg.requires_grad,
                     layout_after=layout, layout_unknown=restrided and layout is None)


# Note [Layout after t_()]
# ``x.t_()`` changes the caller's tensor's sizes and strides in place. The graph's new value of
# x is x's view when the compiled graph returns one, but a tensor of its own, laid out
# contiguously, when the graph copied it (a non-leaf requiring grad, a data mutation too): its
# strides are not x's, and for an input with gaps (``buf[:, 1:]``) x then read, and was written,
# in the wrong elements. With static sizes the analysis records the layout functionalization
# gave x, which the runtime applies to the caller's tensor. With dynamic sizes it cannot (the
# layout is symbolic): where the graph returns a new value of an x with gaps (not x's view),
# the call is refused before anything is written (the graph's contiguous strides over the
# caller's memory put x's elements in the wrong places); a dense x takes the new value's
# layout, which may order its memory otherwise than eager's (a square x after t_()).
def _layout_after(arg: torch.Tensor, f_arg: Any) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """Sizes, strides and storage offset (from ``arg``'s) of ``f_arg`` once the function ran,
    or None where any is symbolic. Not for a resize by an out= argument, whose result the
    graph's new value lays out as eager does."""
    size, stride = tuple(f_arg.size()), tuple(f_arg.stride())
    shift = f_arg.storage_offset() - arg.storage_offset()
    if all(isinstance(v, int) for v in (*size, *stride, shift)):
        return size, stride, shift
    return None


# Note [Storage changes of inputs]
# ``x.set_(y)``, ``x.data = y`` and a ``resize_`` that grows ``x`` give the caller's tensor new
# memory. A ``set_`` (what Dynamo makes of ``p.data = ...``: MoCo's momentum encoder, weight
# clipping) is applied as eager applies it: the graph returns the input's new value and the
# runtime calls ``x.set_(new)`` on the caller's tensor, under no_grad. Refused: a set_ autograd
# would see (grad mode on, on a tensor that requires grad), one that changes the shape of an
# input requiring grad (its gradient must keep the shape it was traced with), and ``x.data =``
# inside aot_function (the trace would not see it) and a growing ``resize_``, which the runtime
# cannot replay, where the user can still move them out of the compiled function. Under dynamic
# shapes fake tensors cannot be resized at all, so every resize_ is refused there.
def _refuse_swaps_into_mutated_memory(inputs: Sequence[InputInfo], args: Sequence[Any],
                                      f_args: Sequence[Any]) -> None:
    """A swapped input that shares memory with another input (``x.set_(y)``) is set to that
    input's tensor after the call, as eager leaves it, unless either is also written in place:
    the runtime writes the other one's new value and sets ``x`` to a copy, so the two would no
    longer share memory. A write to ``x`` is refused too where its old memory is seen by another
    input (``x`` a view, or viewed): it may have come before the swap, and be lost. A swap to a
    fresh tensor followed by writes (``x.set_(y.clone()); x.add_(1)``) is fine."""
    if not any(info.swaps_storage for info in inputs):
        return
    storages = {i: StorageWeakRef(from_fun(f).untyped_storage()) for i, f in enumerate(f_args)
                if isinstance(f, torch.Tensor)}
    before = {i: StorageWeakRef(a.untyped_storage()) for i, a in enumerate(args)
              if isinstance(a, torch.Tensor)}
    for i, info in enumerate(inputs):
        if not info.swaps_storage:
            continue
        sharing = [j for j, other in storages.items() if j != i and other == storages[i]]
        seen_before = args[i]._base is not None or any(
            j != i and other == before[i] for j, other in before.items())
        written = torch._functionalize_has_data_mutation(f_args[i].elem)
        if (written and (sharing or seen_before)) or any(
                inputs[j].mutates_data or inputs[j].mutates_metadata for j in sharing):
            raise UnsupportedError(
                f"x.set_(...) on input {i} of the compiled function is combined with an in-place "
                "write to memory another input shares; aotkit applies the swap after the call "
                "and could not keep that memory shared as eager does.\nFix: do the swap or the "
                "write outside the compiled function, or swap to a fresh tensor "
                "(x.set_(y.clone())).")


def _refuse_views_of_swapped_inputs(inputs: Sequence[InputInfo], outputs: Sequence[OutputInfo]) -> None:
    """An output viewing a swapped input would be remade on the caller's tensor after the swap,
    on its new memory, where eager's view (taken before the swap) keeps the old one."""
    for k, out in enumerate(outputs):
        if out.alias is Alias.OF_INPUT and inputs[out.base].swaps_storage:  # type: ignore[index]
            raise UnsupportedError(
                f"output {k} of the compiled function is a view of input {out.base}, whose memory "
                "the function swaps with x.set_(...); aotkit cannot return a view of the memory "
                "the input had before.\nFix: return a clone of the view, or do the swap outside "
                "the compiled function.")


def _storage_swap_info(index: int, arg: torch.Tensor, f_arg: Any, grad_fn_before: Any) -> InputInfo:
    if f_arg.grad_fn is not grad_fn_before or f_arg.requires_grad != arg.requires_grad:
        raise UnsupportedError(
            f"x.set_(...) on input {index} of the compiled function is seen by autograd (grad "
            "mode on, a tensor that requires grad); aotkit applies such swaps after the call, "
            "outside autograd.\nFix: do it under torch.no_grad() (or as x.data = ... under "
            "torch.compile), or outside the compiled function.")
    if arg.requires_grad and torch.is_grad_enabled() \
            and not known_equal(from_fun(f_arg).shape, arg.shape):
        raise UnsupportedError(
            f"x.set_(...) gives input {index} of the compiled function, which requires grad, "
            f"another shape ({tuple(arg.shape)} -> {tuple(from_fun(f_arg).shape)}); its "
            "gradient must keep the shape it was traced with.\nFix: do it outside the "
            "compiled function.")
    return InputInfo(True, arg.requires_grad, swaps_storage=True,
                     requires_grad_after=arg.requires_grad)


class _RefuseStorageChanges(torch.overrides.TorchFunctionMode):
    """Raises UnsupportedError for the storage changes of Note [Storage changes of inputs] that
    are visible as Python calls (``set_`` never reaches torch function; ``_input_info`` catches it)."""

    def __init__(self, args: Sequence[Any], f_args: Sequence[Any]) -> None:
        super().__init__()
        self.args, self.f_args = args, f_args
        self.storages = {StorageWeakRef(a.untyped_storage()): i for i, a in enumerate(f_args)
                         if isinstance(a, torch.Tensor)}
        self.nbytes = [a.untyped_storage().nbytes() if isinstance(a, torch.Tensor) else 0
                       for a in args]

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.resize_ or func is torch.Tensor.resize_as_:
            size = requested_size(func, args, kwargs)
            self._check_resize(args[0], size, kwargs.get("memory_format"))
        elif func == _DATA_SETTER and any(args[0] is a for a in self.f_args):
            raise UnsupportedError(
                f"x.data = ... on input {self._input_of(args[0])} of the compiled function (at "
                f"{current_user_line()}) swaps its memory where the trace cannot see it.\nFix: "
                "write x.set_(new) under torch.no_grad() (aotkit applies it to the caller's "
                "tensor after the call), do it outside the compiled function, or use "
                "torch.compile(fn, backend='aotkit').")
        elif func == _DATA_SETTER:  # the trace would keep the tensor's old value
            raise UnsupportedError(
                f"t.data = ... inside the compiled function (at {current_user_line()}) swaps "
                "a tensor's value outside autograd's and the trace's view, so the graph would "
                "keep computing with the old value.\nFix: use the new value directly (t = "
                "new), or t.copy_(new) under torch.no_grad(); or torch.compile(fn, "
                "backend='aotkit'), whose Dynamo handles it.")
        out = func(*args, **kwargs)
        if func in _AS_STRIDED_CALLS:
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
            self._check_as_strided(args[0], out, explicit_offset=offset is not None,
                                   in_place=func is torch.Tensor.as_strided_)
        return out

    def _check_as_strided(self, t: torch.Tensor, view: torch.Tensor, explicit_offset: bool,
                          in_place: bool) -> None:
        """See Note [as_strided on a written input]."""
        index = self._input_of(t)
        if index is None:
            return
        arg, f_arg = self.args[index], self.f_args[index]
        torch._sync(f_arg)
        if not torch._functionalize_has_data_mutation(f_arg.elem):
            return  # the graph places the view on the input itself
        where = f"as_strided on input {index} of the compiled function (at {current_user_line()})"
        if in_place:
            raise UnsupportedError(
                f"{where.replace('as_strided', 'as_strided_', 1)} after the function wrote that "
                "input: the write would be lost when the caller's tensor takes its new layout."
                f"\n{_AS_STRIDED_FIX}")
        value = torch._from_functional_tensor(f_arg.elem)
        same_offset = not explicit_offset or statically_known_true(
            value.storage_offset() == arg.storage_offset())  # none: counts from the tensor's own
        if not (same_offset and laid_out_alike(arg, value)):
            raise UnsupportedError(
                f"{where} after the function wrote that input: the graph holds the written "
                f"value as a new tensor (strides {tuple(value.stride())}, storage offset "
                f"{value.storage_offset()}) laid out otherwise than the input (strides "
                f"{tuple(arg.stride())}, storage offset {arg.storage_offset()}), while "
                "as_strided's strides and offset count in the input's own memory, so the view "
                f"would show other elements.\n{_AS_STRIDED_FIX}")
        if not bool(_extent(view) <= _extent(arg)):  # a shape guard with dynamic sizes
            raise UnsupportedError(
                f"{where} after the function wrote that input reaches memory beyond the "
                "input's elements, which the graph's new value of the input does not hold."
                f"\n{_AS_STRIDED_FIX}")

    def _input_of(self, t: torch.Tensor) -> int | None:
        return self.storages.get(StorageWeakRef(t.untyped_storage()))

    def _check_resize(self, t: torch.Tensor, size: Sequence[Any],
                      memory_format: torch.memory_format | None) -> None:
        if any(isinstance(s, torch.SymInt) for s in (*t.shape, *size)):
            raise UnsupportedError(
                f"resize_ cannot be traced with dynamic shapes (at {current_user_line()}).\nFix: compile "
                "with dynamic=False, resize the tensor outside the compiled function, or make a "
                "new tensor of the size you need (torch.empty, torch.cat) instead."
            )
        if memory_format not in (None, torch.contiguous_format):
            raise UnsupportedError(
                f"resize_(..., memory_format={memory_format}) (at {current_user_line()}) lays the "
                "tensor's memory out anew, which the trace records as a contiguous tensor.\nFix: "
                "resize outside the compiled function, or resize without memory_format and "
                "return .contiguous(memory_format=...) of the result."
            )
        index = self._input_of(t)
        needed = (torch.Size(size).numel() + t.storage_offset()) * t.element_size()
        if index is not None and needed > self.nbytes[index]:
            raise _storage_change_error(f"resize_ growing input {index}", current_user_line())


# Note [Inputs resized as out= arguments]
# An out= op resizes its out tensor to the result's size (``torch.add(x, 1, out=buf)`` with an
# empty ``buf``). Functionalization applies the new size to its inner tensor, but the Python
# FunctionalTensor keeps the old one and the metadata-mutation flag stays False, so the change
# is read from the inner tensor. Growing beyond the input's memory is refused like resize_, and
# so is a size that symbolic shapes cannot prove to fit.
def _resized_out(inner: torch.Tensor, arg: torch.Tensor) -> bool:
    """Did the function give the input another shape (an out= argument, ``as_strided_``)?
    Shapes only: an out= of the right shape keeps its strides, and after a data mutation the
    inner tensor's strides are those of the new value, not the input's. With dynamic shapes the
    comparison is a shape guard: ``cat([a, a], out=out)`` holds for sizes where ``out`` is
    twice ``a``, and the entry is kept for those."""
    return inner.dim() != arg.dim() or any(
        not bool(m == n) for m, n in zip(inner.shape, arg.shape, strict=True))


def _fits(inner: torch.Tensor, arg: torch.Tensor) -> bool:
    """Does the input's new shape stay within its memory? With dynamic shapes a fake's storage
    size is a symbol no input names, so what cannot be proved is checked against the input's
    own reach, as a shape guard on its sizes and strides."""
    if statically_known_true(_extent(inner) <= arg.untyped_storage().nbytes()):
        return True
    return bool(_extent(inner) <= _extent(arg))


def _extent(t: torch.Tensor) -> Any:
    """The bytes of storage ``t`` reaches, from its start."""
    return extent(t.shape, t.stride(), t.storage_offset(), t.element_size())


def extent(size: Sequence[Any], stride: Sequence[Any], offset: Any, element_size: int) -> Any:
    """The bytes of storage a tensor of this layout reaches, from the storage's start."""
    if any(n == 0 for n in size):
        return 0
    return (offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1) * element_size


_DATA_SETTER = torch.Tensor.data.__set__  # type: ignore[attr-defined]
_AS_STRIDED_CALLS = frozenset({torch.Tensor.as_strided, torch.as_strided, torch.Tensor.as_strided_})
_AS_STRIDED_FIX = ("Fix: take the as_strided view before writing the input, pass a contiguous "
                   "tensor at storage offset 0 (x.clone()), or use ordinary view ops (x[1:3], "
                   "x.view(...)).")


# Note [as_strided on a written input]
# Functionalization keeps an input's value, once written, as a new tensor (``x.add_(1)`` makes
# ``add``), and places every later view of the input on that tensor. Ordinary views are
# relative to the tensor they view and land right; as_strided's strides and storage offset
# count in the input's own memory. On an input with gaps between its elements, or at storage
# offset 2 with an explicit offset (none counts from the tensor's own start, which moves with
# it), the new tensor is laid out otherwise (offset 0, contiguous), and the same offset and
# strides pick other elements: a silent wrong result (PyTorch 2.13's aot_function gives it).
# So as_strided on an input after a write is refused unless the written value is laid out as
# the input is and the view stays within it; before any write the value is the input itself.


def _storage_change_error(what: str, where: str) -> UnsupportedError:
    where = f" (at {where})" if where else ""
    return UnsupportedError(
        f"{what} of the compiled function{where} gives the caller's tensor "
        "new memory, which aotkit cannot write back to it.\nFix: do it outside the compiled "
        "function (before or after the call), or build a new tensor inside it and return that."
    )




# Note [Aliased outputs]
# Eager returns real views: ``return x[0]`` aliases ``x``; ``return a, a.view(-1)`` returns two
# tensors sharing storage. An autograd.Function cannot return views of its inputs or of each
# other safely, so the graph returns such outputs only to carry their size/stride/offset, and the
# epilogue regenerates each as ``base.as_strided(...)`` outside the Function: from the input,
# from the user output it views, or from an extra forward output holding the intermediate base
# (when outputs view an intermediate the user never returned: ``(x + 1).view(-1)`` is a view
# whose ``_base`` eager keeps alive, and which the caller may change in place, as autograd
# allows for views but not for views a Function returns). Autograd then flows through
# as_strided into the base, which is exact because the output *is* a view of it.
class SubclassOutputs(Exception):
    """The function returns a tensor subclass that no argument is: the caller traces again with
    a subclass boundary around the outputs (Note [Tensor subclasses])."""


def _output_infos(f_args: list[Any], f_outs: list[Any]) -> tuple[list[OutputInfo], list[torch.Tensor]]:
    if any(map(is_subclass, f_outs)):
        raise SubclassOutputs
    input_storage = {
        StorageWeakRef(a.untyped_storage()): i
        for i, a in reversed(list(enumerate(f_args)))
        if isinstance(a, torch.Tensor)
    }
    shared = _storages_shared_by_outputs(f_outs)
    infos: list[OutputInfo] = []
    bases: list[torch.Tensor] = []
    for k, out in enumerate(f_outs):
        if not isinstance(out, torch.Tensor):
            infos.append(_non_tensor_info(out))
            continue
        storage = StorageWeakRef(out.untyped_storage())
        rg = out.requires_grad
        same = next((i for i, a in enumerate(f_args) if a is out), None)
        earlier = next((j for j, o in enumerate(f_outs[:k]) if o is out), None)
        if earlier is not None:  # ``return y, y`` gives one object twice
            infos.append(OutputInfo(Alias.SAME_AS_OUTPUT, earlier, rg))
        elif same is not None:
            infos.append(OutputInfo(Alias.IS_INPUT, same, rg))
        elif storage in input_storage and _through_custom_function(out, f_args[input_storage[storage]]):
            infos.append(OutputInfo(Alias.NONE, None, rg))
        elif storage in input_storage:
            base = input_storage[storage]
            infos.append(_view_info(Alias.OF_INPUT, base, out, f_args[base]))
        elif storage in shared or out._base is not None:  # views another output, or a value
            infos.append(_view_of_output_info(out, f_outs, bases))  # the user does not get
        else:
            infos.append(OutputInfo(Alias.NONE, None, rg, linked=out.grad_fn is not None))
    _check_leaves_made_inside(infos, f_outs)
    infos = [dataclasses.replace(info, made_as=made) if (made := _made_as(out)) else info
             for info, out in zip(infos, f_outs, strict=True)]
    through = _views_taken_through(infos, f_outs)
    infos = [dataclasses.replace(info, through=through[k]) if k in through else info
             for k, info in enumerate(infos)]
    feeds = _outputs_feeding_others(infos, f_outs)
    infos = [dataclasses.replace(info, feeds=feeds[k]) if k in feeds else info
             for k, info in enumerate(infos)]
    return infos, bases


# Note [Outputs other outputs are computed from]
# One autograd node stands for all of a compiled call's outputs, so where the function computes
# an output from another (``a = x * 2; return a, a.relu()``), the gradient ``b`` brings to
# ``a`` stays inside the backward graph: it never passes ``a``'s own edge. Eager's hooks on
# ``a`` and ``a.retain_grad()`` see it; here they would see only what comes into ``a`` from
# outside. The same holds for an output that is a view other outputs are computed from (the
# runtime makes it outside the node); only views made from an output itself pass through it
# (Note [Views taken from returned views]). So the runtime refuses a backward that brings such
# dependents a gradient (read off the node's incoming gradients, or, for a view, off a hook on
# the view's node) while the output has a hook or retains its gradient. Not seen: hooks
# registered before the output was changed in place (they stay on the node's edge), outputs of
# a tensor subclass (README).
_COMPUTED_OR_VIEWS = (Alias.NONE, Alias.OF_INPUT, Alias.OF_OUTPUT, Alias.OF_INTERMEDIATE)


# Note [Views taken from returned views]
# Eager's ``v = x[2:]; return v, v[:5]`` gives ``v[:5]`` a node whose edge leads to ``v``'s: a
# hook on ``v``, or ``v.retain_grad()``, sees the gradient ``v[:5]`` brings. Regenerated side
# by side from their base (Note [Aliased outputs]), the second would send its gradient straight
# to ``x``, around ``v``. So the analysis follows each view output's chain of view nodes to the
# nearest other returned view on it, and the runtime makes the view from that output (an
# as_strided of it at the place the view has in their shared memory, in the view's dtype and
# with its conj/neg bits), after it. Not from an output whose elements share memory in this
# call (``x.unfold(0, 4, 2)``; as_strided's backward would spread a gradient over an input's
# shared elements, where eager's view chain picks one): decided per call from the real strides
# (symbolic ones cannot show it without a guard: ``x[:, ::2]``), that view is made beside it,
# from the base, with a hook on its node that refuses a gradient into it while an output it
# was taken from has hooks (``feeding.note_beside``).
def _views_taken_through(infos: list[OutputInfo], f_outs: list[Any]) -> dict[int, int]:
    """Per view output taken from another returned view, that view's position."""
    def plain_view(k: int) -> bool:
        info, out = infos[k], f_outs[k]
        return info.alias in _VIEWS and info.linked and info.is_view and not (
            info.cut_view or info.no_grad_view or info.replay_only or info.made_as) \
            and out.grad_fn is not None

    views = {(f_outs[k].grad_fn, f_outs[k].output_nr): k for k in range(len(f_outs)) if plain_view(k)}
    if len(views) < 2:
        return {}
    through = {}
    for k in views.values():
        out = f_outs[k]
        root = out._base.grad_fn if out._base is not None else None
        node = out.grad_fn
        while node is not root and len(edges := [e for e in node.next_functions if e[0] is not None]) == 1:
            if (j := views.get(edges[0])) is not None:
                through[k] = j
                break
            node = edges[0][0]
    return through


_VIEWS = (Alias.OF_INPUT, Alias.OF_OUTPUT, Alias.OF_INTERMEDIATE)


def _made_from(info: OutputInfo) -> int | None:
    """The output the runtime makes this one from, if any."""
    if info.through is not None:
        return info.through
    return info.base if info.alias is Alias.OF_OUTPUT else None


def _outputs_feeding_others(infos: list[OutputInfo], f_outs: list[Any]) -> dict[int, int]:
    """Per output others are computed from, the bit mask of those outputs."""
    def graded(k: int) -> bool:
        return infos[k].alias in _COMPUTED_OR_VIEWS and isinstance(f_outs[k], torch.Tensor) \
            and f_outs[k].grad_fn is not None

    outputs = [k for k in range(len(f_outs)) if graded(k)]
    if len(outputs) < 2:
        return {}
    sources = {(f_outs[k].grad_fn, f_outs[k].output_nr): k for k in outputs}
    reach: dict[Any, int] = {}  # an autograd node -> the outputs whose gradient reaches it
    made_from: dict[int, int] = {}  # an output -> the views the runtime makes from it
    for k in outputs:
        reach[f_outs[k].grad_fn] = reach.get(f_outs[k].grad_fn, 0) | 1 << k
        made = k
        while (made := _made_from(infos[made])) is not None:  # v[:5] from v, v from a: from a
            made_from[made] = made_from.get(made, 0) | 1 << k
    feeds: dict[int, int] = {}
    for node in _nodes_in_order(list(reach)):
        for edge in node.next_functions:
            if edge[0] is None:
                continue
            reach[edge[0]] = reach.get(edge[0], 0) | reach.get(node, 0)
            if (k := sources.get(edge)) is not None and \
                    (missed := reach.get(node, 0) & ~made_from.get(k, 0)):
                feeds[k] = feeds.get(k, 0) | missed
    return feeds


def _nodes_in_order(roots: list[Any]) -> list[Any]:
    """The autograd nodes behind ``roots``, each before every node it leads to."""
    seen: set[Any] = set()
    post: list[Any] = []
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                post.append(node)
            elif node not in seen:
                seen.add(node)
                stack.append((node, True))
                stack.extend((n, False) for n, _ in node.next_functions if n is not None)
    return post[::-1]


def _made_as(out: Any) -> str | None:
    if isinstance(out, torch.nn.Parameter):
        return "parameter"
    if isinstance(out, torch.nn.Buffer):
        return "buffer" if getattr(out, "persistent", True) else "buffer (not persistent)"
    return None


# Note [Leaves made inside]
# A tensor the function makes into a leaf (``torch.zeros((), requires_grad=True)`` as a
# placeholder loss, ``feat.detach().requires_grad_()`` to read a feature map's gradient) is
# returned by eager as a leaf: no history, ``.grad`` filled by backward. The runtime hands such an
# output back as a fresh leaf of its own (a non-differentiable graph output, detached and set to
# require grad), the gradient the caller reads landing in its ``.grad``. If another output is
# computed from it (``feat.sin()``), eager's backward through that output fills the leaf's
# ``.grad`` too, which the graph cannot do (the leaf is no graph input): refused. A tensor made
# by ``nn.Parameter(...)`` or ``nn.Buffer(...)`` comes back as one, as eager's does (assigned
# to a module, it registers as one); a subclass of Parameter comes back as a Parameter (the
# trace sees the class only through Parameter's isinstance flag).
def _check_leaves_made_inside(infos: list[OutputInfo], f_outs: list[Any]) -> None:
    leaves = {id(f_outs[k]): k for k, o in enumerate(infos) if o.made_leaf}
    if not leaves:
        return
    seen: set[Any] = set()
    stack = [o.grad_fn for o in f_outs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) in leaves:
            raise UnsupportedError(
                f"the compiled function returns a tensor it made into a leaf (output "
                f"{leaves[id(leaf)]}: requires_grad_() on a detached tensor, or "
                "requires_grad=True at creation) and computes another output from it; eager's "
                "backward through that output fills the leaf's .grad, which a compiled "
                "function cannot.\nFix: create the leaf outside the function and pass it in.")
        stack.extend(fn for fn, _ in node.next_functions)


# Note [Views made by custom Functions]
# A custom autograd.Function may return its input, or a view of it (``forward`` returns ``x``
# or ``x.view(-1)``): eager's output is then a view of the input whose gradient is the
# Function's ``backward``, not a view's. Regenerating such an output as a view outside the
# compiled Function would route its gradient around that backward, so it is a plain output of
# the compiled Function, differentiated by the traced graph, as eager's custom Function
# returns it (still a view of the input with the nop compiler).
def _through_custom_function(out: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``out``'s autograd history reaches ``base`` through a custom Function, walking
    the chain of one-input nodes (views) from ``out``. See Note [Views made by custom
    Functions]."""
    stop = base.grad_fn
    node = out.grad_fn
    while node is not None and node is not stop:
        if isinstance(node, torch.autograd.function.BackwardCFunction) or (
                type(node).__name__ == "CppFunction"):
            return True
        edges = [fn for fn, _ in node.next_functions if fn is not None]
        if len(edges) != 1:
            return False
        node = edges[0]
    return False


def _storages_shared_by_outputs(f_outs: list[Any]) -> set[StorageWeakRef]:
    seen: dict[StorageWeakRef, int] = {}
    for out in f_outs:
        if isinstance(out, torch.Tensor):
            if torch._C._functorch.is_functorch_wrapped_tensor(from_fun(out)):
                raise UnsupportedError(
                    "the compiled function returns a tensor of a torch.func transform that has "
                    "ended (what torch.func.vjp's vjp_fn holds, returned with it): it has no "
                    "memory of its own outside the transform.\nFix: call vjp_fn inside the "
                    "compiled function and return its gradients, or return the primal only.")
            ref = StorageWeakRef(out.untyped_storage())
            seen[ref] = seen.get(ref, 0) + 1
    return {ref for ref, count in seen.items() if count > 1}


def _view_of_output_info(out: torch.Tensor, f_outs: list[Any], bases: list[torch.Tensor]) -> OutputInfo:
    rg = out.requires_grad
    base = out._base
    # (see _through_custom_function); a plain view of a subclass (nt.values() of a nested tensor
    # made inside) cannot be regenerated from its base, which the caller never sees anyway
    if base is None or _through_custom_function(out, base) or (
            is_subclass(base) and not is_subclass(out)):
        return OutputInfo(Alias.NONE, None, rg, linked=out.grad_fn is not None)
    owner = next((i for i, o in enumerate(f_outs) if o is base), None)
    if owner is not None:
        return _view_info(Alias.OF_OUTPUT, owner, out, base)
    index = next((i for i, b in enumerate(bases) if b is base), None)
    if index is None:
        bases.append(base)
        index = len(bases) - 1
    return _view_info(Alias.OF_INTERMEDIATE, index, out, base)


def _view_info(alias: Alias, base: int, out: torch.Tensor, base_value: torch.Tensor) -> OutputInfo:
    linked = out.grad_fn is not None
    # not ``x.detach()[0].requires_grad_()``, a leaf viewing a base that requires no grad
    no_grad_view = out.requires_grad and not linked and out._is_view() \
        and out._base is not None and out._base.requires_grad
    is_conj, is_neg = _view_bits(out, base_value)
    return OutputInfo(alias, base, out.requires_grad, static_view=_static_view(out, base_value),
                      linked=linked, no_grad_view=no_grad_view,
                      cut_view=linked and _cut_from(out, base_value),
                      is_conj=is_conj, is_neg=is_neg, is_view=out._is_view())


# Note [Conj bits of views after a write]
# Eager's conj/neg bits of a view are its base's, flipped by each ``conj()`` (``_conj``) and
# negative view (``.imag`` of a conjugate) on the way. A functional tensor mirrors the bits of
# the value it wraps, and after a write through ``y = x.conj()`` functionalization gives views
# made from ``y`` later (``y[...]``) a value replayed without the bit: their own bits are wrong.
# The chain of view ops functionalization records for the view is not, so the bits are counted
# along it. ``base`` is the view's ``_base``, the root of that chain, as in eager. A root keeps
# the bits it was made with (none, or an input's), but the value it wraps after such a write is
# the write's value seen through ``conj()`` again, so ``from_fun`` resolves bits a returned
# root's value has and eager's root has not: a returned ``t`` with a conj bit would make
# ``view_as_real(t)`` raise. Not the new value of a mutated input (copy_ into the input
# resolves it), nor an intermediate base of symbolic sizes: their views are placed by the
# memory they share with them (with static sizes the analysis recorded each view's place), and
# for such a base the runtime flips its views' bits, since its memory holds conjugated values:
# eager's values, but a conj bit where eager's view has none.
def _view_bits(out: torch.Tensor, base: torch.Tensor) -> tuple[bool, bool]:
    if not isinstance(out, FunctionalTensor):
        return out.is_conj(), out.is_neg()
    names = [type(m).__name__ for m in torch._C._functionalization.get_view_meta_sequence(out.elem)]
    flips = names.count("_conj_ViewMeta") % 2, names.count("_neg_view_ViewMeta") % 2
    return base.is_conj() != bool(flips[0]), base.is_neg() != bool(flips[1])


# Note [Views cut by no_grad]
# ``with torch.no_grad(): v = y.view(-1)`` then ``v[1:]`` outside: eager's ``v[1:]`` requires
# grad (its base does) and has a grad_fn, but that node's edge stops at ``v``, which has none,
# so no gradient reaches ``y``. Regenerated as a view of ``y`` in grad mode it would pass its
# gradient on (a wrong gradient for whatever made ``y``). Such an output is regenerated under
# no_grad and then viewed once more in grad mode: a view of the base, requiring grad, whose
# chain stops as eager's does.
def _cut_from(out: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``out``'s chain of view nodes stops before reaching ``base``'s history."""
    stop = base.grad_fn
    node = out.grad_fn
    while node is not None and node is not stop:
        edges = [fn for fn, _ in node.next_functions if fn is not None]
        if not edges:
            return type(node).__name__ != "AccumulateGrad"
        if len(edges) != 1:
            return False
        node = edges[0]
    return False


def _non_tensor_info(out: Any) -> OutputInfo:
    if isinstance(out, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return OutputInfo(Alias.NONE, None, False, is_tensor=False)
    return OutputInfo(Alias.CONSTANT, None, False, is_tensor=False, constant=out)


def _static_view(t: torch.Tensor, base: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """Concrete size and stride of a view and its distance in bytes from ``base``'s first
    element, or None when any of them is symbolic. The distance, not the offset: a signature
    holds for inputs at any storage offset (``buf[1:5]`` and ``buf[2:6]`` share a graph). Both
    are read from the values functionalization holds: a view taken after the function mutated
    its base sits in the base's new value, as the runtime's base will after the mutation is
    written back."""
    t, base = from_fun(t), from_fun(base)
    shift = t.storage_offset() * t.element_size() - base.storage_offset() * base.element_size()
    parts = (tuple(t.shape), tuple(t.stride()), shift)
    if all(isinstance(v, int) for v in (*parts[0], *parts[1], shift)):
        return parts  # type: ignore[return-value]
    return None
