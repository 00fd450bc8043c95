"""Outputs that alias an input, another output or an intermediate, made into real views of it
after the compiled Function ran (Note [Aliased outputs] in aotkit.aot.analysis)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aotkit.aot.analysis import OutputInfo, laid_out_alike
from aotkit.errors import CompilerError, UnsupportedError


@dataclass
class ViewSource:
    """What an aliased output is regenerated from: its base, and for a view of an input that
    the function also mutates, the graph's new value of that input (see ``_view_of_new_value``)."""

    base: torch.Tensor
    new_value: torch.Tensor | None = None
    input_index: int | None = None


def regenerate_view(source: ViewSource, out: torch.Tensor, info: OutputInfo, name: str) -> torch.Tensor:
    """``out`` as a real view of ``source.base`` with the autograd link eager would give it."""
    base = source.base
    if not info.is_view:  # ``x.detach()``, ``x[1:].detach()``: shares memory, is no view
        return _as_view(source, out, info, name).detach().requires_grad_(info.requires_grad)
    if info.cut_view and base.requires_grad:  # Note [Views cut by no_grad]
        with torch.no_grad():
            view = _as_view(source, out, info, name)
        return view.view_as(view)
    if info.linked or not base.requires_grad:
        view = _as_view(source, out, info, name)
        return view.requires_grad_() if info.made_leaf else view  # ``x.detach()[0].requires_grad_()``
    if info.no_grad_view:  # eager: requires_grad, no grad_fn, still a view of base
        with torch.no_grad():
            return _as_view(source, out, info, name)
    # ``x.detach()[0]`` (maybe ``.requires_grad_()`` after): a view, no autograd link
    detached = ViewSource(base.detach(), source.new_value, source.input_index)
    return _as_view(detached, out, info, name).requires_grad_(info.requires_grad)


# Note [Conjugate and negative views]
# ``x.conj()`` and ``x.conj().imag`` are views whose values are their storage's conjugated or
# negated: the conj/neg bit belongs to the tensor, not the storage, and as_strided drops it.
# So the view is regenerated from the base with its bits cleared (the storage's own values, still
# through views autograd follows) and eager's bits, recorded by the analysis, are set again.
def _as_view(source: ViewSource, out: torch.Tensor, info: OutputInfo, name: str) -> torch.Tensor:
    if _replayable(out, source, info):
        return out._view_func_unsafe(source.base)
    if info.replay_only:
        return _replayed_on_input(source, out, info)
    return _strided(source.base, out.dtype, *_place(source, out, info, name))


def view_taken_from(taken: torch.Tensor, source: ViewSource, out: torch.Tensor, info: OutputInfo,
                    name: str) -> torch.Tensor:
    """The view ``source`` would give (a plain linked view), made from ``taken``, a returned
    view it was taken from that shares its memory (Note [Views taken from returned views])."""
    return _strided(taken, out.dtype, *_place(source, out, info, name))


def elements_apart(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory: none, or each stride, smallest first,
    passes the span of the smaller ones (interleaved strides, ``as_strided((3, 2), (2, 3))``,
    count as sharing)."""
    if t.numel() == 0:
        return True
    span = 0
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1):
        if stride <= span:
            return False
        span += (size - 1) * stride
    return True


def _place(source: ViewSource, out: torch.Tensor, info: OutputInfo,
           name: str) -> tuple[tuple[Any, Any, int], bool, bool]:
    """Where ``out`` sits in its base's storage (size, stride, offset) and its conj/neg bits."""
    geometry = _placement(source, out, info, name)
    # A view of memory the graph made (an output or intermediate base) shows its values as the
    # graph's own output does: an op may return a root with a bit (dot of two conjugates holds
    # the unconjugated product, its bit set, as in eager), or the graph a base eager had
    # without one (its views then flip the bit).
    made_inside = source.input_index is None
    if made_inside and same_storage(out, source.base):
        return geometry, out.is_conj(), out.is_neg()
    return (geometry, info.is_conj != (made_inside and source.base.is_conj()),
            info.is_neg != (made_inside and source.base.is_neg()))


def _strided(base: torch.Tensor, dtype: torch.dtype, geometry: tuple[Any, Any, int], conj: bool,
             neg: bool) -> torch.Tensor:
    """The view of ``base``'s storage at ``geometry``, in ``dtype``, with these bits."""
    plain = _plain(base)
    if plain.dtype != dtype:  # ``x.imag``, ``view_as_real(x)``
        plain = _reinterpret(plain, dtype)
    return _with_bits(plain.as_strided(*geometry), conj, neg)


def _with_bits(view: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    """``view`` (of a storage's values as they are) with conj/neg bits set as asked."""
    view = torch._neg_view(view) if neg else view
    return view.conj() if conj else view


# Note [Replaying views]
# A view regenerated with as_strided gets AsStridedBackward0, whose gradient scatters into a
# zero-filled copy of the whole base: slower than eager's view backward (a transpose, a sum for
# an expand), and for an overlapping view (expand) summed in another order than eager's. When the
# compiled graph made the output with view ops straight from the very tensor it views (the nop
# compiler runs ATen's view ops), the forward runs with view functions recorded, and the
# epilogue replays that chain on the base outside the Function: the caller gets eager's own view
# nodes (ExpandBackward0, TransposeBackward0). Anything else (a view of a view input, of an input
# the function mutates, dtype or conj/neg views, compilers whose outputs carry no view function)
# keeps as_strided.
def _replayable(out: torch.Tensor, source: ViewSource, info: OutputInfo) -> bool:
    base = source.base
    return (source.new_value is None and out._is_view() and out._base is base
            and out.dtype == base.dtype
            and not (info.is_neg or info.is_conj or base.is_conj() or base.is_neg()))


def _replayed_on_input(source: ViewSource, out: torch.Tensor, info: OutputInfo) -> torch.Tensor:
    """See Note [Views of inputs with gaps]; the runtime (``_refuse_unplaceable_views``) checked it can."""
    new = source.new_value
    if out._is_view() and out._base is new:
        return out._view_func_unsafe(source.base)
    # the whole input (``x[...]``, ``x.detach()`` after writing x): a view of its own, in the
    # output's dtype (``x.view(torch.int32)``), not the caller's tensor itself
    base = _plain(source.base)
    view = base.view_as(base) if out.dtype == base.dtype else base.view(out.dtype)
    return _with_bits(view, info.is_conj, info.is_neg)  # Note [Conjugate and negative views]


def replayable_on_input(new: Any, out: torch.Tensor) -> bool:
    return new is not None and ((out._is_view() and out._base is new) or (
        same_storage(out, new) and (out.shape, out.stride(), out.storage_offset())
        == (new.shape, new.stride(), new.storage_offset())))


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without conj/neg bits: a view showing its storage's values as they are."""
    if t.is_conj():
        t = t.conj()
    return torch._neg_view(t) if t.is_neg() else t


def _placement(source: ViewSource, out: torch.Tensor, info: OutputInfo,
               name: str) -> tuple[Any, Any, int]:
    """Size, stride and storage offset of ``out`` within its base's storage."""
    if same_storage(source.base, out):
        return out.size(), out.stride(), out.storage_offset()
    if info.static_view is not None:
        size, stride, shift = info.static_view
        start = source.base.storage_offset() * source.base.element_size()
        return size, stride, (start + shift) // out.element_size()
    if source.new_value is not None and same_storage(source.new_value, out):
        return _view_of_new_value(source, out, name)
    raise CompilerError(
        f"{name}: an output that views another tensor came back from the compiled graph in "
        "memory of its own, and with symbolic sizes aotkit cannot find its place in the tensor it "
        "views. This happens with keep_inference_input_mutations=True for a view that changes "
        "the dtype (x.view(torch.int32), view_as_real) of a mutated input, or with a compiler "
        "that copies its outputs (Inductor). The input has been written already.\nFix: clone "
        "the output in the function, compile with dynamic=False (or without "
        "keep_inference_input_mutations), or, under torch.compile, use backend='aotkit'."
    )


# Note [Views of mutated inputs under dynamic shapes]
# When the function mutates input x and returns a view of it, the graph computes x's new value
# as a fresh tensor and the view from that tensor, not from x. The epilogue copies the new value
# into x and needs the view's place in x's storage: with static shapes the analysis recorded it;
# with symbolic sizes it did not, but the graph's new value and view are real tensors here. When
# the new value is laid out like x (same sizes and strides), each element sits at the same
# distance from its tensor's start in both storages, so the view moves by the difference of
# the two storage offsets.
def _view_of_new_value(source: ViewSource, out: torch.Tensor, name: str) -> tuple[Any, Any, int]:
    new, base = source.new_value, _plain(source.base)
    assert new is not None
    if not (new.dtype == base.dtype and new.size() == base.size() and laid_out_alike(new, base)):
        raise UnsupportedError(
            f"{name}: an output is a view of input {source.input_index}, which the function "
            "also mutates in place; with dynamic shapes aotkit finds the view's place in the "
            "input from the graph's new value of that input, but the compiled graph laid that "
            f"value out differently (sizes {tuple(new.size())}, strides {new.stride()}) from "
            f"the input (sizes {tuple(base.size())}, strides {base.stride()}).\nFix: compile "
            "with dynamic=False, or return a clone of the view (out.clone())."
        )
    # Offsets count elements of each tensor's own dtype: move by bytes, in out's elements.
    shift = (base.storage_offset() - new.storage_offset()) * base.element_size()
    return out.size(), out.stride(), out.storage_offset() + shift // out.element_size()


def _reinterpret(base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole storage of ``base`` as one flat tensor of ``dtype``, for views that change the
    dtype (``view_as_real``, ``Tensor.view(dtype)``); as_strided alone cannot. A tail too
    short for an element of the wider dtype is left out (a 7-float storage as complex)."""
    unit = max(base.element_size(), dtype.itemsize)
    size = base.untyped_storage().nbytes() // unit * unit // base.element_size()
    flat = base.as_strided((size,), (1,), 0)
    # view_as_real / view_as_complex where autograd differentiates them (half, float, double
    # parts); a plain dtype view otherwise (an int32 input seen as complex64, as eager allows)
    if flat.is_complex() and not dtype.is_complex and dtype in _COMPLEX_PARTS:
        flat = torch.view_as_real(flat).flatten()
    elif dtype.is_complex and flat.dtype in _COMPLEX_PARTS:
        flat = torch.view_as_complex(flat.view(-1, 2))
    return flat if flat.dtype == dtype else flat.view(dtype)


_COMPLEX_PARTS = (torch.float16, torch.float32, torch.float64)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
