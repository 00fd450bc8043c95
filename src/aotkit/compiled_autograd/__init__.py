"""Compiled autograd: capture a whole ``backward()`` as one FX graph, compile it, replay it.

The C++ autograd engine calls our capture object node by node (see
:mod:`aotkit.compiled_autograd.capture`); hooks, custom Function backwards and gradient
accumulation become graph calls placed where eager runs them. The graph a compiler gets is
lowered to the ATen ops of the backward formulas (:mod:`aotkit.compiled_autograd.lower`).

    >>> import torch, aotkit
    >>> model = torch.nn.Linear(4, 2)
    >>> with aotkit.compiled_autograd.enable(aotkit.compiled_autograd.nop):
    ...     model(torch.randn(3, 4)).sum().backward()
"""

from aotkit.compiled_autograd.api import disable, enable, nop, reset

__all__ = ["disable", "enable", "nop", "reset"]
