"""CUDA paths, run where a GPU is lent (skipped cleanly elsewhere): AOT autograd on CUDA
tensors, torch.compile(backend="aotkit") on CUDA, and compiled autograd with the CUDA-graphs
option moving CPU scalars to the GPU."""

import copy

import pytest
import torch

import aotkit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(64, 8)).cuda()


def test_aot_module_on_cuda_matches_eager_with_dropout() -> None:
    eager, compiled = _mlp(), _mlp()
    aot = aotkit.aot_module(compiled, aotkit.compilers.nop)
    x = torch.randn(16, 32, device="cuda")
    torch.manual_seed(1)
    expected = eager(x)
    expected.sum().backward()
    torch.manual_seed(1)
    out = aot(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_torch_compile_aotkit_on_cuda() -> None:
    eager = _mlp().eval()
    compiled = torch.compile(copy.deepcopy(eager), backend="aotkit")
    x = torch.randn(16, 32, device="cuda", requires_grad=True)
    torch.testing.assert_close(compiled(x), eager(x))


def test_compiled_autograd_with_cudagraphs_option_matches_eager() -> None:
    eager, compiled = _mlp().eval(), _mlp().eval()
    x = torch.randn(16, 32, device="cuda")
    (eager(x) * 0.5).sum().backward()
    with aotkit.config.patch(compiled_autograd_cudagraphs=True), \
            aotkit.compiled_autograd.enable(lambda gm: gm):
        (compiled(x) * 0.5).sum().backward()
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
