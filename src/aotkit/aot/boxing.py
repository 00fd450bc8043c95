"""The boxed calling convention: a compiled callable takes one list it may clear to free inputs."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from aotkit import counters
from aotkit.compat import hide_from_dynamo
from aotkit.errors import AotkitError, ArgumentError, CompilerError
from aotkit.partition.graph import is_impure

if TYPE_CHECKING:
    from aotkit.aot.analysis import AotMeta

Compiler = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]


def refused_call(fn: Callable[..., Any], num_args: int) -> str | None:
    """``fn``'s name and signature where it cannot be called with ``num_args`` positional
    arguments (a compiler of the wrong kind), else None (also where it has no signature)."""
    try:
        signature = inspect.signature(fn, follow_wrapped=False)  # a wrapper's own, not its target's
    except (TypeError, ValueError):  # no signature to read (some builtins): the call will tell
        return None
    try:
        signature.bind(*[None] * num_args)
    except TypeError:
        name = getattr(fn, "__name__", type(fn).__name__)
        return f"{name}{signature}"
    return None

def make_boxed_func(f: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    """Wrap ``f(*args)`` as ``g(args)``, the boxed convention.

    Example::

        >>> from aotkit import make_boxed_func
        >>> g = make_boxed_func(lambda a, b: a + b)
        >>> g([1, 2]), g._boxed_call
        (3, True)
    """
    _require_callable("make_boxed_func", f, "the function a compiler returns, e.g. gm.forward")
    if getattr(f, "_boxed_call", False):
        return f

    def boxed(*call: Any) -> Any:
        require_boxed(call, getattr(f, "__name__", "this compiled graph"))
        return f(*call[0])

    boxed._boxed_call = True  # type: ignore[attr-defined]
    return boxed


# Note [Freeing inputs as the graph goes]
# Eager's engine frees what a node saved for backward as soon as that node's backward has run;
# a backward graph that holds every saved activation until it returns peaks higher (an MLP
# step on CUDA: 8.3 MiB against eager's 7.1). FX's generated code drops each value after its
# last use, but a placeholder is also held by the caller's argument list. So a graph run boxed
# takes the list itself, moves its values into locals and empties the list; the runtime drops
# its own references (and the node's saved tensors, unless the graph is retained) before the
# call. A graph whose caller still reads the list afterwards (the forward's alias checks) is
# handed a copy; so must a user calling such a callable twice with one list (as with
# Inductor's). A graph taking pytrees (make_fx of a function of a dict) keeps its own calls.
class _TakesList(fx.graph.CodeGen):
    """Code for ``forward(self, args)`` that unpacks the placeholders and empties ``args``."""

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str,
                   **_: Any) -> str:
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        boxed = "args"
        while boxed in names:  # a placeholder named ``args`` (symbolic_trace of forward(args))
            boxed += "_"
        head = f"def {self._func_name}(self, {boxed}){maybe_return_annotation}:"
        return f"{head}\n    {', '.join(names)}, = {boxed}\n    {boxed}.clear()" if names else head


def run_boxed(gm: fx.GraphModule) -> Callable[[list[Any]], Any]:
    """A boxed callable running a copy of ``gm``'s code that frees each input after its last use
    (Note [Freeing inputs as the graph goes]); ``gm`` itself is not changed.

    Example::

        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> from aotkit.aot.boxing import run_boxed
        >>> run = run_boxed(make_fx(lambda a, b: a * b)(torch.ones(2), torch.ones(2)))
        >>> args = [torch.full((2,), 2.0), torch.full((2,), 3.0)]
        >>> run(args), args
        (tensor([6., 6.]), [])
    """
    if type(gm.graph._codegen) is not fx.graph.CodeGen:  # pytree inputs: flattened by its code
        return make_boxed_func(gm.forward)
    graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(_TakesList())
    module = fx.GraphModule(gm, graph)
    hide_from_dynamo(module)  # Note [aotkit's code is not user code to Dynamo]
    forward, count = module.forward, len(graph.find_nodes(op="placeholder"))

    def run(*call: Any) -> Any:
        require_boxed(call, "this compiled graph")
        args = call[0]
        if len(args) != count:
            raise ArgumentError(
                f"this compiled graph takes {count} input(s), got a list of {len(args)}: a "
                "boxed callable empties the list it is given, to free each input after its last "
                "use (Note [Freeing inputs as the graph goes]).\nFix: pass a fresh list at each "
                "call (inner(list(args)) where a wrapper calls it more than once).")
        return forward(args if isinstance(args, list) else list(args))

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def make_boxed_compiler(compiler: Compiler) -> Compiler:
    """Adapt a compiler returning an unboxed callable into one returning a boxed callable.

    Example::

        >>> import aotkit
        >>> boxed = aotkit.make_boxed_compiler(lambda gm, inputs: gm.forward)
    """
    _require_callable("make_boxed_compiler", compiler,
                      "a compiler, compiler(gm, example_inputs) -> callable")
    if (refused := refused_call(compiler, 2)) is not None:
        raise ArgumentError(
            f"make_boxed_compiler wraps a compiler called as compiler(gm, example_inputs), "
            f"but its signature is {refused}.\nFix: wrap a function of the graph module and "
            "its example inputs returning a callable (lambda gm, inputs: gm.forward).")

    def boxed_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        compiled = compiler(gm, example_inputs)
        # Not callable: returned as is, for compile_boxed to name the compiler and the graph.
        return make_boxed_func(compiled) if callable(compiled) else compiled

    boxed_compiler.__name__ = getattr(compiler, "__name__", "boxed_compiler")
    return boxed_compiler


def require_boxed(call: tuple[Any, ...], name: str) -> None:
    if len(call) != 1 or not isinstance(call[0], (list, tuple)):
        raise ArgumentError(
            f"{name} takes its inputs boxed, as one list, but was called with {len(call)} "
            "argument(s).\nFix: aotkit compilers return boxed callables for AOT autograd; with "
            "torch.compile use backend='aotkit' / 'aotkit_debug' / 'aotkit_inductor', not the "
            "compiler itself."
        )


def _require_callable(who: str, value: Any, what: str) -> None:
    if not callable(value):
        raise ArgumentError(
            f"{who} wraps a callable, got {type(value).__name__} {value!r}.\nFix: pass {what}."
        )


def compile_boxed(compiler: Compiler, gm: fx.GraphModule, example_inputs: Sequence[Any],
                  what: str) -> Callable[[list[Any]], Any]:
    """Run a compiler and return its result as a boxed callable, with a clear error on failure,
    and on every call a check that it returned one value per graph output
    (Note [Checking what compiled graphs return])."""
    name = getattr(compiler, "__name__", type(compiler).__name__)
    try:
        with torch._C._DisableAutocast():  # Note [Compiling outside autocast]
            compiled = compiler(gm, list(example_inputs))
    except AotkitError:
        raise  # the compiler's own error already says what to fix
    except OSError as exc:  # a dumping compiler's folder (debug_dir, graph_dumper_aot)
        raise CompilerError(
            f"compiler {name!r} could not write the {what} graph: {type(exc).__name__}: {exc}\n"
            "Fix: give it a folder you can write to (for debug_compile: "
            "aotkit.config.debug_dir)."
        ) from exc
    except Exception as exc:
        raise CompilerError(
            f"compiler {name!r} failed on the {what} graph: {type(exc).__name__}: {exc}\n"
            "Fix: try aotkit.compilers.nop to check the graph itself, or aotkit.compilers.debug_nop."
        ) from exc
    if not callable(compiled):
        raise CompilerError(
            f"compiler {name!r} returned {type(compiled).__name__} for the {what} graph.\n"
            "Fix: return a callable from the compiler (gm.forward, or make_boxed_func(...))."
        )
    outputs = gm.graph.output_node().args[0]
    if not isinstance(outputs, (list, tuple)):
        return make_boxed_func(compiled)
    tensors = [i for i, o in enumerate(outputs)
               if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)]
    return _checked(make_boxed_func(compiled), len(outputs), tensors, name, what)


# Note [Compiling outside autocast]
# A graph traced under torch.autocast holds autocast's casts as ops of its own, and runs with
# autocast off (the runtime's _DisableAutocast). A first call, or a first backward, under
# autocast compiles the graph inside that region, and a compiler that runs the graph's ops
# while it compiles (Inductor propagates fake tensors through it) had them cast a second time:
# a float32 bmm that the traced graph keeps in float32 came out bfloat16 in Inductor's plan, its
# buffers got the wrong dtypes, and the generated code failed ("mat1 and mat2 must have the
# same dtype"). Compilers therefore run with autocast off too.

# Note [Checking what compiled graphs return]
# The runtime slices a compiled graph's result by position (user outputs, saved tensors, saved
# SymInts; one grad per input), so a callable that returns None, a single tensor or too few
# values would fail far away with an untyped error, or silently return wrong values (None for
# every output: the function returned None, and no gradient reached the inputs). Every call
# therefore checks the result's type and length, which costs one function call and a len();
# the first call also checks that every value the graph computes as a tensor is one. The values
# themselves (shapes, dtypes) are not checked here: that is debug_nop's job.
def _checked(boxed: Callable[[list[Any]], Any], expected: int, tensors: list[int], name: str,
             what: str) -> Callable[[list[Any]], Any]:
    unchecked = [True]

    def run(args: list[Any]) -> Any:
        outs = boxed(args)
        if not isinstance(outs, (list, tuple)) or len(outs) != expected:
            _refuse_outputs(outs, expected, name, what)
        if unchecked[0]:
            _refuse_non_tensors(outs, tensors, name, what)
            unchecked[0] = False
        return outs

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _refuse_non_tensors(outs: Sequence[Any], tensors: list[int], name: str, what: str) -> None:
    wrong = [i for i in tensors if not isinstance(outs[i], torch.Tensor)]
    if wrong:
        raise CompilerError(
            f"the callable compiler {name!r} made for the {what} graph returned "
            f"{type(outs[wrong[0]]).__name__} as output {wrong[0]}"
            f"{f' (and {len(wrong) - 1} more)' if len(wrong) > 1 else ''}, which the graph "
            "computes as a tensor.\nFix: return the graph's values, in order, as gm.forward "
            "does (make_boxed_func(gm.forward))."
        )


def _refuse_outputs(outs: Any, expected: int, name: str, what: str) -> None:
    got = (f"{len(outs)} value(s)" if isinstance(outs, (list, tuple))
           else f"{type(outs).__name__}, not a list or tuple")
    raise CompilerError(
        f"the callable compiler {name!r} made for the {what} graph returned {got}; the "
        f"{what} graph has {expected} output(s).\nFix: return a list or tuple with one value "
        "per output of the graph, in order, as gm.forward does (make_boxed_func(gm.forward))."
    )


def compiler_for_views(compiler: Compiler, meta: AotMeta, args: Sequence[Any],
                       name: str) -> Compiler:
    """Note [Views of inputs with gaps]: a compiler whose outputs are never the views the
    function made (Inductor: ``returns_views = False``) cannot give such a view; the graph runs
    as traced instead (a "fallback" decision), before any call wrote the input."""
    from aotkit.compilers.basic import nop  # the compilers import aotkit.aot

    if getattr(compiler, "returns_views", True):
        return compiler
    gappy = [out.base for out in meta.outputs if out.replay_only]
    if not gappy:
        return compiler
    counters.record("fallback", name, (
        f"returns a view of input {gappy[0]} (strides {tuple(args[gappy[0]].stride())}, with "
        "gaps), which it writes in place, and the compiler returns no views: the graph runs as "
        "traced (aotkit.compilers.nop)"), logger=logging.getLogger("aotkit.aot"))
    return nop


def checked_partition(graphs: Any, num_fw_outputs: int, who: str, name: str, fix: str
                      ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """A partitioner's result for the graphs of ``name``, refused where it is not a forward
    and a backward graph that fit each other: the forward takes no tangents and saves what the
    backward takes."""
    if not (isinstance(graphs, (tuple, list)) and len(graphs) == 2
            and all(isinstance(g, fx.GraphModule) for g in graphs)):
        raise CompilerError(f"{who} returned {type(graphs).__name__} for {name}, not two "
                            f"GraphModules.\n{fix}")
    forward, backward = graphs
    if any(n.name.startswith("tangents") for n in forward.graph.find_nodes(op="placeholder")):
        raise CompilerError(f"{who} returned a forward graph for {name} that takes the joint "
                            f"graph's tangents (the joint graph itself?).\n{fix}")
    saved = len(forward.graph.output_node().args[0]) - num_fw_outputs
    if saved != (taken := sum(not n.name.startswith("tangents")
                              for n in backward.graph.find_nodes(op="placeholder"))):
        raise CompilerError(f"{who} returned a forward graph for {name} saving {saved} value(s) "
                            f"and a backward graph taking {taken}.\n{fix}")
    _drop_dead_forward_draws(backward)
    return forward, backward


def _drop_dead_forward_draws(backward: fx.GraphModule) -> None:
    """A partitioner may leave in the backward a copy of forward ops whose result nothing
    reads (PyTorch's ``default_partition`` keeps a recomputed dropout: dead code elimination
    keeps random ops). Run, it would draw again, shifting every later random number from
    eager's; such draws, and what only they read, are dropped."""
    graph, dropped = backward.graph, False
    while True:
        dead = [n for n in graph.nodes if n.op == "call_function" and not n.users
                and n.meta.get("partitioner_tag") == "is_forward"
                and isinstance(n.target, torch._ops.OpOverload)
                and torch.Tag.nondeterministic_seeded in n.target.tags]
        for node in dead:
            graph.erase_node(node)
        if not (graph.eliminate_dead_code(is_impure_node=is_impure) or dead):
            break
        dropped = True
    if dropped:
        backward.recompile()
