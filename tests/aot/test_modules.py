"""ModuleInfo parity: ``aotkit.aot_module(mod, nop)`` against an identical eager module.

For every module in PyTorch's ``module_db`` (float32, CPU), in train and eval mode, on the first
ModuleInput: outputs, parameter and input gradients (random cotangents) and buffers (BatchNorm
running statistics) must match a deep copy run eagerly, and must still match on a second call
after the parameters were changed in place (aot_module reads them fresh at each call).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from opinfo_harness import (
    EagerError,
    ParityError,
    copy_inputs,
    requires_grad_mask,
    same,
    tensor_leaves,
)
from torch import nn
from torch.testing._internal.common_modules import module_db
from torch.utils import _pytree as pytree

import aotkit
from aotkit.errors import TraceError

SEED = 0

# Keys are a module name (both modes) or "<name>.train" / "<name>.eval". PyTorch's own
# aot_module fails on these too (checked below).
EXPECTED_FAILURES: dict[str, str] = {
    "nn.GaussianNLLLoss": "data-dependent: checks var >= 0 with a Python branch on tensor values",
    "nn.CTCLoss": "data-dependent: aten._ctc_loss output size depends on the target lengths' values",
}

# Failures PyTorch's own aot_module does not have; the lead empties this as aotkit is fixed.
AOTKIT_BUGS: dict[str, str] = {}

# For each listed key, the error the strict xfail must see (a wrong result is ParityError).
RAISES: dict[str, type[BaseException]] = {
    "nn.GaussianNLLLoss": TraceError,
    "nn.CTCLoss": TraceError,
}

SKIP: dict[str, str] = {}

MODULES = [info for info in module_db if torch.float32 in info.supported_dtypes("cpu")]
MODES = ("train", "eval")


def build(info: Any, training: bool) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The first ModuleInput's module (float32, CPU, in ``training`` mode) and forward inputs."""
    torch.manual_seed(SEED)
    inputs = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                     training=training)
    ctor, fwd = inputs[0].constructor_input, inputs[0].forward_input
    mod = info.module_cls(*ctor.args, **ctor.kwargs).to(dtype=torch.float32)
    if info.is_lazy:  # materialize the parameters; eval mode leaves running statistics alone
        mod.eval()
        with torch.no_grad():
            mod(*copy_inputs(fwd.args), **copy_inputs(fwd.kwargs))
    mod.train(training)
    return mod, fwd.args, dict(fwd.kwargs)


def run_step(mod: nn.Module, owner: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             mask: list[bool] | None = None) -> tuple[Any, list[bool], list[Any]]:
    """Call ``mod`` and backpropagate seeded random cotangents of the outputs that require grad.

    Returns the output, its requires-grad mask and the grads of ``owner``'s parameters then of
    the inputs that require grad. ``mask`` is eager's, which the output must reproduce."""
    for p in owner.parameters():
        p.grad = None
    torch.manual_seed(SEED)
    out = mod(*args, **kwargs)
    own = requires_grad_mask(out)
    if mask is not None and own != mask:
        raise ParityError(f"outputs requiring grad differ: {own} (compiled) vs {mask} (eager)")
    picked = [o for o, r in zip(pytree.tree_leaves(out), own, strict=True) if r]
    if picked:
        gen = torch.Generator().manual_seed(SEED)
        torch.autograd.backward(
            picked, [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in picked]
        )
    inputs = [t for t in tensor_leaves((args, kwargs)) if t.requires_grad]
    return out, own, [p.grad for p in owner.parameters()] + [t.grad for t in inputs]


def update_parameters(mod: nn.Module) -> None:
    with torch.no_grad():
        for i, p in enumerate(mod.parameters()):
            p.add_(0.01 * (i + 1))


def aotkit_module(mod: nn.Module) -> nn.Module:
    return aotkit.aot_module(mod, aotkit.compilers.nop)


def aotkit_min_cut_module(mod: nn.Module) -> nn.Module:
    return aotkit.aot_module(mod, aotkit.compilers.nop,
                             partition_fn=aotkit.partition.min_cut_rematerialization_partition)


PARTITIONERS = {"default": aotkit_module, "min_cut": aotkit_min_cut_module}


def pytorch_module(mod: nn.Module) -> nn.Module:
    from torch._functorch.aot_autograd import aot_module
    from torch._functorch.compilers import nop

    return aot_module(mod, nop)


def check_module(info: Any, training: bool,
                 compile_module: Callable[[nn.Module], nn.Module] = aotkit_module) -> None:
    """Raise unless the compiled module matches eager on two calls (see the module docstring);
    :class:`EagerError` when the eager module itself fails."""
    mod, args, kwargs = build(info, training)
    eager = copy.deepcopy(mod)
    compiled = compile_module(mod)
    mod = compiled.orig_module
    for call in ("first call", "second call"):
        eager_inputs, compiled_inputs = copy_inputs((args, kwargs)), copy_inputs((args, kwargs))
        try:
            expected, mask, expected_grads = run_step(eager, eager, *eager_inputs)
        except Exception as exc:
            raise EagerError(f"eager module fails: {type(exc).__name__}: {exc}") from exc
        actual, _, grads = run_step(compiled, mod, *compiled_inputs, mask)
        same(f"{call}: outputs", actual, expected)
        same(f"{call}: gradients", grads, expected_grads)
        same(f"{call}: buffers", dict(mod.named_buffers()), dict(eager.named_buffers()))
        same(f"{call}: inputs after the call", tensor_leaves(compiled_inputs),
             tensor_leaves(eager_inputs))
        update_parameters(eager)
        update_parameters(mod)


def _lookup(table: dict[str, Any], name: str, mode: str) -> Any:
    return table.get(f"{name}.{mode}", table.get(name))


def _marks(name: str, mode: str) -> list[Any]:
    if reason := _lookup(SKIP, name, mode):
        return [pytest.mark.skip(reason=reason)]
    reason = _lookup(EXPECTED_FAILURES, name, mode) or _lookup(AOTKIT_BUGS, name, mode)
    if reason:
        return [pytest.mark.xfail(strict=True, reason=reason, raises=_lookup(RAISES, name, mode))]
    return []


def _cases(table: dict[str, Any] | None = None) -> list[Any]:
    """(info, training) per module and mode; only those ``table`` lists when given."""
    return [
        pytest.param(info, mode == "train", id=f"{info.name}.{mode}",
                     marks=[] if table is not None else _marks(info.name, mode))
        for info in MODULES for mode in MODES
        if table is None or _lookup(table, info.name, mode)
    ]


@pytest.mark.filterwarnings("ignore::UserWarning")  # deprecation notes of the modules
@pytest.mark.parametrize("partition", list(PARTITIONERS))
@pytest.mark.parametrize(("info", "training"), _cases())
def test_module_matches_eager(info: Any, training: bool, partition: str) -> None:
    check_module(info, training, PARTITIONERS[partition])


@pytest.mark.parametrize(("info", "training"), _cases(EXPECTED_FAILURES))
def test_expected_failure_also_fails_in_pytorch(info: Any, training: bool) -> None:
    with pytest.raises(Exception) as caught:
        check_module(info, training, pytorch_module)
    assert not isinstance(caught.value, EagerError)


@pytest.mark.parametrize(("info", "training"), _cases(AOTKIT_BUGS))
def test_aotkit_bug_passes_in_pytorch(info: Any, training: bool) -> None:
    check_module(info, training, pytorch_module)


def test_lists_are_consistent() -> None:
    names = {info.name for info in MODULES}
    listed = [*EXPECTED_FAILURES, *AOTKIT_BUGS, *SKIP]
    assert len(set(listed)) == len(listed)
    assert {key.removesuffix(".train").removesuffix(".eval") for key in listed} <= names
    assert set(RAISES) == {*EXPECTED_FAILURES, *AOTKIT_BUGS}



class _PlainModule(nn.Module):
    def __init__(self, mod: nn.Module) -> None:
        super().__init__()
        self.orig_module = mod

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.orig_module(*args, **kwargs)


class _FrozenCopy(_PlainModule):
    """Runs a snapshot of the module: stale parameters, buffers of its own."""

    def __init__(self, mod: nn.Module) -> None:
        super().__init__(mod)
        self.snapshot = copy.deepcopy(mod)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.snapshot(*args, **kwargs)


def test_check_catches_stale_parameters_and_buffers() -> None:
    batch_norm = next(info for info in MODULES if info.name == "nn.BatchNorm2d")
    check_module(batch_norm, True, _PlainModule)
    with pytest.raises(ParityError):
        check_module(batch_norm, True, _FrozenCopy)
