"""Arguments that compare equal but trace differently (Note [Keys compared by ==]), pytree nodes
without key paths, and models built under inference_mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import aotkit
from aotkit import compilers
from aotkit.errors import UnsupportedError


@dataclasses.dataclass(frozen=True)
class Cfg:
    v: float


class Node:
    def __init__(self, x: torch.Tensor, v: Any) -> None:
        self.x, self.v = x, v


pytree.register_pytree_node(Node, lambda n: ([n.x], n.v), lambda xs, v: Node(xs[0], v))


def _first_key(d: dict[Any, torch.Tensor]) -> torch.Tensor:
    k = next(iter(d))
    return torch.full((2,), k) * d[k]


CASES: dict[str, tuple[Callable[..., Any], list[Callable[[torch.Tensor], tuple[Any, ...]]]]] = {
    "dict keys 1, 1.0, True": (_first_key, [lambda x: ({1: x},), lambda x: ({1.0: x},),
                                            lambda x: ({True: x},)]),
    "dict keys 0.0, -0.0": (lambda d: 1 / _first_key(d),
                            [lambda x: ({0.0: x},), lambda x: ({-0.0: x},)]),
    "frozen dataclass": (lambda x, c: torch.full((2,), c.v) / x,
                         [lambda x: (x, Cfg(1)), lambda x: (x, Cfg(1.0)),
                          lambda x: (x, Cfg(-0.0))]),
    "frozenset": (lambda x, s: torch.full((2,), next(iter(s))) * x,
                  [lambda x: (x, frozenset({1})), lambda x: (x, frozenset({1.0}))]),
    "range": (lambda x, r: x[r.start:r.stop] * 1,
              [lambda x: (x, range(0, 1, 2)), lambda x: (x, range(0, 2, 2))]),
    "pytree node context": (lambda n: torch.full((2,), n.v) / n.x,
                            [lambda x: (Node(x, 1),), lambda x: (Node(x, 1.0),),
                             lambda x: (Node(x, -0.0),)]),
}


@pytest.mark.parametrize("case", CASES)
def test_arguments_equal_by_eq_but_traced_otherwise_trace_again(case: str) -> None:
    """1 == 1.0 == True and 0.0 == -0.0: a graph traced for one was run for the other (an int64
    result for a float, +inf for -inf, a slice of another length)."""
    fn, makes = CASES[case]
    compiled = aotkit.aot_function(fn, compilers.nop)
    for make in makes * 2:
        x = torch.arange(1.0, 3.0)
        expected, actual = fn(*make(x)), compiled(*make(x))
        torch.testing.assert_close(actual, expected, equal_nan=True)
        assert actual.dtype == expected.dtype
    assert aotkit.counters.counters["aot"]["traces"] == len(makes)
    assert len(aotkit.explain().of_kind("recompile")) == len(makes) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class SlottedCfg:
    v: float


@dataclasses.dataclass(frozen=True)
class Mode:
    v: float


pytree.register_constant(Mode)


@dataclasses.dataclass(frozen=True)
class WithTensor:
    v: Any
    t: torch.Tensor


class Box:
    def __init__(self, x: torch.Tensor, meta: dict[str, Any]) -> None:
        self.x, self.meta = x, meta


pytree.register_pytree_node(Box, lambda b: ([b.x], b.meta), lambda xs, meta: Box(xs[0], meta))
_T = torch.ones(1)
CASES.update({
    "dataclass with a numpy field": (
        lambda x, c: x / torch.full((2,), float(c.v)),
        [lambda x: (x, Cfg(np.float64(0.0))), lambda x: (x, Cfg(np.float64(-0.0)))]),
    "dataclass holding a tensor": (
        lambda x, c: torch.full((2,), c.v) / x,
        [lambda x: (x, WithTensor(1, _T)), lambda x: (x, WithTensor(1.0, _T)),
         lambda x: (x, WithTensor(-0.0, _T))]),
    "set context": (lambda b: torch.full((1,), min(b.meta["s"])) * b.x[:1],
                    [lambda x: (Box(x, {"s": {True, 0}}),), lambda x: (Box(x, {"s": {1, False}}),)]),
    "dict context": (lambda b: torch.full((2,), b.meta["v"]) / b.x,
                     [lambda x: (Box(x, {"v": 1}),), lambda x: (Box(x, {"v": 1.0}),),
                      lambda x: (Box(x, {"v": -0.0}),)]),
    "slotted frozen dataclass": (lambda x, c: torch.full((2,), c.v) / x,
                                 [lambda x: (x, SlottedCfg(1)), lambda x: (x, SlottedCfg(1.0)),
                                  lambda x: (x, SlottedCfg(-0.0))]),
    "register_constant": (lambda x, m: torch.full((2,), m.v) / x,
                          [lambda x: (x, Mode(1)), lambda x: (x, Mode(1.0))]),
})


@pytest.mark.parametrize("make", [
    lambda: ({k: torch.ones(2) for k in range(65)},),  # a context past the walk's limits
    lambda: (torch.ones(2), Mode(2.0)),  # register_constant: a context made at every flatten
    lambda: (torch.ones(2), Cfg(float("nan"))),
], ids=["65 int keys", "register_constant", "nan field"])
def test_equal_arguments_made_anew_reuse_their_graph(make: Callable[[], tuple[Any, ...]]) -> None:
    """Keys that refine == must not compare by identity: each call's context is new."""
    compiled = aotkit.aot_function(lambda *a: pytree.tree_leaves(a)[0] * 2, compilers.nop)
    for _ in range(5):
        compiled(*make())
    assert aotkit.counters.counters["aot"]["traces"] == 1


def test_a_changed_dict_key_type_is_named_in_the_recompile_reason() -> None:
    compiled = aotkit.aot_function(_first_key, compilers.nop)
    compiled({1: torch.ones(2)})
    compiled({1.0: torch.ones(2)})
    [reason] = [d.why for d in aotkit.explain().of_kind("recompile")]
    assert "a dict key or a pytree node's context changed in type or sign" in reason


def test_a_nan_held_by_an_argument_reuses_its_graph() -> None:
    """A NaN compares unequal to itself: a frozen dataclass holding one traced again at every
    call, up to the recompile limit."""
    compiled = aotkit.aot_function(lambda x, c: x + c.v, compilers.nop)
    for _ in range(10):
        torch.testing.assert_close(compiled(torch.ones(2), Cfg(float("nan"))),
                                   torch.full((2,), float("nan")), equal_nan=True)
    assert aotkit.counters.counters["aot"]["traces"] == 1


class Pair:
    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


# registered without flatten_with_keys_fn, which PyTorch leaves optional
pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda xs, _: Pair(*xs))


def test_a_pytree_node_without_key_paths_is_an_argument_and_an_output() -> None:
    """Naming the arguments used ``tree_flatten_with_path``: a raw ValueError."""
    def f(p: Pair) -> Pair:
        return Pair(p.a * p.b, p.b.sin())

    compiled = aotkit.aot_function(f, compilers.nop)
    x = torch.randn(3, requires_grad=True)
    out = compiled(Pair(x, x + 1))
    expected = f(Pair(x, x + 1))
    torch.testing.assert_close((out.a, out.b), (expected.a, expected.b))
    compiled(Pair(x, torch.ones(3, dtype=torch.float64)))  # recompiles, naming leaves by place
    [reason] = [d.why for d in aotkit.explain().of_kind("recompile")]
    assert reason.startswith("dtype of args[0][1] changed")


def _built_under_inference_mode() -> torch.nn.Linear:
    torch.manual_seed(0)
    with torch.inference_mode():
        return torch.nn.Linear(3, 3)


def test_a_model_built_under_inference_mode_runs_under_no_grad() -> None:
    """Its parameters are inference tensors requiring grad, whose functional wrappers cannot
    take requires_grad: a raw RuntimeError from PyTorch's functional tensors."""
    model, x = _built_under_inference_mode(), torch.randn(2, 3)
    with torch.no_grad():
        torch.testing.assert_close(aotkit.aot_module(model, compilers.nop)(x), model(x))


def test_a_model_built_under_inference_mode_is_refused_for_training_with_the_fix() -> None:
    model, x = _built_under_inference_mode(), torch.randn(2, 3)
    with pytest.raises(UnsupportedError, match=r"(?s)weight is an inference tensor .*load_state_dict"):
        aotkit.aot_module(model, compilers.nop)(x)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    reference = torch.nn.Linear(3, 3)
    reference.load_state_dict(model.state_dict())
    aotkit.aot_module(model, compilers.nop)(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, reference.weight.grad)


def test_a_frozen_dataclass_holding_another_tensor_traces_again() -> None:
    """Compared by its ==, a tensor field with more than one element raised a raw 'Boolean
    value of Tensor ... is ambiguous'."""
    def f(x: torch.Tensor, c: WithTensor) -> torch.Tensor:
        return x * c.t

    compiled = aotkit.aot_function(f, compilers.nop)
    x = torch.ones(2)
    for t in (torch.tensor([2.0, 3.0]), torch.tensor([5.0, 7.0])):
        torch.testing.assert_close(compiled(x, WithTensor(1, t)), f(x, WithTensor(1, t)))


@dataclasses.dataclass(unsafe_hash=True)
class Chain:
    v: float
    next: Any = None


def test_a_hashable_dataclass_holding_itself_is_an_argument() -> None:
    """Hashing it recursed until a raw RecursionError; eager never hashes it."""
    link = Chain(2.0)
    link.next = link
    compiled = aotkit.aot_function(lambda x, c: x * c.next.v, compilers.nop)
    torch.testing.assert_close(compiled(torch.ones(2), link), torch.full((2,), 2.0))
