"""Graph compilers: ``compiler(gm, example_inputs) -> boxed callable``."""

from aotkit.compilers.basic import debug_nop, draw_graph_compile, nop, print_compile
from aotkit.compilers.dump import debug_compile, get_inputs, graph_dumper_aot
from aotkit.compilers.inductor import inductor
from aotkit.compilers.torchscript import (
    default_decompositions,
    memory_efficient_fusion,
    nnc_jit,
    simple_ts_compile,
    ts_compile,
)

__all__ = [
    "debug_compile",
    "debug_nop",
    "default_decompositions",
    "draw_graph_compile",
    "get_inputs",
    "graph_dumper_aot",
    "inductor",
    "memory_efficient_fusion",
    "nnc_jit",
    "nop",
    "print_compile",
    "simple_ts_compile",
    "ts_compile",
]
