"""OpInfo parity: ``aotkit.aot_function(op, nop)`` against eager PyTorch, one sample per op.

Every OpInfo in ``op_db`` with float32 on CPU and autograd runs its first sample eagerly and
compiled; outputs, inputs after the call and input gradients (random cotangents) must match
(see ``opinfo_harness.check``). ``scripts/opinfo_sweep.py`` runs every sample.

Known failures live in ``opinfo_expectations.py``. A listed op whose first sample fails is a
strict xfail that must raise the error FIRST_SAMPLE_RAISES names; on that sample PyTorch's own
``aot_function`` must fail too for EXPECTED_FAILURES, and pass for AOTKIT_BUGS.
"""

from __future__ import annotations

from typing import Any

import opinfo_harness as harness
import pytest
import torch
from opinfo_expectations import AOTKIT_BUGS, EXPECTED_FAILURES, FIRST_SAMPLE_RAISES, SKIP

OPS = {op.full_name: op for op in harness.supported_ops()}


def _marks(name: str) -> list[Any]:
    if name in SKIP:
        return [pytest.mark.skip(reason=SKIP[name])]
    if name in FIRST_SAMPLE_RAISES:
        reason = EXPECTED_FAILURES.get(name) or AOTKIT_BUGS[name]
        return [pytest.mark.xfail(strict=True, reason=reason, raises=FIRST_SAMPLE_RAISES[name])]
    return []


PARTITIONERS = {"default": harness.aotkit_compile, "min_cut": harness.aotkit_min_cut_compile}


@pytest.mark.filterwarnings("ignore::UserWarning")  # deprecation notes of the ops
@pytest.mark.parametrize("partition", list(PARTITIONERS))
@pytest.mark.parametrize(
    "op", [pytest.param(op, id=name, marks=_marks(name)) for name, op in OPS.items()]
)
def test_op_matches_eager(op: Any, partition: str) -> None:
    harness.check_sample(op, harness.first_sample(op), PARTITIONERS[partition])


@pytest.mark.parametrize("name", sorted(set(EXPECTED_FAILURES) & set(FIRST_SAMPLE_RAISES)))
def test_expected_failure_also_fails_in_pytorch(name: str) -> None:
    op = OPS[name]
    with pytest.raises(Exception) as info:
        harness.check_sample(op, harness.first_sample(op), harness.pytorch_compile)
    assert not isinstance(info.value, harness.EagerError)


@pytest.mark.parametrize("name", sorted(set(AOTKIT_BUGS) & set(FIRST_SAMPLE_RAISES)))
def test_aotkit_bug_passes_in_pytorch(name: str) -> None:
    op = OPS[name]
    harness.check_sample(op, harness.first_sample(op), harness.pytorch_compile)


def test_lists_name_real_ops_once() -> None:
    listed = [*EXPECTED_FAILURES, *AOTKIT_BUGS, *SKIP]
    assert sorted(set(listed) - set(OPS)) == []
    assert len(set(listed)) == len(listed)
    assert set(FIRST_SAMPLE_RAISES) <= {*EXPECTED_FAILURES, *AOTKIT_BUGS}


class _DoubleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def _off_by_a_bit(fn: Any) -> Any:
    return lambda *args, **kwargs: fn(*args, **kwargs) + 1e-3


def _wrong_grads(fn: Any) -> Any:
    return lambda *args, **kwargs: _DoubleGrad.apply(fn(*args, **kwargs))


def _detached(fn: Any) -> Any:
    return lambda *args, **kwargs: fn(*args, **kwargs).detach()


def _on_copies(fn: Any) -> Any:
    return lambda *args, **kwargs: fn(*harness.copy_inputs(args), **kwargs)


@pytest.mark.parametrize("broken", [_off_by_a_bit, _wrong_grads, _detached])
def test_harness_catches_wrong_results(broken: Any) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    harness.check(torch.sin, (x,), {})
    with pytest.raises(harness.ParityError):
        harness.check(torch.sin, (x,), {}, broken)


def test_harness_catches_lost_input_mutation() -> None:
    x, y = torch.randn(3), torch.randn(3)
    harness.check(torch.Tensor.add_, (x, y), {})
    with pytest.raises(harness.ParityError, match="inputs after the call"):
        harness.check(torch.Tensor.add_, (x, y), {}, _on_copies)


def test_copy_inputs_keeps_layout_and_sharing() -> None:
    base = torch.randn(4, 6)
    view, other = base.t()[1:], base[0]
    new_view, new_other = harness.copy_inputs((view, other))
    assert new_view.stride() == view.stride()
    assert new_view.storage_offset() == view.storage_offset()
    assert new_view.untyped_storage().data_ptr() == new_other.untyped_storage().data_ptr()
    assert new_view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    torch.testing.assert_close(new_view, view)
