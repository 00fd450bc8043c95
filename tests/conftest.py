"""Shared test set-up: every test starts with fresh Dynamo caches, aotkit counters and
compiled-autograd state."""

from collections.abc import Iterator

import pytest
import torch

import aotkit


@pytest.fixture(autouse=True)
def clean_state() -> Iterator[None]:
    torch._dynamo.reset()
    aotkit.counters.reset()
    aotkit.compiled_autograd.reset()
    yield
    torch._dynamo.reset()
    aotkit.compiled_autograd.reset()
