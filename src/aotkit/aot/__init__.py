"""AOT autograd: forward and backward of a function or module as ATen FX graphs."""

from aotkit.aot.api import AotFunction, aot_function
from aotkit.aot.boxing import make_boxed_compiler, make_boxed_func
from aotkit.aot.module import AotModule, aot_module
from aotkit.aot.simplified import aot_module_simplified

__all__ = [
    "AotFunction",
    "AotModule",
    "aot_function",
    "aot_module",
    "aot_module_simplified",
    "make_boxed_compiler",
    "make_boxed_func",
]
