"""How particular ATen ops are traced: eager's checks that functionalization drops (writes to
overlapping memory, dtypes of results written in place), eager's random streams (dropout), and
ops FX cannot print. Used by :mod:`aotkit.aot.trace` while it traces."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false, suggest_memory_format
from torch.utils import _pytree as pytree

from aotkit.aot.frames import current_user_line
from aotkit.errors import UnsupportedError


# Note [Writes to overlapping memory]
# A write through an expand()ed view (stride 0, size > 1) hits one element several times. Eager
# raises for most ops ("more than one element of the written-to tensor refers to a single memory
# location"), but not for fill_, zero_, index_put_ or masked_fill_. Functionalization turns any
# such write into a new value for the view and regenerates the base from it by summing over the
# expanded dimension: `x.expand(3).fill_(1)` leaves x == 3, where eager leaves 1. Both PyTorch's
# aot_function and ours gave that silently; now every write to a self-overlapping tensor is
# refused while tracing, with the fix eager's own warning suggests.
def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether several elements of ``t`` share memory: the case eager's overlap check detects."""
    return any(
        isinstance(stride, int) and stride == 0 and size > 1
        for size, stride in zip(t.shape, t.stride(), strict=True)
    ) and t.numel() > 0


def written_by(func: torch._ops.OpOverload, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors ``func`` writes to, from its schema (``Tensor(a!)``)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        written += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


# Note [Dtypes of out= arguments]
# Functionalization turns ``torch.mul(a, b, out=o)`` into ``mul`` and a copy into o, and a copy
# casts: an int64 ``o`` silently got float results truncated, where eager refuses ("result type
# Float can't be cast to the desired output type Long"). Before such an op is functionalized it
# runs on meta tensors of the same dtypes and ranks (one element per dimension), which raise
# eager's dtype errors; errors about anything else are left to the traced op. (Torch.compile's
# fake tensors run out= ops unfunctionalized, so Dynamo graphs never reach this.) In-place ops
# likewise: ``int_tensor.mul_(2.5)`` became ``mul`` and a truncating copy, ``bool.mul_(2)`` and
# ``half.mul_(1j)`` too, so an in-place op given an argument of another dtype (a float scalar
# for an integer tensor, a wider tensor) runs the same way, on one-element CPU tensors: meta
# kernels of in-place ops skip the cast check. Random ops are left out (they would draw).
def writes_out_argument(func: torch._ops.OpOverload) -> bool:
    return any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
               for a in func._schema.arguments)


def may_not_cast_in_place(func: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    """An in-place op whose other arguments have another dtype than ``self`` (a Python float
    for an integer tensor): its result may not cast back (Note [Dtypes of out= arguments])."""
    schema = func._schema.arguments
    if not (args and schema and schema[0].alias_info is not None and schema[0].alias_info.is_write
            and isinstance(args[0], torch.Tensor)) or torch.Tag.inplace_view in func.tags \
            or torch.Tag.nondeterministic_seeded in func.tags \
            or func.overloadpacket is torch.ops.aten.copy_:
        return False
    dtype = args[0].dtype
    return any(x.dtype != dtype if isinstance(x, torch.Tensor) else _wider_scalar(x, dtype)
               for x in (*args[1:], *kwargs.values()))


def _wider_scalar(x: Any, dtype: torch.dtype) -> bool:
    """A Python number of a kind ``dtype`` cannot hold (a float for an integer tensor)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return dtype is torch.bool
    if isinstance(x, float):
        return not (dtype.is_floating_point or dtype.is_complex)
    return isinstance(x, complex) and not dtype.is_complex


def check_out_dtype(func: torch._ops.OpOverload, args: Any, kwargs: Any, device: str) -> None:
    """See Note [Dtypes of out= arguments]."""
    from torch.utils._python_dispatch import _disable_current_modes

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.zeros((1,) * x.dim(), dtype=x.dtype, device=device)
        return x

    with _disable_current_modes():
        try:
            func(*pytree.tree_map(meta, args), **pytree.tree_map(meta, kwargs))
        except (RuntimeError, TypeError) as exc:
            if "cast" in str(exc) or "dtype" in str(exc):
                raise RuntimeError(f"{exc}\n  at {current_user_line()}") from None
        except Exception:  # not a dtype error: the traced op reports it
            pass


class EagerDropout(torch.overrides.TorchFunctionMode):
    """Training-mode dropout traced to give eager's values and gradients.

    ``aten.native_dropout`` draws the same random numbers as eager's dropout, on a mask laid out
    like the input. Traced without the Python dispatcher, ``aten.dropout``'s C++ composite would
    draw them with a functional ``bernoulli`` laid out contiguously: for a non-contiguous input
    (a transposed attention output) they would land on other elements than in eager. Eager's
    CPU dropout multiplies the input by a noise tensor of the input's dtype (``1 / (1 - p)``
    rounded to it) and its backward multiplies the gradient by that noise; native_dropout's
    backward scales in float, which rounds differently in bfloat16 and float16, so there the
    noise is traced as eager makes it. Eval mode and p in {0, 1} keep the composite (eager
    returns the input itself).
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout or func is torch.dropout:
            call = _DROPOUT_SIGNATURES[func].bind(*args, **kwargs).arguments
            p, train, x = call["p"], call.get("training", call.get("train")), call["input"]
            if train and not call.get("inplace") and 0 < p < 1:
                out, mask = torch.ops.aten.native_dropout.default(x, p, True)
                if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
                    return x * mask.to(x.dtype).div(1 - p)
                return out
        return func(*args, **kwargs)


def _dropout_signatures() -> dict[Any, inspect.Signature]:
    def vf_dropout(input: Any, p: float, train: bool) -> Any: ...

    return {torch.nn.functional.dropout: inspect.signature(torch.nn.functional.dropout),
            torch.dropout: inspect.signature(vf_dropout)}


_DROPOUT_SIGNATURES = _dropout_signatures()


# Note [Ops FX cannot print]
# FX prints an ATen call as ``torch.ops.aten.random.from(...)``, which is no Python when the
# overload's name is a keyword: ``x.random_(0, 10)`` failed to trace with a SyntaxError. Such an
# overload is decomposed into ops FX can print that draw the same numbers: ATen's kernel takes
# one draw modulo ``to - from`` (the same draw whatever the dtype), adds ``from`` in 64-bit
# integers and casts, so ``random.to`` on an int64 tensor laid out like ``x``, plus ``from``,
# cast to ``x``'s dtype, is eager's result bit for bit; eager's argument checks are repeated.
# A user's decomposition wins.
def _random_from(x: torch.Tensor, start: int, end: int | None, *,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    if end is None or end - start > torch.iinfo(torch.int64).max:
        raise UnsupportedError(
            f"random_({start}, {end}) cannot be traced: FX cannot print aten.random.from, and "
            "no other op draws a range this wide.\nFix: pass an upper bound less than 2**63 "
            "above the lower one.")
    _check_random_range(start, end, x.dtype)
    draws = torch.ops.aten.random.to(torch.empty_like(x, dtype=torch.int64), end - start,
                                     generator=generator)
    return (draws + start).to(x.dtype)


def _check_random_range(start: int, end: int, dtype: torch.dtype) -> None:
    """Eager's checks of ``random_(from, to)``; beyond the integers a floating dtype holds
    exactly, where eager only warns, its draws are not reproduced: refused."""
    if start >= end:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={start} "
                           f">= to={end}")
    if dtype.is_floating_point:
        digits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # 24 for float32
        if start < -(2**digits) or end - 1 > 2**digits:
            raise UnsupportedError(
                f"random_({start}, {end}) on a {dtype} tensor reaches beyond the integers "
                f"{dtype} holds exactly (±2**{digits}), where eager warns "
                "and its draws cannot be traced.\nFix: draw into an int64 tensor and convert, "
                "or use a narrower range.")
        return
    low, high = (0, 1) if dtype is torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if not low <= start <= high:
        raise RuntimeError(f"from is out of bounds for {dtype}")
    if not low <= end - 1 <= high:
        raise RuntimeError(f"to - 1 is out of bounds for {dtype}")


# Note [Batch norm kernels and dense layouts]
# A graph is traced on fake tensors and later ops are chosen from the strides the fake kernels
# give (``linear`` on a 3-d tensor becomes ``view`` + ``mm`` only where a view is possible). For
# an input that is dense but in no standard memory format (``h.transpose(1, 2)``, the usual way
# to feed BatchNorm1d a (batch, time, channels) tensor), batch norm's fake kernels keep the
# input's stride order while the real CPU kernels (forward and backward) return the input's
# suggested memory format (contiguous). The graph's ``view`` then failed at run time ("view
# size is not compatible"), with PyTorch's aot_function and aot_eager too. Such an input is
# made contiguous in that format before the op, in the graph: what the real kernel does
# inside anyway, and the fake output's strides are then the real ones. This happens in the
# tracing guard's dispatch (aotkit.aot.trace), so the metadata pass, which runs no
# decompositions, sees the layouts the graph will have.
def _in_eager_layout(t: Any) -> Any:
    if not isinstance(t, torch.Tensor) or not is_non_overlapping_and_dense_or_false(t):
        return t
    layout = suggest_memory_format(t)
    return t if t.is_contiguous(memory_format=layout) else t.contiguous(memory_format=layout)


_aten = torch.ops.aten
_BATCH_NORM_OPS = {  # op: how many leading tensor arguments the kernel lays its result out by
    _aten.native_batch_norm.default: 1,
    _aten._native_batch_norm_legit.default: 1,
    _aten._native_batch_norm_legit.no_stats: 1,
    _aten._native_batch_norm_legit_functional.default: 1,
    _aten._native_batch_norm_legit_no_training.default: 1,
    _aten.native_batch_norm_backward.default: 2,  # grad_out and input
}


def in_eager_layout(func: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``func``'s arguments, laid out as its real kernel lays out its result where its fake
    kernel would not (Note [Batch norm kernels and dense layouts])."""
    count = _BATCH_NORM_OPS.get(func)
    if count is None:
        return args
    return (*(_in_eager_layout(a) for a in args[:count]), *args[count:])


PRINTABLE_DECOMPOSITIONS = {getattr(_aten.random, "from"): _random_from}
