"""The torch.compile entry: AOT autograd over a graph Dynamo captured, with Dynamo's fake inputs
and ShapeEnv."""

from __future__ import annotations

import copy
import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from aotkit import config, counters
from aotkit.aot.api import AotOptions, Partitioner, compile_graphs
from aotkit.aot.arguments import has_tangents, note_forward_ad, refuse_dual_outputs
from aotkit.aot.boxing import Compiler
from aotkit.aot.dynamo_decisions import note_dynamo_recompile
from aotkit.aot.frames import region
from aotkit.aot.offsets import moved_offsets, storage_offsets
from aotkit.aot.runtime import CompiledGraphs, run
from aotkit.aot.signature import config_changes
from aotkit.aot.trace import COMPILE_LOCK
from aotkit.compat import (
    FakeTensor,
    FakeTensorMode,
    dynamo_fallback_errors,
    hide_from_dynamo,
    new_fake_mode,
)
from aotkit.errors import AotkitError, ArgumentError, RecompileLimitError, UnsupportedError
from aotkit.partition.default import default_partition

log = logging.getLogger("aotkit.aot")


def aot_module_simplified(
    mod: fx.GraphModule | nn.Module,
    args: Sequence[Any],
    fw_compiler: Compiler,
    bw_compiler: Compiler | None = None,
    partition_fn: Partitioner = default_partition,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    keep_inference_input_mutations: bool = False,
    inference_compiler: Compiler | None = None,
) -> Callable[..., Any]:
    """The ``torch.compile`` entry: compile a graph for flat ``args`` (fake tensors and SymInts
    from Dynamo, or real tensors) once, using the inputs' fake mode and ShapeEnv.

    Parameters and buffers of ``mod`` (if any) become leading inputs. Returns ``f(*args)``.

    Example::

        >>> import torch, aotkit
        >>> def backend(gm, example_inputs):
        ...     return aotkit.aot_module_simplified(gm, example_inputs, aotkit.compilers.nop)
        >>> f = torch.compile(lambda x: x.cos() + 1, backend=backend)
        >>> f(torch.zeros(2))
        tensor([2., 2.])
    """
    from torch._guards import detect_fake_mode

    hide_from_dynamo()  # Note [aotkit's code is not user code to Dynamo]: whatever compiler runs
    if not isinstance(mod, nn.Module) or not isinstance(args, (list, tuple)):
        raise ArgumentError(
            "aot_module_simplified(mod, args, ...) takes an nn.Module (or GraphModule) and the "
            f"list of its example inputs, got {type(mod).__name__} and {type(args).__name__}."
            "\nFix: pass [x] for one input; use aotkit.aot_function for plain functions.")
    if isinstance(mod, fx.GraphModule) and any(isinstance(a, (list, tuple)) for a in args):
        return _with_list_inputs(mod, args, lambda gm, flat: aot_module_simplified(
            gm, flat, fw_compiler, bw_compiler, partition_fn, decompositions,
            keep_inference_input_mutations, inference_compiler))
    state = [*mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False)]
    names = [n for n, _ in state]
    tensors = [t for _, t in state]
    mode = detect_fake_mode(args) or new_fake_mode(allow_non_fake_inputs=True)
    fakes = _to_fakes(mode, [*tensors, *args])
    options = AotOptions(fw_compiler, bw_compiler, partition_fn, decompositions, len(names),
                         keep_inference_input_mutations, inference_compiler)

    def flat_fn(*flat: Any) -> tuple[list[Any], pytree.TreeSpec]:
        params = dict(zip(names, flat[: len(names)], strict=True))
        with torch.nn.utils.stateless._reparametrize_module(mod, params):
            out = _run_keeping_node_meta(mod, flat[len(names):], name)
        outs, spec = pytree.tree_flatten(out)
        refuse_dual_outputs(outs, name)
        return outs, spec

    name = f"aot_module_simplified({region(mod)})"
    note_dynamo_recompile(name)
    try:
        graphs = compile_graphs(flat_fn, fakes, options, name, mode, from_dynamo=True)
    except AotkitError as exc:
        _let_dynamo_split(exc, name)
        raise
    by_options = _ByOptions(graphs, name, options.config_parts, lambda: compile_graphs(
        flat_fn, fakes, options, name, mode, from_dynamo=True))
    expected = len(args)
    at_offsets = _OffsetsTraced(fakes, names, name)

    def forward(*runtime_args: Any) -> Any:
        if len(runtime_args) != expected:
            raise ArgumentError(f"{name} takes {expected} argument(s), as it was compiled for, "
                                f"got {len(runtime_args)} (the module's parameters and buffers "
                                "are passed for you).")
        if has_tangents(runtime_args):  # Note [Forward-mode AD runs eagerly]
            note_forward_ad(name)
            return mod(*runtime_args)
        current = by_options.current()
        flat = [*tensors, *runtime_args]
        if current.absolute_offsets and at_offsets.moved(flat):
            return mod(*runtime_args)
        return current.meta.unflatten(run(current, flat))

    forward.graphs = graphs  # type: ignore[attr-defined]
    return forward


# Note [Absolute storage offsets under Dynamo]
# Dynamo does not guard on storage offsets, and a graph placing a view at an absolute storage
# offset (Note [Absolute storage offsets]: a custom op writing ``y[::2]`` is handed the view
# rebuilt at the offset it had when traced) would write other elements of an input that starts
# elsewhere in its memory. Such a call runs Dynamo's graph eagerly instead, a "fallback"
# decision naming the input; aot_function traces again for the new offsets.
class _OffsetsTraced:
    """The static storage offsets Dynamo's inputs were traced with."""

    def __init__(self, fakes: Sequence[Any], names: Sequence[str], name: str) -> None:
        traced = storage_offsets(fakes)
        self.positions = [i for i, o in enumerate(traced) if type(o) is int]
        self.offsets = tuple(traced[i] for i in self.positions)
        self.names = [*names, *(f"args[{i}]" for i in range(len(fakes) - len(names)))]
        self.name = name

    def moved(self, flat: Sequence[Any]) -> bool:
        why = moved_offsets(self.offsets, self.positions, flat, self.names)
        if why is None:
            return False
        counters.bump("aot", "offset_eager_calls")
        counters.record_once("fallback", self.name, f"{why}: Dynamo does not guard on it, so "
                             "calls at other offsets run eagerly (Note [Absolute storage offsets "
                             "under Dynamo]; counted in aot.offset_eager_calls). Fix: none "
                             "needed, the results are eager's; call with inputs at the traced "
                             "offsets to run the graph.", once="storage offsets", logger=log)
        return True


# Note [Options changed after torch.compile]
# Dynamo guards on the inputs, not on aotkit.config: a graph it compiled kept the partition and
# the calls it was compiled with after ``aotkit.config.activation_memory_budget`` or
# ``bind_aten_calls`` changed, where aot_function's entries are keyed on them. Each call
# compares the options that concern the graph (AotOptions.config_parts) with the ones it was
# compiled for, and a change traces Dynamo's graph again on the fake inputs it came with, a
# "recompile" decision naming the option. A value seen before reuses its graphs.
class _ByOptions:
    """The graphs for the current values of the options they depend on (Note [Options changed
    after torch.compile]): the last value is checked first, by identity (cache_key returns one
    tuple per value)."""

    def __init__(self, graphs: CompiledGraphs, name: str, parts: tuple[str, ...],
                 compile_again: Callable[[], CompiledGraphs]) -> None:
        self.name, self.parts, self.compile_again = name, parts, compile_again
        self.last, self.last_graphs = config.cache_key(*parts), graphs
        self.compiled = {self.last: graphs}

    def current(self) -> CompiledGraphs:
        key = config.cache_key(*self.parts)
        if key is self.last:
            return self.last_graphs
        with COMPILE_LOCK:
            return self._for(key)

    def _for(self, key: tuple[tuple[str, Any], ...]) -> CompiledGraphs:
        found = self.compiled.get(key)
        if found is None:
            changes = "; ".join(config_changes(self.last, key))
            if len(self.compiled) >= config.recompile_limit:
                raise RecompileLimitError(
                    f"{self.name} has been compiled for {len(self.compiled)} values of aotkit's "
                    f"options (aotkit.config.recompile_limit); this call would compile another "
                    f"({changes}).\nFix: keep the options fixed while it runs, or raise the "
                    "limit with aotkit.config.patch(recompile_limit=...).")
            counters.record("recompile", self.name, changes, logger=log)
            found = self.compiled[key] = self.compile_again()
        self.last, self.last_graphs = key, found
        return found


# Note [Graph breaks for Dynamo]
# Dynamo splits its graph where a backend raises one of fake tensors' "cannot trace this"
# exceptions (data-dependent output or shape, an op without a fake kernel) and runs that part
# eagerly, as it does for backend="aot_eager". aotkit turns those into TraceError or
# UnsupportedError with a fix; under a Dynamo compile the original exception is raised instead,
# so torch.compile splits the graph as our message promises, and a "graph_break" decision keeps
# our message.
def _let_dynamo_split(exc: AotkitError, name: str) -> None:
    """See Note [Graph breaks for Dynamo]: raise ``exc``'s fake-tensor cause under Dynamo."""
    from torch._guards import TracingContext

    cause = exc.__cause__
    if TracingContext.try_get() is None or not isinstance(cause, dynamo_fallback_errors()):
        return
    counters.record("graph_break", name, f"{str(exc).splitlines()[0]} Dynamo splits its graph "
                    f"there and runs that part eagerly ({type(cause).__name__}).", logger=log)
    raise cause.with_traceback(cause.__traceback__) from None


def _run_keeping_node_meta(mod: nn.Module, args: Sequence[Any], name: str = "") -> Any:
    """Run ``mod``; a GraphModule runs node by node so traced ops inherit each node's meta
    (Dynamo's stack traces), which costs nothing compared with recording stacks anew."""
    if not isinstance(mod, fx.GraphModule):
        return mod(*args)
    from torch.fx import traceback as fx_traceback

    with fx_traceback.preserve_node_meta():
        return fx.Interpreter(_inline_regions(mod, name)).run(*args)


# Note [Nested compile regions are inlined]
# Dynamo calls a torch.compiler.nested_compile_region through the invoke_subgraph higher-order
# op. Traced as that op, its backward is a second subgraph that recomputes the whole region
# from its inputs: PyTorch's AOT autograd partitions each such pair again afterwards, and
# without that pass a dropout inside drew a fresh mask in the backward (wrong gradients). aotkit
# puts the region's body in place of each call instead, so its ops reach the partitioner like
# any others (random ops run once); the region is then compiled with each graph that calls it,
# not once. Calls inside the bodies of other higher-order ops (a region called twice inside a
# torch.utils.checkpoint, a torch.cond branch) are replaced too: Dynamo leaves those as
# invoke_subgraph, which the body's own trace would run as that op.
def _inline_regions(gm: fx.GraphModule, name: str) -> fx.GraphModule:
    """``gm`` with every nested compile region call, in it and in the graphs of its
    higher-order ops, replaced by the region's body; ``gm`` itself when it calls none."""
    bodies = {attr: _inline_regions(sub, name) for attr, sub in gm.named_children()
              if isinstance(sub, fx.GraphModule)}
    regions = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    if not regions and all(body is getattr(gm, attr) for attr, body in bodies.items()):
        return gm
    graph, attrs = fx.Graph(), {}
    env: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.invoke_subgraph:
            body, identifier, *operands = node.args
            _record_inlined(name, identifier)
            env[node] = _copy_body(graph, attrs, bodies[body.target], [env[o] for o in operands])
        elif node.target is operator.getitem and isinstance(env.get(node.args[0]), tuple):
            env[node] = env[node.args[0]][node.args[1]]  # one output of an inlined region
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
            if node.op in ("get_attr", "call_module"):
                attrs[node.target] = bodies.get(node.target) or operator.attrgetter(node.target)(gm)
    graph.set_codegen(gm.graph._codegen)  # an exported module's pytree inputs and outputs
    inlined = fx.GraphModule(attrs, graph)
    inlined.meta.update(gm.meta)
    return inlined


def _copy_body(graph: fx.Graph, attrs: dict[str, Any], body: fx.GraphModule,
               operands: list[Any]) -> tuple[Any, ...]:
    """Copy ``body``'s nodes into ``graph`` reading ``operands``; returns its outputs."""
    env: dict[fx.Node, Any] = dict(zip(body.graph.find_nodes(op="placeholder"), operands,
                                       strict=True))
    for node in body.graph.nodes:
        if node.op == "output":
            return tuple(fx.node.map_arg(node.args[0], env.__getitem__))
        if node.op == "get_attr":  # under a name of its own in the caller's graph
            fresh = f"{node.target.replace('.', '_')}_{len(attrs)}"
            attrs[fresh] = operator.attrgetter(node.target)(body)
            env[node] = graph.get_attr(fresh)
            env[node].meta.update(node.meta)
        elif node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    raise AssertionError("a graph without an output node")


def _record_inlined(name: str, identifier: Any) -> None:
    if name and not counters.counters["inline"].get(f"{name}: {identifier}"):
        counters.record("inline", f"{name}: {identifier}", (
            "a torch.compiler.nested_compile_region is traced inline (Note [Nested compile "
            "regions are inlined]): compiled as part of this graph, once per graph that "
            "calls it"), logger=log)


# Note [Inputs Dynamo passes as a list]
# PyTorch's compiled autograd, compiling its captured backward with torch.compile(backend=
# "aotkit"), has Dynamo hand the backend one list input (``L_inputs_``: the gradients and saved
# tensors, real ones) which the graph indexes, and which the backend is to empty once read
# (``steal_arg``) so that its tensors can be freed. Traced as it was, the list's real tensors
# reached the fake mode (a raw AssertionError). Each list becomes one placeholder per item: the
# graph is compiled for flat inputs, and each call flattens the lists it is given, emptying
# those the graph steals.
def _with_list_inputs(gm: fx.GraphModule, args: Sequence[Any],
                      compile_flat: Callable[[fx.GraphModule, list[Any]], Any]) -> Callable[..., Any]:
    """``gm`` compiled by ``compile_flat`` for the items of its list inputs, called with the
    lists (Note [Inputs Dynamo passes as a list])."""
    flat_gm, flat_args, flatten = _flatten_list_inputs(gm, args)
    compiled = compile_flat(flat_gm, flat_args)

    def called_with_lists(*runtime_args: Any) -> Any:
        return compiled(*flatten(runtime_args))

    called_with_lists.graphs = compiled.graphs  # type: ignore[attr-defined]
    return called_with_lists


def _flatten_list_inputs(gm: fx.GraphModule, args: Sequence[Any]) -> tuple[
        fx.GraphModule, list[Any], Callable[[Sequence[Any]], list[Any]]]:
    """A copy of ``gm`` taking the items of its list inputs as inputs of their own (Dynamo
    reads ``gm``'s placeholders after the backend returns), the flat example inputs, and what
    flattens a call's arguments."""
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    graph = gm.graph
    lists: list[tuple[int, bool]] = []  # (position, stolen) of each list input
    for position, (node, arg) in enumerate(zip(graph.find_nodes(op="placeholder"), args,
                                               strict=True)):
        if not isinstance(arg, (list, tuple)):
            continue
        reads = list(node.users)
        if not all(r.target is operator.getitem and isinstance(r.args[1], int) for r in reads):
            raise UnsupportedError(
                f"aot_module_simplified: the graph's input {node.name} is a "
                f"{type(arg).__name__}, which the graph uses otherwise than by indexing it "
                f"({', '.join(r.format_node() for r in reads if r.target is not operator.getitem)})."
                "\nFix: pass its items as inputs of their own.")
        with graph.inserting_before(node):
            items = [graph.placeholder(f"{node.name}_{i}") for i in range(len(arg))]
        for read in reads:
            items[read.args[1]].meta.update(read.meta)
            read.replace_all_uses_with(items[read.args[1]])
            graph.erase_node(read)
        graph.erase_node(node)
        lists.append((position, bool(node.meta.get("steal_arg")) and isinstance(arg, list)))
    gm.recompile()
    positions = {position for position, _ in lists}
    stolen = [position for position, steal in lists if steal]

    def flat(call_args: Sequence[Any]) -> list[Any]:
        return [x for i, a in enumerate(call_args) for x in (a if i in positions else (a,))]

    def flatten(call_args: Sequence[Any]) -> list[Any]:
        out = flat(call_args)
        for i in stolen:
            call_args[i].clear()
        return out

    return gm, flat(args), flatten


def _to_fakes(mode: FakeTensorMode, xs: list[Any]) -> list[Any]:
    """Fakes of real tensors, one per position: a tensor passed twice gets a second fake, which
    shares its memory, so that the graph is right for separate tensors too (Note [One tensor
    passed twice]); Dynamo passes fakes, and never one twice."""
    seen: set[int] = set()
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
            again = id(x) in seen  # the fake mode would hand out the first fake again
            seen.add(id(x))
            x = mode.from_tensor(x.detach().requires_grad_(x.requires_grad) if again else x)
        out.append(x)
    return out
