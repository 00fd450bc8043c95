"""Compiled autograd: capture a whole ``backward()`` as one FX graph, compile it, replay it.

The C++ autograd engine calls our capture object node by node (see
:mod:`aotkit.compiled_autograd.capture`); hooks, custom Function backwards and gradient
accumulation become graph calls placed where eager runs them.

    >>> import torch, aotkit
    >>> model = torch.nn.Linear(4, 2)
    >>> with aotkit.compiled_autograd.enable(lambda gm: gm):
    ...     model(torch.randn(3, 4)).sum().backward()
"""

from aotkit.compiled_autograd.api import disable, enable, reset

__all__ = ["disable", "enable", "reset"]
