"""aotkit: ahead-of-time graph compilation for PyTorch.

    >>> import torch, aotkit
    >>> f = aotkit.aot_function(lambda x: x.sin() * 2, aotkit.compilers.nop)
    >>> x = torch.ones(2, requires_grad=True)
    >>> f(x).sum().backward()
"""

from aotkit import compiled_autograd, compilers, config, counters, errors, partition
from aotkit.aot import (
    AotFunction,
    AotModule,
    aot_function,
    aot_module,
    aot_module_simplified,
    make_boxed_compiler,
    make_boxed_func,
)
from aotkit.counters import explain
from aotkit.partition import default_partition, min_cut_rematerialization_partition

__version__ = "0.1.0"

__all__ = [
    "AotFunction",
    "AotModule",
    "aot_function",
    "aot_module",
    "aot_module_simplified",
    "compiled_autograd",
    "compilers",
    "config",
    "counters",
    "default_partition",
    "errors",
    "explain",
    "make_boxed_compiler",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
    "partition",
]
