"""Run a function eagerly and through aotkit on cloned inputs and compare everything a user sees:
outputs (values, dtypes, shapes, strides, requires_grad), how outputs alias inputs and each other,
the inputs' values and metadata after the call (mutations), and input gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

import aotkit
from aotkit import compilers


@dataclass
class Compared:
    """Both runs of one comparison, for tests that check more afterwards."""

    compiled: Any
    eager_out: Any
    aot_out: Any
    eager_args: Any  # the (args, kwargs) each side was called with, after the call
    aot_args: Any
    eager_leaves: Any  # the cloned (args, kwargs) before ``prepare``: where gradients land
    aot_leaves: Any


def clone_inputs(tree: Any) -> Any:
    """Fresh leaf copies of every tensor in ``tree`` (same requires_grad), other leaves as they are."""

    def clone(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    return pytree.tree_map(clone, tree)


def tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def rand(*shape: int, grad: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def assert_write_through(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out`` is a real alias of ``x``: same storage, and writing into it changes ``x``."""
    assert storage(out) == storage(x)
    before = x.detach().clone()
    with torch.no_grad():
        out.fill_(42.0)
    assert (x != before).any(), "writing into the output did not change the input"


class AccumulateInBackward(torch.autograd.Function):
    """Doubles ``x``; its backward adds the gradient's sum into ``stats``, which it saved (a
    running statistic the backward writes)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(stats)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (stats,) = ctx.saved_tensors
        stats.add_(grad.sum())
        return grad * 2, None


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def alias_pattern(outs: list[Any], ins: list[torch.Tensor]) -> list[Any]:
    """For each output: which inputs and outputs it *is*, which of them share its storage."""
    pattern = []
    for k, out in enumerate(outs):
        if not isinstance(out, torch.Tensor) or out.numel() == 0:
            pattern.append(None)
            continue
        pattern.append((
            [i for i, x in enumerate(ins) if x is out],
            [j for j, o in enumerate(outs) if j != k and o is out],
            [i for i, x in enumerate(ins) if x.numel() and storage(x) == storage(out)],
            [j for j, o in enumerate(outs) if j != k and isinstance(o, torch.Tensor)
             and o.numel() and storage(o) == storage(out)],
        ))
    return pattern


def assert_same_values(actual: Any, expected: Any, what: str) -> None:
    """Same pytree structure; tensors equal in value, dtype, shape, stride and requires_grad."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"{what}: structure {a_spec} != eager {e_spec}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        where = f"{what} leaf {i}"
        assert type(a) is type(e) or (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)), (
            f"{where}: {type(a).__name__} != eager {type(e).__name__}")
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, msg=lambda m, w=where: f"{w}: {m}")
            assert a.shape == e.shape, f"{where}: shape {a.shape} != eager {e.shape}"
            assert a.stride() == e.stride(), f"{where}: stride {a.stride()} != eager {e.stride()}"
            assert a.storage_offset() == e.storage_offset(), f"{where}: storage offset differs"
            assert a.requires_grad == e.requires_grad, (
                f"{where}: requires_grad {a.requires_grad} != eager {e.requires_grad}")
        else:
            assert a == e, f"{where}: {a!r} != eager {e!r}"


def random_grads(outs: list[Any], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors that require grad and one random grad_output each (own generator)."""
    gen = torch.Generator().manual_seed(seed)
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in diff]
    return diff, grads


def check_against_eager(
    fn: Callable[..., Any],
    *args: Any,
    prepare: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
    seed: int | None = None,
    backward: bool = True,
    compiler: Callable[..., Any] = compilers.nop,
    aot_kwargs: dict[str, Any] | None = None,
    calls: int = 2,
    context: Callable[[], Any] = contextlib.nullcontext,
    **kwargs: Any,
) -> Compared:
    """Run ``fn`` eagerly and through ``aotkit.aot_function(fn, compiler)`` on input clones.

    The comparison runs ``calls`` times with one compiled function, so both the call that traces
    and the calls that reuse the compiled entry are checked. ``prepare(args, kwargs)`` turns the
    cloned leaves into the call arguments (e.g. non-leaf tensors); gradients are compared on the
    leaves. ``seed`` seeds the global RNG before each run. ``context()`` wraps each call (not the
    backward), e.g. ``torch.no_grad``. Returns the last comparison.
    """
    compiled = aotkit.aot_function(fn, compiler, **(aot_kwargs or {}))
    for _ in range(calls):
        result = compare_once(fn, compiled, args, kwargs, prepare, seed, backward, context)
    return result


def check_compiled(fn: Callable[..., Any], compiled: Any, *args: Any) -> Compared:
    """Compare one call of an already compiled ``compiled`` with ``fn`` on clones of ``args``:
    outputs, aliasing, inputs after the call and gradients."""
    return compare_once(fn, compiled, args, {}, None, None, True, contextlib.nullcontext)


def compare_once(fn: Callable[..., Any], compiled: Any, args: Any, kwargs: Any,
                  prepare: Any, seed: int | None, backward: bool, context: Any) -> Compared:
    sides = []
    for run in (fn, compiled):
        leaves = clone_inputs((args, kwargs))
        call_args, call_kwargs = prepare(*leaves) if prepare else leaves
        if seed is not None:
            torch.manual_seed(seed)
        with context():
            out = run(*call_args, **call_kwargs)
        sides.append((out, (call_args, call_kwargs), leaves))
    (e_out, e_args, e_leaves), (a_out, a_args, a_leaves) = sides

    assert_same_values(a_out, e_out, "output")
    e_flat, a_flat = pytree.tree_leaves(e_out), pytree.tree_leaves(a_out)
    assert alias_pattern(a_flat, tensors(a_args)) == alias_pattern(e_flat, tensors(e_args)), (
        "outputs alias inputs or each other differently from eager")
    assert_same_values(a_args, e_args, "input after the call")
    if backward:
        _compare_grads(e_flat, e_args, e_leaves, a_flat, a_args, a_leaves)
    return Compared(compiled, e_out, a_out, e_args, a_args, e_leaves, a_leaves)


def _compare_grads(e_flat: list[Any], e_args: Any, e_leaves: Any,
                   a_flat: list[Any], a_args: Any, a_leaves: Any) -> None:
    # Non-leaf inputs join in: their autograd history after the call (mutations) must match.
    for outs, call in ((e_flat, e_args), (a_flat, a_args)):
        later = [x for x in tensors(call) if x.requires_grad and not x.is_leaf]
        diff, grads = random_grads([*outs, *later], seed=1234)
        if diff:
            torch.autograd.backward(diff, grads)
    for i, (a, e) in enumerate(zip(tensors(a_leaves), tensors(e_leaves), strict=True)):
        if e.requires_grad and e.is_leaf:  # a mutation can make a leaf input a non-leaf
            assert (a.grad is None) == (e.grad is None), f"grad of input {i}: None differs"
            if e.grad is not None:
                torch.testing.assert_close(a.grad, e.grad, msg=lambda m, i=i: f"grad of input {i}: {m}")


class RecordingCompiler:
    """A nop compiler that keeps every graph and example inputs it was given."""

    def __init__(self, name: str = "recording") -> None:
        self.__name__ = name
        self.graphs: list[torch.fx.GraphModule] = []
        self.example_inputs: list[list[Any]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs.append(gm)
        self.example_inputs.append(list(example_inputs))
        return aotkit.make_boxed_func(gm.forward)

    @property
    def calls(self) -> int:
        return len(self.graphs)
