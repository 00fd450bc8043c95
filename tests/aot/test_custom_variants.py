"""Custom autograd.Functions in backwards that bring gradients for some outputs only (Note
[Custom backwards run on zeros]): values and None-ness as in eager."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

import aotkit
from aotkit import compilers


def _grads(fn: Callable[..., Sequence[torch.Tensor]], used: Sequence[int],
           make: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor | None]:
    inputs = make()
    outs = fn(*inputs)
    sum(outs[i].sum() for i in used).backward()
    return [t.grad for t in inputs]


def _assert_same(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> None:
    assert [g is None for g in got] == [w is None for w in want]
    for g, w in zip(got, want, strict=True):
        if w is not None:
            torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)


def _make(materialize: bool) -> type[torch.autograd.Function]:
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            if not materialize:
                ctx.set_materialize_grads(False)
            ctx.save_for_backward(y)
            return x * 3, y * 2 + x

        @staticmethod
        def backward(ctx, ga, gb):
            (y,) = ctx.saved_tensors
            if gb is None:
                return ga * 3, None
            return ga * 3 + gb / y, gb * 2

    return Fn


_MATERIALIZED, _GIVEN_NONE = _make(True), _make(False)


def _both_kinds(x1, y1, x2, y2, y):
    a1, b1 = _MATERIALIZED.apply(x1, y1)
    a2, b2 = _GIVEN_NONE.apply(x2, y2)
    a3, b3 = _MATERIALIZED.apply(x1, y)  # the same ops as the other kind's below
    a4, b4 = _GIVEN_NONE.apply(x2, y)
    return a1 + a2 + a3 + a4, b1 + b2 + b3 + b4


def _five() -> list[torch.Tensor]:
    x1, x2 = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    y1, y2 = (torch.tensor([1.0, 2.0, 3.0], requires_grad=True) for _ in range(2))
    return [x1, y1, x2, y2, torch.tensor([0.0, 1.0, 2.0])]


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_common_ops_of_two_kinds_of_custom_backward_stay_apart(partition: str) -> None:
    """Min-cut's CSE merged an op of a custom backward given zeros with the same op of one
    given None: one of them took the other's kind (None for zeros, NaN dropped)."""
    kw = {"partition_fn": aotkit.min_cut_rematerialization_partition} if partition == "min_cut" else {}
    compiled = aotkit.aot_function(_both_kinds, compilers.nop, **kw)
    _assert_same(_grads(compiled, [0], _five), _grads(_both_kinds, [0], _five))


class _MaterializedAgain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.set_materialize_grads(False)
        ctx.set_materialize_grads(True)  # eager gives zeros again
        ctx.save_for_backward(y)
        return x * 2, y * 3

    @staticmethod
    def backward(ctx, ga, gb):
        (y,) = ctx.saved_tensors
        return ga * 2 + gb / y, gb * 3


def test_materialize_grads_set_back_to_true_gives_zeros() -> None:
    def make() -> list[torch.Tensor]:
        return [torch.ones(3, requires_grad=True), torch.tensor([0.0, 1.0, 2.0], requires_grad=True)]

    compiled = aotkit.aot_function(_MaterializedAgain.apply, compilers.nop)
    for used in ([0], [1]):
        _assert_same(_grads(compiled, used, make), _grads(_MaterializedAgain.apply, used, make))


class _Affine3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, z):
        return x * 2, y * 3, z * 4

    @staticmethod
    def backward(ctx, ga, gb, gc):
        return ga * 2 + 1, gb * 3 + 1, gc * 4 + 1


def test_past_the_variants_limit_custom_backwards_run_on_zeros_give_values() -> None:
    """Past recompile_limit sets of unused outputs the whole graph runs on zeros; which
    gradients are None was read off the whole graph, which has no custom backward's ones
    (``ga * 2 + 1`` is 1 on zeros, not None)."""
    def make() -> list[torch.Tensor]:
        return [torch.zeros(2, requires_grad=True) for _ in range(3)]

    compiled = aotkit.aot_function(_Affine3.apply, compilers.nop)
    with aotkit.config.patch(recompile_limit=2):
        for used in ([0], [1], [2], [0, 2]):
            _assert_same(_grads(compiled, used, make), _grads(_Affine3.apply, used, make))


class _Affine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 * x + 1  # eager calls it with zeros where no gradient comes


class _Gate(torch.autograd.Function):
    """Sends no gradient to its first input."""

    @staticmethod
    def forward(ctx, d, q):
        ctx.save_for_backward(d)
        return d * q

    @staticmethod
    def backward(ctx, g):
        (d,) = ctx.saved_tensors
        return None, g * d


def test_a_custom_backward_given_only_none_runs_when_the_one_after_it_runs() -> None:
    """The Function behind a gate gets None; eager runs it (on zeros) whenever the gate runs:
    the variant for the unused second output dropped it (x.grad None, not ones)."""
    def f(x, q, z):
        return _Gate.apply(_Affine.apply(x), q), z.sin()

    def make() -> list[torch.Tensor]:
        return [torch.ones(3, requires_grad=True) for _ in range(3)]

    compiled = aotkit.aot_function(f, compilers.nop)
    for used in ([0, 1], [0], [1]):
        _assert_same(_grads(compiled, used, make), _grads(f, used, make))


class _DifferentiatesInside(torch.autograd.Function):
    """Two outputs; the backward runs autograd.grad through the Function before it."""

    @staticmethod
    def forward(ctx, h, x):
        ctx.save_for_backward(h, x)
        return h.sin(), x.cos()

    @staticmethod
    def backward(ctx, ga, gb):
        h, x = ctx.saved_tensors
        with torch.enable_grad():
            (gx,) = torch.autograd.grad(h, x, ga, retain_graph=True)
        return None, gx * 1 - gb * x.sin()


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_a_custom_backward_run_twice_keeps_each_runs_reach(partition: str) -> None:
    """The affine Function runs inside the other's autograd.grad and again on the main path:
    one reach per node, the second run's, made the variants drop or keep both runs' ops."""
    def f(x):
        return _DifferentiatesInside.apply(_Affine.apply(x), x)

    def make() -> list[torch.Tensor]:
        return [torch.linspace(-1, 1, 3, requires_grad=True)]

    kw = {"partition_fn": aotkit.min_cut_rematerialization_partition} if partition == "min_cut" else {}
    compiled = aotkit.aot_function(f, compilers.nop, **kw)
    for used in ([0, 1], [0], [1]):
        got, want = _grads(compiled, used, make), _grads(f, used, make)
        torch.testing.assert_close(got[0], want[0])


class _GivenNoneInner(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return None if g is None else g * 2 * x + 1


class _GivenNoneOuter(torch.autograd.Function):
    """Differentiates through the inner Function only when its first gradient comes."""

    @staticmethod
    def forward(ctx, h, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, x)
        return h.sin(), x * 2

    @staticmethod
    def backward(ctx, ga, gb):
        h, x = ctx.saved_tensors
        gx = None
        if ga is not None:
            with torch.enable_grad():
                (gx,) = torch.autograd.grad(h, x, ga * h.cos(), retain_graph=True)
        if gb is not None:
            gx = gb * 2 if gx is None else gx + gb * 2
        return None, gx


def test_a_run_inside_a_given_none_backward_runs_only_with_what_it_passes() -> None:
    """The outer backward skips its autograd.grad when its gradient is None: the inner run
    took the outer's reach and added its ``+ 1`` where eager never runs it."""
    def f(x):
        return _GivenNoneOuter.apply(_GivenNoneInner.apply(x), x)

    def make() -> list[torch.Tensor]:
        return [torch.linspace(0.5, 1.5, 3).requires_grad_()]

    compiled = aotkit.aot_function(f, compilers.nop)
    for used in ([0, 1], [0], [1]):
        _assert_same(_grads(compiled, used, make), _grads(f, used, make))


class _AffineHalf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 + 0.5


def _ones_and_twos() -> list[torch.Tensor]:
    return [torch.ones(3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)]


def _gate_beside(x, q):
    h = _Affine.apply(x)
    return _Gate.apply(h, q), h * 1


def test_custom_backward_run_by_a_node_sending_it_none() -> None:
    """Traced with every output's gradient, _Affine's gradient came from ``h * 1`` only; the
    variant for output 0 alone dropped it, where eager runs it (on zeros) because _Gate runs."""
    compiled = aotkit.aot_function(_gate_beside, compilers.nop)
    for used in ([0], [1], [0, 1]):
        _assert_same(_grads(compiled, used, _ones_and_twos), _grads(_gate_beside, used, _ones_and_twos))


class _Outer(torch.autograd.Function):
    """Differentiates, in its backward, through a tensor it holds (not one of its inputs)."""

    @staticmethod
    def forward(ctx, x2, holder, q):
        ctx.h = holder[0]
        ctx.save_for_backward(q)
        return x2 * 2

    @staticmethod
    def backward(ctx, g):
        (q,) = ctx.saved_tensors
        with torch.enable_grad():
            (gq,) = torch.autograd.grad(ctx.h, q, torch.ones_like(ctx.h), retain_graph=True)
        return g * 2 + gq.sum(), None, None


def _nested_gate(x, q, x2):
    h = _Gate.apply(_Affine.apply(x), q)
    return _Outer.apply(x2, [h], q), h * 1


def _three() -> list[torch.Tensor]:
    return [*_ones_and_twos(), torch.ones(3, requires_grad=True)]


def test_nested_runs_do_not_count_for_the_backward_itself() -> None:
    """_Gate also runs inside _Outer's autograd.grad (output 0's); that run made _Affine run
    on zeros in the variant of output 0 alone, where eager runs it on output 1's path only."""
    compiled = aotkit.aot_function(_nested_gate, compilers.nop)
    for used in ([0], [1], [0, 1]):
        _assert_same(_grads(compiled, used, _three), _grads(_nested_gate, used, _three))


def _absent_read_by_formula(x):
    return _AffineHalf.apply(torch.nn.functional.hardtanh(x)), x.sin()


def test_formula_reads_zeros_for_an_absent_custom_backward() -> None:
    """hardtanh's backward (not known linear) read _AffineHalf's absent value: its backward on
    zeros (0.5), not zero; eager runs neither."""
    compiled = aotkit.aot_function(_absent_read_by_formula, compilers.nop)

    def make():
        return [torch.linspace(-0.5, 0.5, 4).requires_grad_()]

    for used in ([1], [0], [0, 1]):
        _assert_same(_grads(compiled, used, make), _grads(_absent_read_by_formula, used, make))


def _four_heads(z):
    return _AffineHalf.apply(z), z * 3, z.sin(), z.cos()


def test_past_the_variant_limit_a_skipped_custom_backward_still_gets_its_variant() -> None:
    """Past recompile_limit the whole graph ran on zeros, running _AffineHalf's backward (+0.5)
    where eager, whose loss never uses output 0, does not."""
    compiled = aotkit.aot_function(_four_heads, compilers.nop)

    def make():
        return [torch.zeros(3, requires_grad=True)]

    with aotkit.config.patch(recompile_limit=2):
        for used in ([1], [2], [3], [1, 2], [0, 3]):
            _assert_same(_grads(compiled, used, make), _grads(_four_heads, used, make))


def _transposed_sum(x, y):
    a = (x * 2).t()
    return torch.sub(a, y.t(), alpha=2).exp(), (a @ y).relu()


def test_absent_formula_values_keep_their_layout_under_dynamic_shapes() -> None:
    """Zeros put in for every absent value gave a transposed one contiguous strides: the sum
    reading it (not rewritten under symbolic strides) had other strides than traced, which
    debug_nop refused."""
    compiled = aotkit.aot_function(_transposed_sum, compilers.debug_nop, dynamic=True)

    def make():
        return [torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)]

    for used in ([0], [1], [0, 1]):
        torch.manual_seed(0)
        got = _grads(compiled, used, make)
        torch.manual_seed(0)
        _assert_same(got, _grads(_transposed_sum, used, make))


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return -g


def _reversed_heads(z, *ws):
    h = torch.tanh(z)
    return tuple(_Reverse.apply(h * w) for w in ws)


def test_variants_for_skipped_custom_backwards_are_bounded() -> None:
    """A custom Function on every head: each set of heads skips other custom backwards, and
    past the limit every set was compiled (76 over 80 random steps of 10 heads)."""
    import random

    aotkit.counters.reset()
    compiled = aotkit.aot_function(_reversed_heads, compilers.nop)
    rng = random.Random(0)

    def make():
        torch.manual_seed(0)
        return [torch.randn(3, requires_grad=True) for _ in range(11)]

    with aotkit.config.patch(recompile_limit=4):
        for _ in range(40):
            used = [i for i in range(10) if rng.random() < 0.5] or [0]
            _assert_same(_grads(compiled, used, make), _grads(_reversed_heads, used, make))
    assert aotkit.counters.counters["aot"]["bw_compiles"] <= 2 * 4 + 1
