"""Keys checked in C++ (Note [Keys checked in C++]) are the keys computed in Python."""

from __future__ import annotations

import itertools

import pytest
import torch

import aotkit
from aotkit.aot.key_check import RecentKeys
from aotkit.aot.signature import Keyed, signature


def _variants() -> dict[str, list[object]]:
    base = torch.randn(3, 4)
    leaf = torch.randn(3, 4, requires_grad=True)
    nonleaf = leaf * 1
    c = torch.randn(3, 4, dtype=torch.cfloat)
    w = torch.randn(4, 4)
    return {
        "plain": [torch.randn(3, 4), w],
        "other sizes": [torch.randn(5, 4), w],
        "transposed": [torch.randn(4, 3).t(), w],
        "dtype": [torch.randn(3, 4, dtype=torch.float64), w],
        "requires grad leaf": [leaf, w],
        "requires grad non-leaf": [nonleaf, w],
        "parameter": [torch.nn.Parameter(torch.randn(3, 4)), w],
        "same tensor twice": [base, base],
        "two tensors": [base, torch.randn(3, 4)],
        "complex": [c, w],
        "conjugate": [c.conj(), w],
        "negative bit": [torch._neg_view(c), w],
        "one argument": [base],
        "sparse": [base.to_sparse(), w],
        "captured 1": [base, w, Keyed(("float", "1.0"))],
        "captured 2": [base, w, Keyed(("float", "2.0"))],
    }


_CASES = list(itertools.permutations(_variants(), 2))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("first", "then"), _CASES, ids=[f"{a}->{b}" for a, b in _CASES])
def test_a_checked_key_is_the_computed_key(first: str, then: str, dynamic: bool) -> None:
    variants = _variants()
    keys = RecentKeys()

    def both(leaves: list[object]) -> tuple[object, object]:
        count = sum(isinstance(x, torch.Tensor) for x in leaves)
        try:
            expected = signature(count, leaves, dynamic, static={1})
        except aotkit.errors.UnsupportedError:
            expected = "refused"
        try:
            got = keys.key(count, leaves, dynamic, ("aot", "min_cut"), {1})
        except aotkit.errors.UnsupportedError:
            got = "refused"
        return got, expected

    for _ in range(3):  # computed, computed again (the check is built), checked
        got, expected = both(variants[first])
        assert got == expected
    got, expected = both(variants[then])
    assert got == expected
    with torch.no_grad():  # the modes are part of the key
        got, expected = both(variants[first])
        assert got == expected


def test_calls_alternating_between_two_keys_take_their_checks() -> None:
    f = aotkit.aot_function(lambda x: x.sin() * 2, aotkit.compilers.nop)
    a, b = torch.randn(3), torch.randn(5)
    for _ in range(3):
        torch.testing.assert_close(f(a), a.sin() * 2)
        torch.testing.assert_close(f(b), b.sin() * 2)
    assert [c.key for c in f._keys._checks] == [f._keys._computed[-1], f._keys._computed[-2]]
    assert f.num_entries == 2


def test_a_call_after_the_check_was_built_sees_every_change() -> None:
    """The third call onwards is checked in C++: a change of leafness, grad mode or a
    captured value still runs the graph traced for it."""
    scale = 2.0
    f = aotkit.aot_function(lambda x: x * scale, aotkit.compilers.nop)
    x = torch.randn(3, requires_grad=True)
    for _ in range(3):
        f(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 6.0))
    scale = 3.0
    torch.testing.assert_close(f(x), x * 3.0)
    y = x * 1  # not a leaf: the graph for it is another one
    (g,) = torch.autograd.grad(f(y).sum(), x)
    torch.testing.assert_close(g, torch.full((3,), 3.0))
    with torch.no_grad():
        out = f(x)
    assert out.grad_fn is None


def test_a_symbolic_call_after_eager_ones_adds_no_guard() -> None:
    """A key of a trace's symbolic sizes compared with a remembered one guarded the symbol
    (``s0 == 3``): a call under a FakeTensorMode with a ShapeEnv came back with static size."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    f = aotkit.aot_function(lambda t: t * 2, aotkit.compilers.nop)
    for _ in range(3):
        f(torch.randn(3))
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    fake = mode.from_tensor(torch.randn(3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC]))
    with mode:
        out = f(fake)
    assert isinstance(out.shape[0], torch.SymInt) and not env.guards
