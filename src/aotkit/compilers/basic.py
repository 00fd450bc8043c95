"""Compilers that run the graph as Python: ``nop`` and the inspection compilers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from aotkit.aot.boxing import make_boxed_func


def nop(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
    """Run the graph as it is (through its generated Python code).

    Example::

        >>> import torch, aotkit
        >>> f = aotkit.aot_function(torch.sin, aotkit.compilers.nop)
        >>> f(torch.zeros(1))
        tensor([0.])
    """
    return make_boxed_func(gm.forward)


def print_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
    raise NotImplementedError("helper A")


def debug_nop(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
    raise NotImplementedError("helper A")


def draw_graph_compile(name: str) -> Callable[..., Any]:
    raise NotImplementedError("helper A")
