"""OpInfo parity for compiled autograd: every op's backward captured, lowered and replayed.

For every OpInfo in ``op_db`` with float32 on CPU and autograd, the op's first sample runs
forward eagerly twice (same seed); one backward runs eagerly, the other under
``aotkit.compiled_autograd.enable(nop)``, both through ``torch.autograd.grad`` with the same
random cotangents (``opinfo_harness.backward``). The input gradients must equal eager's bit for
bit: the nop compiler runs eager's own formulas, or the ATen ops they trace to.

NOT_BIT_EXACT lists the ops whose formulas compute another way for traced tensors than for real
ones (PyTorch's formulas take a path that works for tensor subclasses: ``masked_fill``'s value
gradient sums ``where(mask, grad, 0)`` instead of ``grad.masked_select(mask)``, ``prod``'s
gradient uses cumulative products instead of ``result / input``), or where several outputs
of the op are backward roots alike in structure, whose sums follow the engine's order (the
``hook_order`` decision). Their gradients must still be close to eager's.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from tests.aot import opinfo_harness as harness
from tests.compiled_autograd.helpers import nop
from torch.utils import _pytree as pytree

import aotkit

OPS = {op.full_name: op for op in harness.supported_ops()}

NOT_BIT_EXACT = frozenset({"prod", "masked.prod", "masked_fill", "gradient", "sparse.mm.reduce"})


def _grads(op: Any, sample: Any, compiled: bool) -> list[Any] | None:
    args, kwargs = harness.copy_inputs(harness.sample_call(sample))
    out = harness.forward(op.op, args, kwargs)
    out = (sample.output_process_fn_grad or (lambda o: o))(out)
    mask = harness.requires_grad_mask(out)
    if not compiled:
        return harness.backward(out, (args, kwargs), mask)
    with aotkit.compiled_autograd.enable(nop):
        return harness.backward(out, (args, kwargs), mask)


def _bitwise_equal(actual: Any, expected: Any) -> bool:
    pairs = zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected), strict=True)
    return all(_same_bits(a, e) for a, e in pairs)


def _same_bits(a: torch.Tensor | None, e: torch.Tensor | None) -> bool:
    if a is None or e is None:
        return a is e
    if a.layout != torch.strided:
        a, e = a.to_dense(), e.to_dense()
    return torch.equal(a.isnan(), e.isnan()) and torch.equal(a.nan_to_num(), e.nan_to_num())


@pytest.mark.filterwarnings("ignore::UserWarning")  # deprecation notes of the ops
@pytest.mark.parametrize("op", [pytest.param(op, id=name) for name, op in OPS.items()])
def test_backward_matches_eager(op: Any) -> None:
    sample = harness.first_sample(op)
    try:
        expected = _grads(op, sample, compiled=False)
    except Exception as exc:  # the sample is broken in eager: nothing to compare against
        pytest.skip(f"eager PyTorch fails on this sample: {type(exc).__name__}")
    if expected is None:
        pytest.skip("no output of this sample requires grad")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual = _grads(op, sample, compiled=True)
    harness.same("gradients", actual, expected)
    if op.full_name not in NOT_BIT_EXACT:
        assert _bitwise_equal(actual, expected), "gradients are close to eager's, not equal"
    assert aotkit.counters.counters["compiled_autograd"]["captures"] >= 1


def test_not_bit_exact_names_real_ops() -> None:
    assert set(OPS) >= NOT_BIT_EXACT
