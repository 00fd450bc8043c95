"""Graph compilers: ``compiler(gm, example_inputs) -> boxed callable``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from aotkit.aot.boxing import make_boxed_func

__all__ = ["nop"]


def nop(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
    """Run the graph as it is (through its generated Python code).

    Example::

        >>> import torch, aotkit
        >>> f = aotkit.aot_function(torch.sin, aotkit.compilers.nop)
        >>> f(torch.zeros(1))
        tensor([0.])
    """
    return make_boxed_func(gm.forward)
