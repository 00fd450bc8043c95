"""The partitioners and compilers on CUDA, run where a GPU is lent (skipped cleanly elsewhere):
min-cut with dropout, aotkit_inductor training, TorchScript, debug_nop, and a debug_compile
repro that runs on the GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aotkit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mlp(dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                               torch.nn.Dropout(dropout), torch.nn.Linear(64, 8)).cuda()


def _train_step(wrap, dropout: float = 0.1, rtol: float | None = None, atol: float | None = None):
    eager, model = _mlp(dropout), _mlp(dropout)
    compiled = wrap(model)
    x = torch.randn(16, 32, device="cuda")
    torch.manual_seed(1)
    expected = eager(x)
    expected.square().sum().backward()
    torch.manual_seed(1)
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("budget", [1.0, 0.0])
def test_min_cut_with_dropout_on_cuda(budget: float) -> None:
    with aotkit.config.patch(activation_memory_budget=budget):
        _train_step(lambda m: aotkit.aot_module(
            m, aotkit.compilers.nop, partition_fn=aotkit.min_cut_rematerialization_partition))


def test_aotkit_inductor_on_cuda() -> None:
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fallback_random=True):
        _train_step(lambda m: torch.compile(m, backend="aotkit_inductor"), rtol=1e-4, atol=1e-4)


def test_ts_compile_on_cuda() -> None:
    _train_step(lambda m: aotkit.aot_module(m, aotkit.compilers.ts_compile), dropout=0.0)


def test_debug_nop_on_cuda() -> None:
    _train_step(lambda m: aotkit.aot_module(m, aotkit.compilers.debug_nop))
    _train_step(lambda m: torch.compile(m, backend="aotkit_debug"))


def test_debug_compile_repro_runs_on_cuda(tmp_path: Path) -> None:
    with aotkit.config.patch(debug_dir=str(tmp_path)):
        f = aotkit.aot_function(lambda x: x.sin().cos(), aotkit.compilers.debug_compile)
        f(torch.randn(4, device="cuda", requires_grad=True)).sum().backward()
    [repro, *_] = sorted(tmp_path.rglob("repro.py"))
    proc = subprocess.run([sys.executable, str(repro)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "repro: ok" in proc.stdout
