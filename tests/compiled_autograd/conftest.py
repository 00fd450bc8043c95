"""Compiled-autograd tests start and end with an empty engine cache and no compiler installed."""

from collections.abc import Iterator

import pytest

import aotkit


@pytest.fixture(autouse=True)
def clean_compiled_autograd() -> Iterator[None]:
    aotkit.compiled_autograd.reset()
    aotkit.counters.reset()
    yield
    aotkit.compiled_autograd.reset()
