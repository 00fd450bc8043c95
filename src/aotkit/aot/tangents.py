"""Tangents: what the traced backward's gradient inputs look like, and where they enter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._prims_common import make_channels_last_strides_for, make_contiguous_strides_for
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from aotkit.aot.analysis import Alias, AotMeta
from aotkit.aot.ops import overlaps_itself
from aotkit.aot.simplify import known_equal
from aotkit.compat import FakeTensor, FunctionalTensor, rename_unbacked_symbol


def tangent_like(out: Any, memory_format: torch.memory_format | None) -> Any:
    """An empty tensor shaped as ``out``'s tangent, in ``memory_format`` (from
    :func:`tangent_formats`); None for a non-tensor."""
    if not isinstance(out, torch.Tensor):
        return None
    return torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=memory_format)


def tangent_formats(meta: AotMeta, fw_outs: Sequence[Any]) -> list[torch.memory_format | None]:
    """The memory format of each forward output's tangent (None: no tensor): see Note [Tangents
    in the outputs' memory format]."""
    formats = [tangent_format(o) if isinstance(o, torch.Tensor) else None for o in fw_outs]
    first_base = len(fw_outs) - len(meta.intermediate_bases_requires_grad)
    users = dict(zip(meta.graph_user_outputs(), fw_outs[len(meta.mutated_inputs):first_base],
                     strict=True))
    views: dict[int, list[Any]] = {}
    for i, out in users.items():
        info = meta.outputs[i]
        if info.alias is Alias.OF_INTERMEDIATE and info.base is not None:
            views.setdefault(info.base, []).append(out)
    for base, outs in views.items():
        if len(outs) == 1 and _slice_or_select(outs[0], fw_outs[first_base + base]):
            formats[first_base + base] = torch.contiguous_format
    return formats


def _slice_or_select(view: Any, base: Any) -> bool:
    """Whether ``view`` looks like a slice or a select of ``base`` (its strides, maybe one
    dropped; fewer elements), whose eager backward fills new zeros of the base's size
    (compared without guards)."""
    if not (isinstance(view, torch.Tensor) and isinstance(base, torch.Tensor)) \
            or not statically_known_true(view.numel() < base.numel()):
        return False
    strides = list(base.stride())
    if view.dim() == base.dim():
        return _stepped(view.stride(), strides)
    return view.dim() == base.dim() - 1 and any(
        _stepped(view.stride(), strides[:k] + strides[k + 1:]) for k in range(base.dim()))


def _stepped(strides: Sequence[Any], base: Sequence[Any]) -> bool:
    """Each stride the base's, or a whole multiple of it (a slice's step; static sizes)."""
    return all(known_equal([s], [b]) or (isinstance(s, int) and isinstance(b, int) and b > 0
                                         and s % b == 0 and s > 0)
               for s, b in zip(strides, base, strict=True))


# Note [Tangents in the outputs' memory format]
# A gradient usually arrives laid out like the output it belongs to (a channels_last
# activation's grad is channels_last). Traced and passed contiguous, every such grad was copied
# before the backward ran, and channels_last kernels (BatchNorm's backward) then ran in another
# layout than eager's, rounding differently. So a tangent is traced in its output's memory
# format, channels_last (3d) or contiguous, and the runtime lays each grad out so (a no-op when
# it already is). With symbolic sizes the strides are compared without adding guards (asking a
# symbolic tensor for its format would add them); a layout they cannot tell is contiguous. An
# intermediate whose one returned view is a slice or a select of it (``h[:, 1:]``, ``h[:, 0]``)
# gets its gradient from eager's view backward, which fills new zeros of its size: contiguous,
# whatever its layout. Other views (permutes, chunks returned together, as_strided) keep the
# intermediate's format; eager's layout for each view op is not mirrored op by op.
def tangent_format(out: torch.Tensor) -> torch.memory_format:
    """The memory format of ``out``'s tangent. See Note [Tangents in the outputs' memory format]."""
    channels_last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(out.dim())
    if out.layout is not torch.strided or channels_last is None:
        return torch.contiguous_format
    if all(isinstance(n, int) for n in (*out.shape, *out.stride())):
        if not out.is_contiguous() and out.is_contiguous(memory_format=channels_last):
            return channels_last
        return torch.contiguous_format
    # Symbolic: strides known to be channels_last's and not known to be contiguous ones,
    # compared without adding a guard.
    strides = out.stride()
    if known_equal(strides, make_channels_last_strides_for(out.shape)) and not known_equal(
            strides, make_contiguous_strides_for(out.shape)):
        return channels_last
    return torch.contiguous_format


# Note [Gradients entering through a view]
# A view of an intermediate the function returns is made again from the intermediate after
# the graph (Note [Replaying views]); the graph returns the intermediate, whose tangent
# the engine seeds before any gradient the graph's own ops send it. Eager's engine adds the
# view's gradient where the view was taken: after those of every later use of the
# intermediate. ``logits = linear(x)`` returned and also fed to two losses summed
# ``(g_view + g_a) + g_b`` against eager's ``(g_b + g_a) + g_view``: gradients one or two
# float32 ulps off, and far more in bfloat16. Where one output alone views an intermediate,
# every element of it once (a reshape, a transpose, a complex number's real view; not a slice,
# an expand), the graph takes that view of the intermediate's tangent and lets the gradient
# enter through the output itself, at eager's place. Such a view maps elements one to one,
# so the view of the tangent is the output's gradient exactly, plus what the caller sent
# through ``out._base``, which the view's backward in the graph maps back as it came. (A
# slice would drop that: its tangent still enters at the intermediate.)
def through_lone_views(fw_outs: list[Any], tangents: list[Any], differentiable: list[bool],
                        meta: AotMeta) -> tuple[list[Any], list[Any]]:
    """The differentiable outputs and their tangents, a base with one output viewing it
    replaced by that output and the view of its tangent (Note [Gradients entering through a
    view])."""
    outs = [o for o, d in zip(fw_outs, differentiable, strict=True) if d]
    tangents = list(tangents)
    first_base = len(outs) - sum(meta.intermediate_bases_requires_grad)
    graph_outs = fw_outs[len(meta.mutated_inputs):len(meta.mutated_inputs)
                         + len(meta.graph_user_outputs())]
    views: dict[int, list[Any]] = {}
    for out, i in zip(graph_outs, meta.graph_user_outputs(), strict=True):
        info = meta.outputs[i]
        if info.alias is Alias.OF_INTERMEDIATE:
            views.setdefault(info.base, []).append(out)  # type: ignore[arg-type]
    k = first_base
    for base, needs_grad in enumerate(meta.intermediate_bases_requires_grad):
        if not needs_grad:
            continue
        [view, *more] = views[base]
        if not more and _replayable_on(view, outs[k], tangents[k]):
            outs[k] = view
            tangents[k] = torch._C._functionalization.apply_view_meta_sequence(
                tangents[k], _view_ops(view))
        k += 1
    return outs, tangents


def _view_ops(view: FunctionalTensor) -> list[Any]:
    return torch._C._functionalization.get_view_meta_sequence(view.elem)


def _replayable_on(view: Any, base: Any, tangent: Any) -> bool:
    """Whether ``base``'s tangent viewed as ``view`` views ``base`` is ``view``'s gradient: a
    differentiable view of every element once, of a base laid out as its tangent (which the
    runtime lays out as traced), through view ops that do not name strides."""
    return view.requires_grad and view.grad_fn is not None and not overlaps_itself(view) \
        and statically_known_true(view.numel() * view.element_size()
                                  == base.numel() * base.element_size()) \
        and known_equal(base.stride(), tangent.stride()) \
        and not any("as_strided" in type(m).__name__ for m in _view_ops(view))


# Note [Tangents of data-dependent sizes]
# A tangent is shaped like the metadata pass's output: a size read from data there is that pass's
# unbacked symbol (u1), while the joint's forward makes its own (u2), see
# _discarding_unbacked_symbols. Where the size is the symbol itself (``nonzero``'s count) the
# backward binds it from the tangent; where it is an expression (``cat`` of a ``masked_select``
# and 5 elements: u1 + 5) nothing binds u1, and Inductor's code for the backward fails. The two
# sizes are one value, so the ShapeEnv is told u1 is u2, which the forward binds and saves
# (Note [Binding symbols in the backward]); several symbols pair by creation order.
def name_tangent_sizes_after_outputs(gm: fx.GraphModule, num_tangents: int,
                                     differentiable: list[bool]) -> None:
    if num_tangents == 0:
        return
    tangents = gm.graph.find_nodes(op="placeholder")[-num_tangents:]
    outputs = gm.graph.output_node().args[0]
    fw_outs = [o for o, d in zip(outputs, differentiable, strict=False) if d]
    for tangent, out in zip(tangents, fw_outs, strict=True):
        t_val, o_val = tangent.meta.get("val"), getattr(out, "meta", {}).get("val")
        if not (isinstance(t_val, FakeTensor) and isinstance(o_val, torch.Tensor)):
            continue
        shape_env = t_val.fake_mode.shape_env
        for t_size, o_size in zip(t_val.shape, o_val.shape, strict=True):
            if isinstance(t_size, torch.SymInt) and isinstance(o_size, torch.SymInt):
                _rename_if_same_but_symbol(shape_env, t_size.node.expr, o_size.node.expr)


def _rename_if_same_but_symbol(shape_env: Any, t_expr: Any, o_expr: Any) -> None:
    """Both passes make their data-dependent sizes in the same order (the same ops run), so the
    metadata pass's symbols pair with the forward's by creation order (u0, u1 -> u2, u3)."""
    only_t = sorted(free_unbacked_symbols(t_expr) - free_unbacked_symbols(o_expr), key=_made)
    only_o = sorted(free_unbacked_symbols(o_expr) - free_unbacked_symbols(t_expr), key=_made)
    renames = dict(zip(only_t, only_o, strict=False))
    if only_t and len(only_t) == len(only_o) and t_expr.xreplace(renames) == o_expr:
        for old, new in renames.items():
            rename_unbacked_symbol(shape_env, old, new)


def _made(symbol: Any) -> int:
    """Creation index of an unbacked symbol (u12 -> 12; the equality check guards the rest)."""
    digits = symbol.name.lstrip("abcdefghijklmnopqrstuvwxyz")
    return int(digits) if digits.isdigit() else -1
