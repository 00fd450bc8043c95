"""One rank of tests/test_distributed.py: ``python dist_worker.py RANK WORLD STORE_FILE``.

Every scenario trains two steps of a model wrapped for data parallelism, compiled with aotkit,
beside an eager ``DistributedDataParallel`` copy (C++ reducer) fed the same per-rank batches,
and reports each parameter's largest gradient difference from eager and a checksum of its
gradients (ranks see different batches, so equal checksums across ranks show the gradients
were reduced). Prints one JSON object: scenario -> result, or the error it raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import aotkit


class Net(nn.Module):
    """Four 1 MiB Linear layers: DDP's 1 MiB buckets give Dynamo's DDPOptimizer four graphs."""

    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


@contextlib.contextmanager
def python_reducer() -> Iterator[None]:
    """DDP built inside uses its Python reducer (hooks compiled autograd can capture)."""
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        yield


def full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def train(model: nn.Module, run: Callable[[nn.Module, torch.Tensor], None], rank: int,
          width: int) -> dict[str, Any]:
    """Two steps of ``run`` against eager DDP over ``Net(width)`` built from the same seed as
    ``model``; the gradient comparison."""
    torch.manual_seed(0)
    reference = DDP(Net(width))
    generator = torch.Generator().manual_seed(rank + 1)
    for _ in range(2):
        x = torch.randn(8, width, generator=generator)
        for m in (model, reference):
            for p in m.parameters():
                p.grad = None
        run(model, x)
        reference(x).pow(2).mean().backward()
    pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
    return {
        "max_diff": max((full(p.grad) - q.grad).abs().max().item() for p, q in pairs),
        "checksum": sum(full(p.grad).double().sum().item() for p, _ in pairs),
        "traces": aotkit.counters.counters["aot"]["traces"],
        "captures": aotkit.counters.counters["compiled_autograd"]["captures"],
    }


def loss_backward(model: nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()


def compiled_autograd_backward(model: nn.Module, x: torch.Tensor) -> None:
    with aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):
        model(x).pow(2).mean().backward()


def fsdp2(width: int) -> nn.Module:
    torch.manual_seed(0)
    model = Net(width)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def ddp_compile(rank: int) -> dict[str, Any]:
    """torch.compile over DDP: Dynamo's DDPOptimizer hands aotkit one graph per bucket."""
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=1)
    compiled = torch.compile(model, backend="aotkit")
    return train(model, lambda _, x: loss_backward(compiled, x), rank, 512)


def ddp_compiled_autograd(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with python_reducer():
        model = DDP(Net(64))
    return train(model, compiled_autograd_backward, rank, 64)


def fsdp2_compiled_autograd(rank: int) -> dict[str, Any]:
    """FSDP2 reshards and reduce-scatters in a callback its hooks queue on the engine."""
    return train(fsdp2(64), compiled_autograd_backward, rank, 64)


def ddp_compile_and_compiled_autograd(rank: int) -> dict[str, Any]:
    """PyTorch's recipe for compiled DDP: the Python reducer, torch.compile over the whole
    model and compiled autograd capturing the reducer's hooks in the backward."""
    torch.manual_seed(0)
    with python_reducer():
        model = DDP(Net(64))
        compiled = torch.compile(model, backend="aotkit")
        return train(model, lambda _, x: compiled_autograd_backward(compiled, x), rank, 64)


def ddp_over_aot_module(rank: int) -> dict[str, Any]:
    """DDP wraps the compiled module (its reducer's hooks fire on the parameters' gradients);
    aot_module over DDP is refused, naming this."""
    torch.manual_seed(0)
    try:
        aotkit.aot_module(DDP(nn.Linear(2, 2)), aotkit.compilers.nop)
    except aotkit.errors.ArgumentError as exc:
        assert "DistributedDataParallel(aot_module(model" in str(exc)
    else:
        raise AssertionError("aot_module(DDP(...)) was not refused")
    torch.manual_seed(0)
    model = DDP(aotkit.aot_module(Net(64), aotkit.compilers.nop))
    return train(model, loss_backward, rank, 64)


def fsdp2_over_aot_module(rank: int) -> dict[str, Any]:
    """FSDP2 shards the compiled layers (its hooks run around their calls); aot_module over a
    sharded model is refused, naming this."""
    try:
        aotkit.aot_module(fsdp2(8), aotkit.compilers.nop)
    except aotkit.errors.ArgumentError as exc:
        assert "fully_shard(aot_module(layer" in str(exc)
    else:
        raise AssertionError("aot_module over an FSDP2 model was not refused")
    torch.manual_seed(0)
    model = Net(64)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for i, layer in enumerate(model.layers):
        model.layers[i] = fully_shard(aotkit.aot_module(layer, aotkit.compilers.nop), mesh=mesh)
    return train(fully_shard(model, mesh=mesh), loss_backward, rank, 64)


SCENARIOS = [ddp_compile, ddp_compiled_autograd, ddp_compile_and_compiled_autograd,
             fsdp2_compiled_autograd, ddp_over_aot_module, fsdp2_over_aot_module]


def main(rank: int, world: int, store_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank,
                            world_size=world)
    results: dict[str, Any] = {}
    for scenario in SCENARIOS:
        torch._dynamo.reset()
        aotkit.counters.reset()
        aotkit.compiled_autograd.reset()
        try:
            results[scenario.__name__] = scenario(rank)
        except Exception as exc:  # reported to the test, which fails with it
            results[scenario.__name__] = {"error": "".join(traceback.format_exception(exc))}
        dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(results), flush=True)
    # The results are all the test reads. Under load, interpreter teardown sometimes aborted
    # after them ("terminate called without an active exception": a C++ thread of the
    # distributed runtime still joinable when its object is destroyed at exit), failing a rank
    # whose training had passed; skip that teardown.
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
