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
    keys = RecentKeys("f")

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
    assert [c.hash for c in f._keys._checks] == [f._keys._computed[-1], f._keys._computed[-2]]
    assert all(c.hits for c in f._keys._checks)
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


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count calls of ``aotkit.aot.key_check.<name>`` from now on."""
    import aotkit.aot.key_check as key_check

    calls = [0]
    original = getattr(key_check, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(key_check, name, counted)
    return calls


def test_checks_dropped_unused_stop_being_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six batch sizes in turn, each called twice: every check was built and dropped before
    it held once, costing more than computing the keys (a fallback decision says it stops)."""
    aotkit.counters.reset()
    built = _counting(monkeypatch, "SameKey")
    keys = RecentKeys("six sizes")
    w = torch.randn(4, 4)
    for _ in range(10):
        for n in range(2, 8):
            x = torch.randn(n, 4)
            for _ in range(2):
                assert keys.key(2, [x, w], False, ("aot",), ()) == signature(2, [x, w], False, ("aot",))
    assert built[0] <= 12  # eight dropped unused, four kept; 60 before (one per pair)
    assert any(d.what == "six sizes" for d in aotkit.explain().of_kind("fallback"))


def test_checks_are_built_again_once_one_key_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up over bucketed batch sizes gave the checks up; training at one size afterwards
    computed every key in Python for good (~3 us a tensor at every call)."""
    keys = RecentKeys("warm-up, then one size")
    w = torch.randn(4, 4)
    for n in [2, 3, 4, 5, 6, 7] * 10:
        for _ in range(2):
            keys.key(2, [torch.randn(n, 4), w], False, ("aot",), ())
    x = torch.randn(3, 4)
    for _ in range(70):  # past _SETTLED calls in a row
        expected = keys.key(2, [x, w], False, ("aot",), ())
    computed = _counting(monkeypatch, "signature")
    for _ in range(5):
        assert keys.key(2, [x, w], False, ("aot",), ()) == expected
    assert computed[0] == 0  # the check held: no key computed


def test_a_check_built_under_a_dispatch_mode_does_not_stick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built under the mode, the check held the mode's dispatch key: no later plain call
    passed it, and no other was built for the same key."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    computed = _counting(monkeypatch, "signature")
    keys = RecentKeys("f")
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    with Passing():
        for _ in range(3):
            keys.key(2, [x, w], False, ("aot",), ())
    for _ in range(3):
        keys.key(2, [x, w], False, ("aot",), ())
    assert computed[0] == 5  # three under the mode, two to build the check; then checked
