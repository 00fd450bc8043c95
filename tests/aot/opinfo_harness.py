"""Eager-parity checks shared by the OpInfo tests and ``scripts/opinfo_sweep.py``.

:func:`check` runs a function eagerly and compiled on independent copies of the same inputs and
compares, against eager: the outputs (values, dtypes, which require grad), the inputs after the
call (in-place ops), and the gradients of every input that requires grad for random cotangents.
:func:`check_backward` runs the forward eagerly twice and compares the gradients of a backward
run under compiled autograd with eager's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

Compile = Callable[[Callable[..., Any]], Callable[..., Any]]

# OpInfo's random ops reseed to 42 inside their own wrapper (wrapper_set_seed), which aotkit
# refuses to trace: the graph draws from the caller's generator. While checking, that wrapper
# calls the op alone and the caller seeds with the same value before each call, eager or not.
SEED = 42


@contextlib.contextmanager
def seeded_by_the_caller() -> Iterator[None]:
    """OpInfo's ``wrapper_set_seed`` without its reseed (see SEED)."""
    from torch.testing._internal import common_methods_invocations as ops

    wrapper = ops.wrapper_set_seed
    ops.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)
    try:
        yield
    finally:
        ops.wrapper_set_seed = wrapper


def supported_ops(dtype: torch.dtype = torch.float32) -> list[Any]:
    """OpInfos with ``dtype`` on CPU and autograd, in ``op_db`` order."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if dtype in op.supported_dtypes("cpu") and op.supports_autograd]


def samples(op: Any, max_samples: int | None = None, dtype: torch.dtype = torch.float32,
            noncontiguous: bool = False) -> Iterator[Any]:
    """The op's CPU samples of ``dtype`` (made non-contiguous if asked), with
    ``requires_grad=True`` where the op differentiates that dtype, reproducibly generated: the
    generator draws from its own seeded RNG state, whatever runs between two samples."""
    outer = torch.get_rng_state()
    torch.manual_seed(SEED)
    differentiable = dtype in op.supported_backward_dtypes("cpu")
    it = iter(op.sample_inputs("cpu", dtype, requires_grad=differentiable))
    state = torch.get_rng_state()
    torch.set_rng_state(outer)
    count = 0
    while max_samples is None or count < max_samples:
        outer = torch.get_rng_state()
        torch.set_rng_state(state)
        try:
            sample = next(it, None)
        finally:
            state = torch.get_rng_state()
            torch.set_rng_state(outer)
        if sample is None:
            return
        count += 1
        yield sample.noncontiguous() if noncontiguous else sample


def first_sample(op: Any) -> Any:
    return next(samples(op, 1))


def sample_call(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (sample.input, *sample.args), dict(sample.kwargs)


def aotkit_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """aotkit's ``aot_function`` over ``fn`` itself: non-tensor arguments are its constants."""
    import aotkit

    return aotkit.aot_function(fn, aotkit.compilers.nop)


def aotkit_min_cut_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`aotkit_compile` with the min-cut rematerialization partitioner."""
    import aotkit

    return aotkit.aot_function(fn, aotkit.compilers.nop,
                               partition_fn=aotkit.partition.min_cut_rematerialization_partition)


def aotkit_dynamic_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`aotkit_compile` with ``dynamic=True``."""
    import aotkit

    return aotkit.aot_function(fn, aotkit.compilers.nop, dynamic=True)


def pytorch_compile(fn: Callable[..., Any], dynamic: bool = False) -> Callable[..., Any]:
    """PyTorch's own ``aot_function`` over a tensors-only wrapper of ``fn`` (the reference)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.compilers import nop

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

        def tensors_only(*tensors: Any) -> Any:
            full = list(leaves)
            for i, t in zip(where, tensors, strict=True):
                full[i] = t
            a, k = pytree.tree_unflatten(full, spec)
            return fn(*a, **k)

        compiled = aot_function(tensors_only, nop, dynamic=dynamic)
        return compiled(*(leaves[i] for i in where))

    return call


def copy_inputs(tree: Any) -> Any:
    """Independent copies of every tensor leaf: same storage layout (strides, offset, overlap),
    same ``requires_grad``, as leaves; tensors that shared storage still share the copy.
    Sparse tensors, which have no single storage, are plain clones."""
    storages: dict[int, torch.UntypedStorage] = {}

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.layout != torch.strided:
            return t.detach().clone().requires_grad_(t.requires_grad)
        key = t.untyped_storage().data_ptr()
        if key not in storages or key == 0:
            storages[key] = t.untyped_storage().clone()
        new = torch.empty(0, dtype=t.dtype, device=t.device)
        new.set_(storages[key], t.storage_offset(), t.size(), t.stride())
        return new.requires_grad_(t.requires_grad)

    return pytree.tree_map(copy, tree)


def forward(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    torch.manual_seed(SEED)
    return fn(*args, **kwargs)


def requires_grad_mask(out: Any) -> list[bool]:
    return [isinstance(o, torch.Tensor) and o.requires_grad for o in pytree.tree_leaves(out)]


def backward(out: Any, inputs: Any, mask: list[bool]) -> list[Any] | None:
    """Grads of the tensors in ``inputs`` that require grad, for seeded random cotangents of
    the flat outputs ``mask`` picks; None when there is nothing to differentiate."""
    picked = [o for o, r in zip(pytree.tree_leaves(out), mask, strict=True) if r]
    wrt = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not picked or not wrt:
        return None
    gen = torch.Generator().manual_seed(SEED)
    cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in picked]
    return list(torch.autograd.grad(picked, wrt, cotangents, allow_unused=True))


class ParityError(AssertionError):
    """The compiled function ran but disagreed with eager."""


class EagerError(RuntimeError):
    """The sample fails in eager PyTorch, so there is nothing to compare against."""


def check_sample(op: Any, sample: Any, compile_fn: Compile = aotkit_compile) -> None:
    """:func:`check` of one OpInfo sample."""
    args, kwargs = sample_call(sample)
    check(op.op, args, kwargs, compile_fn, process=sample.output_process_fn_grad)


def check(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
          compile_fn: Compile = aotkit_compile, process: Callable[[Any], Any] | None = None) -> None:
    """Raise if ``compile_fn(fn)`` differs from eager ``fn`` on ``(args, kwargs)``.

    ``process`` maps an output to what is differentiated (OpInfo's ``output_process_fn_grad``,
    e.g. making eigenvectors phase-invariant). Eager errors raise :class:`EagerError` (the
    sample itself is broken); compiled errors propagate as they are; disagreements raise
    :class:`ParityError` naming what differs.
    """
    with seeded_by_the_caller():
        _check(fn, args, kwargs, compile_fn, process or (lambda out: out))


def _check(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
           compile_fn: Compile, process: Callable[[Any], Any]) -> None:
    eager_inputs = copy_inputs((args, kwargs))
    try:
        expected = forward(fn, *eager_inputs)
        mask = requires_grad_mask(process(expected))
        expected_grads = backward(process(expected), eager_inputs, mask)
    except Exception as exc:
        raise EagerError(f"eager PyTorch fails on this sample: {type(exc).__name__}: {exc}") from exc
    compiled_inputs = copy_inputs((args, kwargs))
    actual = forward(compile_fn(fn), *compiled_inputs)
    same("outputs", actual, expected)
    same("inputs after the call", tensor_leaves(compiled_inputs), tensor_leaves(eager_inputs))
    actual_mask = requires_grad_mask(process(actual))
    if actual_mask != mask:
        raise ParityError(f"outputs requiring grad differ: {actual_mask} (compiled) vs {mask} (eager)")
    same("gradients", backward(process(actual), compiled_inputs, mask), expected_grads)


def aotkit_compiled_autograd() -> contextlib.AbstractContextManager[None]:
    """aotkit's compiled autograd with its nop compiler."""
    import aotkit

    return aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop)


def pytorch_compiled_autograd() -> contextlib.AbstractContextManager[Any]:
    """PyTorch's own compiled autograd running its captured graph as it is (the reference)."""
    from torch._dynamo import compiled_autograd

    return compiled_autograd._enable(lambda gm: gm)


def check_backward_sample(op: Any, sample: Any,
                          enable: Callable[[], Any] = aotkit_compiled_autograd,
                          exact: bool = True) -> None:
    """Raise if a backward of ``op`` on ``sample`` run under ``enable()`` gives other input
    gradients than eager's (other bits when ``exact``: NaNs where eager has them, every other
    value equal). The forward runs eagerly, once for each backward, with the same seed."""
    process = sample.output_process_fn_grad or (lambda out: out)

    def grads(under: Callable[[], Any]) -> list[Any] | None:
        inputs = copy_inputs(sample_call(sample))
        out = process(forward(op.op, *inputs))
        with under():
            return backward(out, inputs, requires_grad_mask(out))

    try:
        expected = grads(contextlib.nullcontext)
    except Exception as exc:
        raise EagerError(f"eager PyTorch fails on this sample: {type(exc).__name__}: {exc}") from exc
    actual = grads(enable)
    same("gradients", actual, expected)
    if exact and not all(_same_bits(a, e) for a, e in zip(
            pytree.tree_leaves(actual), pytree.tree_leaves(expected), strict=True)):
        raise ParityError("gradients are close to eager's but not equal bit for bit")


def _same_bits(a: torch.Tensor | None, e: torch.Tensor | None) -> bool:
    if a is None or e is None:
        return a is e
    if a.layout != torch.strided:
        a, e = a.to_dense(), e.to_dense()
    return torch.equal(a.isnan(), e.isnan()) and torch.equal(a.nan_to_num(), e.nan_to_num())


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def same(what: str, actual: Any, expected: Any) -> None:
    try:
        torch.testing.assert_close(actual, expected, equal_nan=True)
    except AssertionError as exc:
        raise ParityError(f"{what} differ from eager: {exc}") from None
    except (TypeError, ValueError) as exc:  # mismatched structure, e.g. None vs tensor
        raise ParityError(f"{what} differ from eager in structure: {exc}") from None
