"""``torch.compile`` backends, registered through the ``torch_dynamo_backends`` entry point so
``torch.compile(model, backend="aotkit")`` works right after ``pip install aotkit``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from aotkit import compilers
from aotkit.aot import aot_module_simplified
from aotkit.aot.boxing import Compiler, make_boxed_func


def _no_dynamo(compiler: Compiler) -> Compiler:
    """Compiled graphs run outside Dynamo: the backward may run while a frame is being traced."""

    def wrapped(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        compiled = make_boxed_func(compiler(gm, example_inputs))
        disabled = torch._dynamo.disable(compiled)
        disabled._boxed_call = True  # type: ignore[attr-defined]
        return disabled

    wrapped.__name__ = getattr(compiler, "__name__", "compiler")
    return wrapped


def aotkit_nop(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """``backend="aotkit"``: AOT autograd with the ``nop`` compiler (graphs run as Python).

    Example::

        >>> import torch
        >>> f = torch.compile(lambda x: x.sin() + 1, backend="aotkit")
        >>> f(torch.zeros(2))
        tensor([1., 1.])
    """
    nop = _no_dynamo(compilers.nop)
    return aot_module_simplified(gm, example_inputs, fw_compiler=nop, bw_compiler=nop)
