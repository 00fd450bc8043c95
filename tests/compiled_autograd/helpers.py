"""Run one training step eagerly and under compiled autograd, and compare."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

import aotkit


def nop(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    return gm


def counts() -> tuple[int, int]:
    """(captures, compiles) so far."""
    c = aotkit.counters.counters["compiled_autograd"]
    return c["captures"], c["compiles"]


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def assert_same_grads(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    assert expected.keys() == actual.keys()
    for name, want in expected.items():
        got = actual[name]
        assert (want is None) == (got is None), name
        if want is not None:
            torch.testing.assert_close(got, want, msg=lambda m, n=name: f"{n}: {m}")


def check_module(module: torch.nn.Module, inputs: list[torch.Tensor], steps: int = 1,
                 compiler: Callable[..., Any] = nop) -> None:
    """Eager vs compiled for ``steps`` backward passes of ``module(*inputs).sum()``."""
    eager = copy.deepcopy(module)
    compiled = copy.deepcopy(module)
    for _ in range(steps):
        expected_out = eager(*inputs)
        expected_out.sum().backward()
        with aotkit.compiled_autograd.enable(compiler):
            out = compiled(*inputs)
            out.sum().backward()
        torch.testing.assert_close(out, expected_out)
        assert_same_grads(grads(eager), grads(compiled))
