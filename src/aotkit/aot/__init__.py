"""AOT autograd: forward and backward of a function or module as ATen FX graphs."""

from aotkit.aot.api import AotFunction, AotModule, aot_function, aot_module, aot_module_simplified
from aotkit.aot.boxing import make_boxed_compiler, make_boxed_func

__all__ = [
    "AotFunction",
    "AotModule",
    "aot_function",
    "aot_module",
    "aot_module_simplified",
    "make_boxed_compiler",
    "make_boxed_func",
]
