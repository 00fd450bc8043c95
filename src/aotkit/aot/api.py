"""The public entry points of AOT autograd: ``aot_function``, ``aot_module``,
``aot_module_simplified``."""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from aotkit import config, counters
from aotkit.aot.analysis import Alias, AotMeta, SubclassOutputs, analyze
from aotkit.aot.arguments import (
    changed_value,
    check_compiler_signature,
    check_decompositions,
    check_params_buffers,
    flat_user_fn,
    has_tangents,
    leaf_names,
    make_fake,
    name_held_tensor,
    name_refused_input,
    note_forward_ad,
    record_identity_keys,
    refuse_tensor_sets,
    refuse_torch_function_overrides,
    shown_name,
    stored_tensor,
    subclass_dynamic,
    under_transform,
)
from aotkit.aot.bases import OverlapLayout
from aotkit.aot.boxing import Compiler, checked_partition, compile_boxed, compiler_for_views
from aotkit.aot.captured import Captured, captured_values, held_values
from aotkit.aot.captured import key as captured_key
from aotkit.aot.key_check import RecentKeys
from aotkit.aot.offsets import moved_offsets, storage_offsets, traced_for_offsets
from aotkit.aot.ops import may_overlap
from aotkit.aot.reads import (
    HeldTensors,
    Reads,
    argument_containers,
    changed_values,
    live_entries,
    module_containers,
    modules_held,
    note_module_counts,
    note_module_stores,
    put_back_containers,
    recording,
    symbolic_values,
)
from aotkit.aot.recompile_fixes import recompile_fix
from aotkit.aot.runtime import CompiledGraphs, run
from aotkit.aot.saved import saved_for_backward
from aotkit.aot.signature import (
    AutocastState,
    ShapeGuard,
    autocast_state,
    describe_change,
    differences,
    signature,
    tensor_positions,
)
from aotkit.aot.simplify import (
    detach_new_values,
    drop_noop_views,
    pin_factory_dtypes,
    tensorify_float_inputs,
)
from aotkit.aot.state import StateWatch
from aotkit.aot.subclass import Boundary, is_subclass
from aotkit.aot.tangents import tangent_formats
from aotkit.aot.trace import (
    COMPILE_LOCK,
    Fallback,
    FlatFn,
    autocast_as,
    metadata_write_order,
    require_graph_backward,
    trace_inference,
    trace_joint,
    trace_with_fallback,
    traced_from_outside,
    tracing,
    tracing_active,
)
from aotkit.aot.trace_errors import refuse_packed_constants
from aotkit.compat import (
    FakeTensorMode,
    dynamo_frames_off,
    forget_real_tensors,
    hide_from_dynamo_if_loaded,
    keep_stack_traces_of,
    new_fake_mode,
)
from aotkit.errors import (
    AotkitError,
    ArgumentError,
    CompilerError,
    RecompileLimitError,
    TraceError,
    UnsupportedError,
)
from aotkit.partition.default import default_partition
from aotkit.partition.report import PartitionReport, report

log = logging.getLogger("aotkit.aot")
_partition_log = logging.getLogger("aotkit.partition")

Partitioner = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]



@dataclass(frozen=True)
class AotOptions:
    """How to trace, partition and compile; one per ``aot_function`` / ``aot_module``."""

    fw_compiler: Compiler
    bw_compiler: Compiler | None = None
    partition_fn: Partitioner = default_partition
    decompositions: Mapping[Any, Callable[..., Any]] | None = None
    num_params_buffers: int = 0
    keep_inference_input_mutations: bool = False
    inference_compiler: Compiler | None = None
    dynamic: bool = False

    @property
    def config_parts(self) -> tuple[str, ...]:
        """The parts of aotkit.config whose options change these graphs: the min-cut budget
        only where the partitioner may read it (not default_partition, nor a partial that
        fixes its own ``activation_memory_budget``)."""
        fn = self.partition_fn
        fixed = isinstance(fn, functools.partial) and "activation_memory_budget" in fn.keywords
        return ("aot",) if fn is default_partition or fixed else ("aot", "min_cut")

    def __post_init__(self) -> None:
        for role in ("fw_compiler", "bw_compiler", "partition_fn", "inference_compiler"):
            value = getattr(self, role)
            optional = role in ("bw_compiler", "inference_compiler")
            if not callable(value) and not (optional and value is None):
                raise ArgumentError(
                    f"{role} must be callable, got {type(value).__name__} {value!r}.\nFix: pass "
                    "a function such as aotkit.compilers.nop (compilers) or "
                    "aotkit.min_cut_rematerialization_partition (partition_fn)."
                )
            if role != "partition_fn" and value is not None:
                check_compiler_signature(role, value)
        check_decompositions(self.decompositions)
        for flag in ("dynamic", "keep_inference_input_mutations"):
            value = config.plain_bool(getattr(self, flag))
            object.__setattr__(self, flag, value)  # frozen
            if not isinstance(value, bool):  # "False" would read as on
                kind = type(value)
                shown = kind.__name__ if kind.__module__ == "builtins" else \
                    f"{kind.__module__}.{kind.__qualname__}"
                why = " (aotkit has no automatic dynamic shapes: None is not False)" \
                    if flag == "dynamic" else ""
                raise ArgumentError(f"{flag} must be True or False, got {shown} {value!r}.\nFix: "
                                    f"pass {flag}=True or {flag}=False{why}.")
        n = self.num_params_buffers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ArgumentError(
                f"num_params_buffers must be a non-negative int, got {type(n).__name__} {n!r}.\n"
                "Fix: pass how many leading arguments are parameters and buffers (0 if none)."
            )


def compile_graphs(flat_fn: FlatFn, args: Sequence[Any], options: AotOptions, name: str,
                   mode: FakeTensorMode, from_dynamo: bool = False) -> CompiledGraphs:
    """Trace ``flat_fn`` on fake ``args``, partition and compile: the core of every entry point.
    ``from_dynamo``: the graph is Dynamo's, whose float arguments are rewritten into tensor ops
    (Note [Float arguments from Dynamo]). Subclass arguments are traced as their plain parts
    (Note [Tensor subclasses])."""
    try:
        return _compile_within(Boundary.of(args), flat_fn, args, options, name, mode, from_dynamo)
    except SubclassOutputs:  # made inside from plain tensors: flattened at the outputs only
        return _compile_within(Boundary([None] * len(args)), flat_fn, args, options, name, mode,
                               from_dynamo)


def _compile_within(boundary: Boundary | None, flat_fn: FlatFn, args: Sequence[Any],
                    options: AotOptions, name: str, mode: FakeTensorMode,
                    from_dynamo: bool) -> CompiledGraphs:
    if boundary is not None:
        flat_fn = boundary.wrap_fn(flat_fn)
        with mode:
            args = boundary.trace_inputs(args)
    watched = StateWatch(flat_fn)
    with COMPILE_LOCK:  # Note [One compile at a time]
        graphs = _compile_graphs(watched, args, options, name, mode, from_dynamo)
    graphs.boundary = boundary
    graphs.state_after = watched.after  # Note [Global state the function leaves changed]
    if from_dynamo:  # Note [Subclasses with __torch_function__]
        graphs.no_overrides = torch._C.DisableTorchFunctionSubclass
    if boundary is not None and graphs.training and any(
            graphs.meta.inputs[i].mutated for i in boundary.subclass_parts()):
        raise UnsupportedError(
            f"{name} mutates a tensor subclass argument in place while autograd records; "
            "aotkit flattens subclasses into their parts, so the argument would not take the "
            "mutation's autograd history (its gradients would be wrong).\nFix: return the new "
            "value instead of mutating (y = x * 2), or mutate under torch.no_grad()."
        )
    if graphs.mutates_inputs:
        graphs.rebase = _rebasing(flat_fn, options, name)
    if graphs.bw_gm is not None and graphs.backward_error is None and _symbolic_inputs(args):
        try:
            graphs.backward_fn()  # Note [Backward compiled with a symbolic forward]
        except CompilerError as exc:
            raise CompilerError(
                f"{name}: the backward is compiled with the forward when sizes are symbolic "
                f"(Note [Backward compiled with a symbolic forward]), and that failed: {exc}"
            ) from exc
    return graphs


def _symbolic_inputs(args: Sequence[Any]) -> bool:
    """Whether any input has a symbolic size or stride, or is a symbolic number."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if any(isinstance(d, torch.SymInt) for d in (*a.shape, *a.stride())):
                return True
        elif isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
    return False


# Note [Backward compiled with a symbolic forward]
# The backward is compiled at the first backward() (many forwards are never differentiated),
# but a compiler can add shape guards (Inductor bounds a reduction's size it makes persistent),
# and the entry's guards are taken when the forward is compiled: aot_function's ShapeGuard,
# Dynamo's guards when the backend returns. A guard added later would be lost, and a call of
# sizes outside it would run a kernel built for sizes it does not have. With symbolic shapes
# the backward is therefore compiled with the forward (for backward() outside autocast, the
# common case; under autocast it is traced again at first use).
def _rebasing(flat_fn: FlatFn, options: AotOptions, name: str) -> Callable[
        [OverlapLayout, list[Any]], tuple[CompiledGraphs, dict[int, int]]]:
    """Entries of ``flat_fn`` for calls whose inputs overlap, keyed on the call's signature and
    layout, traced on first use. See Note [Overlapping mutated inputs]."""
    entries: dict[tuple[Any, ...], tuple[CompiledGraphs, dict[int, int]]] = {}

    def rebase(layout: OverlapLayout, args: list[Any]) -> tuple[CompiledGraphs, dict[int, int]]:
        key = (signature(len(args), args, False, options.config_parts), layout)
        found = entries.get(key)
        if found is None:
            with COMPILE_LOCK:
                found = entries.get(key) or _compile_on_bases(flat_fn, layout, args, options,
                                                              name, len(entries))
                entries[key] = found
        return found

    return rebase


def _compile_on_bases(flat_fn: FlatFn, layout: OverlapLayout, args: list[Any], options: AotOptions,
                      name: str, compiled: int) -> tuple[CompiledGraphs, dict[int, int]]:
    why = (f"{layout.describe()} and the function writes that memory: traced again "
           "with each shared storage as one input (Note [Overlapping mutated inputs])"
           + (", with static sizes: each new size or place of them compiles again"
              if options.dynamic else ""))
    if compiled >= config.recompile_limit:
        raise RecompileLimitError(
            f"{name} has been compiled for {compiled} layout(s) of inputs that share memory "
            f"(aotkit.config.recompile_limit); this call would compile another ({why}).\nFix: "
            "pass separate tensors (.clone() one of them), or raise the limit with "
            "aotkit.config.patch(recompile_limit=...)."
        )
    counters.record("recompile", name, why, logger=log)
    mode = _fake_mode(False)
    fakes = [make_fake(mode, a, k, False, f"input {k}") if isinstance(a, torch.Tensor) else a
             for k, a in enumerate(args)]
    returned: dict[int, int] = {}
    try:
        graphs = compile_graphs(layout.wrap(flat_fn, returned), fakes, options, name, mode)
    except TraceError as exc:
        if not options.dynamic:
            raise
        raise TraceError(
            f"{exc}\nThis call's inputs share memory and one is mutated, so it was traced with "
            "static sizes although the function was compiled with dynamic=True (Note "
            "[Overlapping mutated inputs]): pass separate tensors (.clone() one of them)."
        ) from exc
    finally:
        forget_real_tensors(mode)
    return graphs, returned


def _compile_graphs(flat_fn: FlatFn, args: Sequence[Any], options: AotOptions, name: str,
                    mode: FakeTensorMode, from_dynamo: bool) -> CompiledGraphs:
    counters.bump("aot", "traces")
    forward_autocast = autocast_state()
    training = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                               for a in args)
    primals = [_as_leaf(a) for a in args]
    grad_inside = False  # Note [Grad mode turned on inside]
    backward_error = None  # Note [Saved tensors the forward changes]

    def trace(fallback: Fallback) -> tuple[AotMeta, list[Any], fx.GraphModule, list[Any]]:
        nonlocal training, grad_inside, backward_error
        with tracing(mode, name, fallback=fallback, reseeds=from_dynamo) as generators:
            meta, fw_out_fakes = analyze(flat_fn, args, metadata_write_order())
            grad_inside = not training and _turns_grad_on(meta, args)
            training = training or grad_inside
            if not training:
                _refuse_grad_without_inputs(meta, name)
                return meta, fw_out_fakes, trace_inference(
                    flat_fn, args, meta, options.decompositions,
                    options.keep_inference_input_mutations), generators
            _refuse_leaf_metadata_mutation(meta, args, name)
            gm, backward_error = _trace_joint_or_defer_error(
                flat_fn, primals, meta, fw_out_fakes, options.decompositions, not grad_inside)
            require_graph_backward(gm, fallback)
            return meta, fw_out_fakes, gm, generators

    (meta, fw_out_fakes, gm, generators), fallback, absolute_offsets = traced_for_offsets(
        lambda: trace_with_fallback(trace, mode, name), mode)

    simplify = functools.partial(_simplify, mode=mode, name=name, from_dynamo=from_dynamo,
                                 keep_outputs=meta.num_fw_outputs if training else None)
    if not training:
        return _compile_inference(_insert_runtime_asserts(simplify(gm), mode, name, from_dynamo),
                                  meta, options, name, args, absolute_offsets)
    fw_gm, bw_gm = _partition(options.partition_fn, simplify(gm), args, meta.num_fw_outputs, name)
    fw_code = fw_gm.code  # before its runtime checks, which name fresh symbols in each trace
    _insert_runtime_asserts(fw_gm, mode, name, from_dynamo)
    _record_partition(name, options.partition_fn, fw_gm, meta.num_fw_outputs)
    _log_graphs(name, joint=gm, forward=fw_gm, backward=bw_gm)
    _mark_static_inputs(fw_gm, options.num_params_buffers)
    detach_new_values(fw_gm, meta.mutated_inputs, meta.replayed_inputs)
    fw = compile_boxed(compiler_for_views(options.fw_compiler, meta, args, name), fw_gm,
                       _graph_inputs(fw_gm), "forward")
    counters.bump("aot", "fw_compiles")

    def backward_under(autocast: AutocastState) -> fx.GraphModule:
        """See Note [Autocast around backward]. Runs inside backward(): the forward part is
        traced again in the forward's grad mode and autocast state, not the caller's."""
        with tracing(mode, name, generators, fallback, from_dynamo), torch.enable_grad(), \
                autocast_as(forward_autocast):
            joint = trace_joint(flat_fn, primals, meta, fw_out_fakes, options.decompositions,
                                autocast, grad_mode=not grad_inside)
        new_fw_gm, new_bw_gm = _partition(options.partition_fn, simplify(joint), args,
                                          meta.num_fw_outputs, name)
        if new_fw_gm.code != fw_code:
            raise _forward_differs_under_autocast(name, options.partition_fn)
        _log_graphs(name, **{"backward (autocast)": new_bw_gm})
        return new_bw_gm

    return CompiledGraphs(
        name=name, meta=meta, fw=fw, returned_mutations=meta.mutated_inputs,
        num_inputs=len(args), training=True, num_params_buffers=options.num_params_buffers,
        bw_gm=bw_gm, bw_compiler=options.bw_compiler or options.fw_compiler,
        saved=saved_for_backward(fw_gm, meta.num_fw_outputs),
        differentiable=meta.fw_output_differentiable(),
        tangent_formats=tangent_formats(meta, fw_out_fakes),
        tangent_specs=[_tangent_spec(o) for o in fw_out_fakes],
        backward_under=backward_under, grad_inside=grad_inside, backward_error=backward_error,
        gradless=() if backward_error else _gradless(bw_gm, args, meta),
        absolute_offsets=absolute_offsets,
    )


def _tangent_spec(out: Any) -> tuple[Any, torch.dtype, torch.device] | None:
    """Shape (None where symbolic), dtype and device of a zero tangent for ``out``."""
    if not isinstance(out, torch.Tensor):
        return None
    shape = out.shape if all(isinstance(d, int) for d in out.shape) else None
    return shape, out.dtype, out.device


def _gradless(bw_gm: fx.GraphModule, args: Sequence[Any], meta: AotMeta) -> tuple[int, ...]:
    """Inputs requiring grad that the backward gives no gradient and the function neither
    mutates nor returns views of (Note [Inputs without a gradient]). Not for a backward that
    only raises."""
    grads = bw_gm.graph.output_node().args[0]
    viewed = {o.base for o in meta.outputs if o.alias in (Alias.OF_INPUT, Alias.IS_INPUT)}
    linked = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    cut = tuple(i for i in linked if grads[i] is None and i not in meta.mutated_inputs
                and i not in viewed)
    # Outputs require grad only if some input does: one grown from a leaf made inside (a
    # subclass wrapper built from parts) must still require grad, as eager's does.
    return () if len(cut) == len(linked) and any(meta.fw_output_differentiable()) else cut


def _insert_runtime_asserts(gm: fx.GraphModule, mode: FakeTensorMode, name: str,
                            from_dynamo: bool) -> fx.GraphModule:
    """Write the checks the ShapeEnv deferred into a forward or inference graph (Note
    [Data-dependent sizes]); Dynamo has written its own into the graph it hands us. Not into
    the joint graph: its tangents have the outputs' data-dependent sizes, and the checks would
    read those sizes from the tangents, which the forward does not have."""
    if not from_dynamo and mode.shape_env is not None and mode.shape_env.deferred_runtime_asserts:
        from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts

        insert_deferred_runtime_asserts(gm, mode.shape_env, name)
        gm.recompile()  # the pass edits the graph only: a compiler running gm ran the old code
    return gm


def _simplify(gm: fx.GraphModule, mode: FakeTensorMode, name: str, from_dynamo: bool,
              keep_outputs: int | None) -> fx.GraphModule:
    """The clean-ups of aotkit.aot.simplify a traced graph gets before it is partitioned."""
    if from_dynamo:
        tensorify_float_inputs(gm, mode, name)
    drop_noop_views(gm, keep_outputs=keep_outputs)
    if not from_dynamo:  # Dynamo may call its backend in the default dtype its trace left
        pin_factory_dtypes(gm)
        refuse_packed_constants(gm, name)  # Dynamo guards on them
    return gm


# Note [Saved tensors the forward changes]
# ``y = x * w; w.add_(1)`` changes a tensor autograd saved for y's backward. Eager runs the
# forward and raises only if backward() runs ("modified by an inplace operation"); the joint
# trace, which takes that backward at once, raises while compiling. So the entry is traced again
# without grads: its forward runs, its outputs require grad as eager's do, and its backward
# raises eager's error.
def _trace_joint_or_defer_error(flat_fn: FlatFn, primals: list[Any], meta: AotMeta,
                                fw_out_fakes: list[Any], decompositions: Any,
                                grad_mode: bool) -> tuple[fx.GraphModule, str | None]:
    """The joint graph, and the error its backward must raise instead of running, if any."""
    try:
        return trace_joint(flat_fn, primals, meta, fw_out_fakes, decompositions,
                           grad_mode=grad_mode), None
    except RuntimeError as exc:
        if "modified by an inplace operation" not in str(exc):
            raise
        gm = trace_joint(flat_fn, primals, meta, fw_out_fakes, decompositions,
                         grad_mode=grad_mode, take_grads=False)
        tagged = any(n.meta.get("recompute") is not None for n in gm.graph.nodes)
        return gm, str(exc) + (_CHECKPOINT_HINT if tagged else "")


_CHECKPOINT_HINT = (
    "\n(aotkit: the function holds a torch.utils.checkpoint region. If that value is computed "
    "inside the region: eager's non-reentrant checkpoint saves nothing there, so it skips this "
    "check, while aotkit traces the region as ordinary code, whose saved tensors are checked. "
    "Fix: inside the region, use out-of-place ops on values autograd saves, e.g. h = h.relu() "
    "for h.relu_(); a tensor the region reads and the function changes in place after it: "
    "change a copy. Outside the region, eager raises this error too.)")


# Note [Grad mode turned on inside]
# A function called under torch.no_grad() may turn grad mode on itself (``with
# torch.enable_grad():``, Dynamo's graphs of such code call _set_grad_enabled): eager then hands
# back outputs that require grad, computed from inputs that do. The signature says grad mode is
# off, yet the metadata pass sees such outputs, so the entry is traced as a joint graph like a
# training call, and the runtime applies its autograd.Function with grad mode on; outputs made
# outside the function's grad region are non-differentiable, as eager's are.
def _turns_grad_on(meta: AotMeta, args: Sequence[Any]) -> bool:
    """Called with grad mode off, does the function compute outputs that require grad from
    inputs that do (and not only make fresh leaves that require grad)?"""
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) and any(
        o.alias is Alias.NONE and o.requires_grad and o.linked for o in meta.outputs)


def _partition(partition_fn: Partitioner, joint: fx.GraphModule, args: Sequence[Any],
               num_fw_outputs: int, name: str) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Run ``partition_fn``; a failure or a wrong result says which partitioner and how to fix."""
    who = getattr(partition_fn, "__name__", type(partition_fn).__name__)
    fix = ("Fix: a partitioner is partition_fn(joint_gm, joint_inputs, *, num_fwd_outputs) -> "
           "(fw_gm, bw_gm); aotkit.default_partition is one to compare with.")
    try:
        graphs = partition_fn(joint, list(args), num_fwd_outputs=num_fw_outputs)
    except AotkitError:
        raise
    except OSError as exc:  # graph_dumper_aot writes the joint graph from its partitioner
        raise CompilerError(
            f"partition_fn {who!r} could not write the joint graph of {name}: "
            f"{type(exc).__name__}: {exc}\nFix: give it a folder you can write to "
            "(graph_dumper_aot's folder_name).") from exc
    except Exception as exc:
        raise CompilerError(f"partition_fn {who!r} failed on the joint graph of {name}: "
                            f"{type(exc).__name__}: {exc}\n{fix}") from exc
    return checked_partition(graphs, num_fw_outputs, f"partition_fn {who!r}", name, fix)


def _record_partition(name: str, partition_fn: Partitioner, fw_gm: fx.GraphModule,
                      num_fw_outputs: int) -> None:
    """Log and keep what the partition saved (and recomputed): ``explain().of_kind("partition")``.
    A partitioner that does not describe itself is described from its forward graph's outputs."""
    described = fw_gm.meta.get("partition")
    if not isinstance(described, PartitionReport):
        saved = [n for n in fw_gm.graph.output_node().args[0][num_fw_outputs:]
                 if isinstance(n, fx.Node)]
        described = report(getattr(partition_fn, "__name__", "partition_fn"), saved)
        fw_gm.meta["partition"] = described
    counters.bump("partition", "saved_bytes", described.saved_bytes)
    counters.bump("partition", "recomputed_ops", len(described.recomputed))
    counters.record("partition", name, str(described), logger=_partition_log)


def _refuse_leaf_metadata_mutation(meta: AotMeta, args: Sequence[Any], name: str) -> None:
    """``p.t_()`` under no_grad on a leaf that requires grad: eager's grad then arrives in the
    new shape, but a compiled function must return grads shaped like its inputs were."""
    for i, info in enumerate(meta.inputs):
        if info.requires_grad and info.mutates_metadata and args[i].is_leaf:
            raise UnsupportedError(
                f"{name} changes the shape or strides of input {i} in place (t_(), "
                "unsqueeze_(), as_strided_(), ...), a leaf that requires grad.\nFix: do the "
                "in-place view change outside the compiled function, or use the out-of-place "
                "view (x = x.t()) inside it."
            )


def _refuse_grad_without_inputs(meta: AotMeta, name: str) -> None:
    """The inference graph runs without autograd; eager would still hand back an output that
    requires grad when the function computes it from a tensor requiring grad it makes itself
    (``x * torch.ones(..., requires_grad=True)``; a returned leaf is handed back as one, Note
    [Leaves made inside])."""
    fresh = [o for o in meta.outputs if o.alias is Alias.NONE and o.is_tensor and o.requires_grad
             and not o.fresh_leaf]  # a leaf made inside is handed back as one
    if fresh or any(meta.intermediate_bases_requires_grad):
        raise UnsupportedError(
            f"{name} returns a tensor that requires grad although no input requires grad or grad "
            "mode is off, so aotkit compiled it for inference without autograd.\nFix: create "
            "tensors that require grad outside the function and pass them in, and call the "
            "function in the grad mode it needs instead of switching inside it."
        )


def _forward_differs_under_autocast(name: str, partition_fn: Any) -> UnsupportedError:
    """The forward traced again for a backward() under autocast saves other tensors than the
    one that ran (Note [Autocast around backward])."""
    who = getattr(partition_fn, "__name__", "partition_fn")
    fix = ("call backward() outside torch.autocast (as PyTorch recommends), or partition with "
           "aotkit.default_partition, which saves what the backward reads (partition_fn= for "
           "aot_function/aot_module; options={'partition': 'default'} for torch.compile)")
    if partition_fn is default_partition:  # symbolic sizes and Inductor's decompositions
        fix = ("call backward() outside torch.autocast (as PyTorch recommends), or compile "
               "with static sizes (dynamic=False)")
    return UnsupportedError(
        f"{name}: backward() runs under torch.autocast, and with its backward traced under "
        f"autocast the partitioner {who} saves other tensors in the forward, which has "
        f"already run.\nFix: {fix}.")


def _compile_inference(gm: fx.GraphModule, meta: Any, options: AotOptions, name: str,
                       args: Sequence[Any], absolute_offsets: bool) -> CompiledGraphs:
    _log_graphs(name, inference=gm)
    _mark_static_inputs(gm, options.num_params_buffers)
    compiler = compiler_for_views(options.inference_compiler or options.fw_compiler, meta, args,
                                  name)
    returned = meta.mutated_inputs
    if options.keep_inference_input_mutations:
        returned = [i for i in returned if not meta.inputs[i].copied_in_graph]
    detach_new_values(gm, returned, meta.replayed_inputs)
    fw = compile_boxed(compiler, gm, _graph_inputs(gm), "inference")
    counters.bump("aot", "inference_compiles")
    return CompiledGraphs(name=name, meta=meta, fw=fw, returned_mutations=returned,
                          num_inputs=len(args), absolute_offsets=absolute_offsets)


def _mark_static_inputs(gm: fx.GraphModule, num_params_buffers: int) -> None:
    """Tell compilers which leading inputs are parameters and buffers (their addresses stay put
    between calls, so e.g. CUDA graphs need not copy them): ``gm.meta["num_params_buffers"]``."""
    gm.meta["num_params_buffers"] = num_params_buffers


def _as_leaf(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and not a.is_leaf:
        return a.detach().requires_grad_(a.requires_grad)
    return a


def _graph_inputs(gm: fx.GraphModule) -> list[Any]:
    return [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]


def _log_graphs(name: str, **graphs: fx.GraphModule) -> None:
    for kind, gm in graphs.items():
        counters.log_graph(log, lambda kind=kind, gm=gm: (
            f"{name} {kind} graph:\n{gm.print_readable(print_output=False)}"))


@dataclass
class _Entry:
    graphs: CompiledGraphs
    tensor_positions: list[int]
    guard: ShapeGuard | None
    reads: Reads  # Note [What a trace reads besides its inputs]
    offsets: tuple[int, ...] | None = None  # Note [Absolute storage offsets]
    # Inputs the graph writes, where it also reads constants (Note [Inputs sharing memory
    # with constants]).
    written: tuple[int, ...] = ()
    reused: bool = False  # a later call ran it (live_entries)

    def accepts(self, tensors: list[Any]) -> bool:
        return self.reads.hold() and (self.guard is None or self.guard(tensors)) and (
            self.offsets is None or storage_offsets(tensors) == self.offsets)


class AotFunction:
    """A function compiled ahead of time; one traced entry per input signature.

    Create it with :func:`aot_function`; call it like the original function.
    """

    # Keyed by identity where it is an attribute (Note [Objects as arguments]), and its own
    # __call__ is not user code (Note [Values a function captures]): its cache changes.
    _aotkit_opaque = True

    def __init__(self, fn: Callable[..., Any], options: AotOptions, name: str | None = None,
                 leaf_namer: Callable[[tuple[Any, ...], dict[str, Any]], list[str]] = leaf_names,
                 checked: tuple[Callable[..., Any], int] | None = None,
                 own_modules: Callable[[], Iterable[tuple[str, nn.Module]]] | None = None,
                 static_sizes: Iterable[int] | None = None) -> None:
        if not callable(fn):
            raise ArgumentError(f"aot_function compiles a callable, got {type(fn).__name__} "
                                f"{fn!r}.\nFix: pass the function (or module) itself.")
        self.fn = fn
        functools.update_wrapper(self, fn, updated=())  # __name__, __doc__, __wrapped__, ...
        self.options = options
        self._leaf_names = leaf_namer  # names in recompile reasons, e.g. ``args[1]['w']``
        # Whose signature the caller's arguments must fit, after how many leading ones we add
        # (aot_module passes the module's forward and its parameters and buffers).
        self._checked = checked or (fn, 0)
        # Note [What a trace reads besides its inputs]: aot_module's layout has its own.
        self._own_modules = own_modules
        hide_from_dynamo_if_loaded()  # Note [aotkit's code is not user code to Dynamo]
        self.name = name or f"aot_function({shown_name(fn)})"
        self._entries: dict[tuple[Any, ...], list[_Entry]] = {}
        self._keys = RecentKeys(self.name)  # Note [Keys checked in C++]
        self._once = 0  # entries dropped that served one call only: runaway recompiles
        self._told_identity_keys: frozenset[str] = frozenset()  # Note [Objects as arguments]
        self._config_parts = options.config_parts
        # Inputs traced with static sizes under dynamic=True (Note [Static parameters]).
        self.static_sizes = frozenset(range(options.num_params_buffers) if static_sizes is None
                                      else static_sizes)
        # Note [Values a function captures]: keyed after the arguments (not aot_module's).
        self._captured = captured_values(fn) if own_modules is None else Captured()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracing_active():  # Note [Calls inside other traces] (a transform inside one too)
            return self.fn(*args, **kwargs)
        if torch._C._functorch.peek_interpreter_stack() is not None:
            raise under_transform(self.name)
        if not kwargs and all(issubclass(type(a), torch.Tensor) for a in args):
            leaves, structure = args, len(args)  # the common call: no pytree work, cheap key
        else:
            leaves, structure = pytree.tree_flatten((args, kwargs))
        if has_tangents(leaves):  # Note [Forward-mode AD runs eagerly]
            note_forward_ad(self.name)
            return self.fn(*args, **kwargs)
        if self._captured.getters:
            leaves = [*leaves, *(captured_key(get()) for get in self._captured.getters)]
        key = self._keys.key(structure, leaves, self.options.dynamic, self._config_parts,
                             self.static_sizes)
        try:
            found = self._find(key, leaves)
        except TypeError:  # symbols in the key: another trace's (torch.export with Dim)
            if not traced_from_outside(leaves):
                raise
            found = None
        if found is None and traced_from_outside(leaves):
            return self.fn(*args, **kwargs)
        if found is None:
            with COMPILE_LOCK:  # another thread may have compiled it meanwhile
                found = self._find(key, leaves) or self._compile(args, kwargs, key)
        entry, tensors = found
        if entry.written:
            self._refuse_written_constants(entry, tensors, args, kwargs)
        return entry.graphs.meta.unflatten(run(entry.graphs, tensors))

    # Note [Inputs sharing memory with constants]
    # A tensor the function reads as a constant (Note [Closed-over tensors]) may be the very
    # memory of an argument it writes (``BUF`` closed over and passed as ``x``; ``x.add_(1);
    # return x + BUF``). The functional graph reads the constant where the op reads it, but the
    # write reaches the input only after the graph: eager's read after the write saw the new
    # value, the graph's the old one (silently). So the trace notes the constants read after
    # any in-place write (by storage), and an entry that writes inputs and read such constants
    # checks at every call that none of the inputs it writes shares elements with one of them,
    # refusing the call if one does (a read before the write, or of other elements, is right).
    # Passed as two arguments instead, they are inputs sharing memory, whose writes the graph
    # orders as eager does (Note [Overlapping mutated inputs]).
    def _refuse_written_constants(self, entry: _Entry, tensors: list[Any], args: tuple[Any, ...],
                                  kwargs: dict[str, Any]) -> None:
        by_storage: dict[int, list[torch.Tensor]] = {}  # where each is now (``C.data = ...``)
        for c in entry.reads.read_after_writes:
            by_storage.setdefault(c.untyped_storage().data_ptr(), []).append(c)
        for k in entry.written:
            ptr = tensors[k].untyped_storage().data_ptr()
            shared = by_storage.get(ptr, ()) if ptr else ()
            constant = next((c for c in shared if may_overlap(c, tensors[k])), None)
            if constant is not None:
                name = self._leaf_names(args, kwargs)[entry.tensor_positions[k]]
                raise UnsupportedError(
                    f"{self.name} writes {name} in place, and {name} shares memory with a tensor "
                    f"of shape {tuple(constant.shape)} that the function reads as a constant (a "
                    "closed-over variable, a global or an attribute): the compiled graph would "
                    "read that tensor as it was before the write.\nFix: read it through the "
                    "argument inside the function, or pass it as an argument too (writes to "
                    "arguments sharing memory are ordered as in eager)."
                )

    def _find(self, key: tuple[Any, ...], leaves: Sequence[Any]) -> tuple[_Entry, list[Any]] | None:
        """The compiled entry for these arguments, with their tensors, if there is one."""
        for entry in self._entries.get(key, ()):
            tensors = [leaves[i] for i in entry.tensor_positions]
            if entry.accepts(tensors):
                entry.reused = True
                return entry, tensors
        return None

    @property
    def num_entries(self) -> int:
        """How many input signatures have been traced and compiled."""
        return sum(len(v) for v in self._entries.values())

    def __deepcopy__(self, memo: dict[int, Any]) -> AotFunction:
        """The same function and options, compiled anew on its first call (compiled graphs
        hold compiler state that cannot be copied); a method of an object copied with it (``self.f
        = aot_function(self.step)``) is bound to the copy."""
        fn, options, name, leaf_names, checked, own_modules = self.__reduce__()[1]
        if inspect.ismethod(fn) and id(fn.__self__) in memo:
            fn = types.MethodType(fn.__func__, memo[id(fn.__self__)])
            checked = (fn, 0) if checked == (self.fn, 0) else checked  # not the original's
        return AotFunction(fn, options, name, leaf_names, checked, own_modules)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its function and options, compiled anew after loading."""
        return AotFunction, (self.fn, self.options, self.name, self._leaf_names, self._checked,
                             self._own_modules)

    # Note [Static parameters]
    # Under dynamic=True the leading num_params_buffers inputs (aot_module's parameters and
    # buffers; not a buffer forward assigns anew, a growing cache, once a call shows it, nor
    # the tensors forward assigns to plain attributes, a hidden state sized by the batch) are
    # traced with static sizes, as PyTorch's AOT autograd does, and their sizes are part of the
    # key. Symbolic, a weight's size shared its symbol with every input size equal to it (duck
    # sizing): a batch of 4 into Linear(8, 4) guarded "batch == out features", and a
    # convolution net recompiled at every new input size.
    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 key: tuple[Any, ...]) -> tuple[_Entry, list[Any]]:
        self._check_arguments(args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if self.num_entries:
            self._record_recompile(key, args, kwargs)
        positions, copies = tensor_positions(leaves)
        names = self._leaf_names(args, kwargs)
        captured = list(zip(self._captured.names, [get() for get in self._captured.getters],
                            strict=True))
        self._told_identity_keys = record_identity_keys(
            [*leaves, *(value for _, value in captured)], [*names, *self._captured.names],
            self.name, self._told_identity_keys)
        refuse_tensor_sets(leaves, names, self.name)
        check_params_buffers(self.options.num_params_buffers, leaves, self.name)
        refuse_torch_function_overrides(leaves, names, self.name)
        tensors = [leaves[i] for i in positions]
        subclasses = any(map(is_subclass, tensors))
        if subclasses and self.options.dynamic:
            raise subclass_dynamic(self.name, tensors)
        held_tensors: HeldTensors = {}
        held_args = argument_containers(zip(names, leaves, strict=True), held_tensors)
        held_by_fn = held_values(self.fn if self._own_modules is None else self._checked[0])
        held = [*held_args, *argument_containers(
            [*captured, *(("self", owner) for owner in self._captured.owners), *held_by_fn],
            held_tensors), *module_containers(
                (sub or type(m).__name__, m) for sub, m in
                (self._own_modules() if self._own_modules else ()))]
        # Faking a jagged tensor, an input or a constant, makes its ragged size a symbol: that
        # needs a ShapeEnv.
        mode = _fake_mode(self.options.dynamic, symbols=subclasses or any(
            issubclass(type(t), torch.Tensor) and t.is_nested for _, t in
            (*captured, *held_by_fn, *held_tensors.values())))
        # Parameters and buffers keep static sizes (Note [Static parameters]).
        fakes = [make_fake(mode, t, k, self.options.dynamic
                           and i not in self.static_sizes, names[i])
                 for k, (i, t) in enumerate(zip(positions, tensors, strict=True))]
        flat_fn = flat_user_fn(self.fn, leaves, positions, spec, self.name, self._leaf_names,
                                copies)
        if config.record_stack_traces:
            keep_stack_traces_of(self.fn)
        try:
            with dynamo_frames_off(), recording(self._own_modules, modules_held(
                    [*(v for _, v in (*held_by_fn, *captured)), *self._captured.owners])) as reads:
                graphs = compile_graphs(flat_fn, fakes, self.options, self.name, mode)
        except BaseException as exc:
            put_back_containers(held)
            changed_values(held)
            symbolic_values(held[len(held_args):])
            name_held_tensor(exc, held_tensors)
            name_refused_input(exc, self.name, [names[i] for i in positions])
            raise
        finally:
            forget_real_tensors(mode)  # Note [Fake modes forget the real tensors]
        decisions: list[tuple[str, list[str]]] = []
        stored = put_back_containers(held, decisions)
        others = held[len(held_args):] if self.options.dynamic else []  # symbols only then
        if changed := changed_values(held_args) + symbolic_values(others):
            raise changed_value(self.name, ", ".join(changed))
        if stored:
            raise stored_tensor(self.name, ", ".join(stored))
        note_module_stores(decisions)
        reads.watch(captured, held_tensors)  # Note [Constants changed in place]
        note_module_counts(self.name, changed_values(
            [c for c in held[len(held_args):] if getattr(c[2], "held_in", "")], restore=False))
        guard = ShapeGuard(mode.shape_env, fakes) if self.options.dynamic else None
        offsets = storage_offsets(tensors) if graphs.absolute_offsets else None
        written = tuple(k for k, info in enumerate(graphs.meta.inputs)
                        if info.mutates_data or info.swaps_storage) \
            if reads.read_after_writes and graphs.boundary is None else ()
        entry = _Entry(graphs, positions, guard, reads, offsets, written)
        self._entries.setdefault(key, []).append(entry)
        return entry, [leaves[i] for i in positions]

    def _check_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fn, skip = self._checked
        try:
            params = inspect.signature(fn)
        except Exception:  # no signature; a __getattr__ raising KeyError for __wrapped__
            return
        try:
            params.bind(*args[skip:], **kwargs)
        except TypeError as exc:
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.parameters.values())
            unknown = [] if takes_any else [k for k in kwargs if k not in params.parameters]
            also = f" (and it takes no keyword {', '.join(map(repr, unknown))})" \
                if unknown and not any(repr(k) in str(exc) for k in unknown) else ""
            raise ArgumentError(
                f"{self.name} was called with arguments its function cannot take: {exc}{also}.\n"
                f"Fix: call it as {getattr(fn, '__name__', 'fn')}{params}."
            ) from None

    def _record_recompile(self, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        failed = self._entries.get(key)
        names = [*self._leaf_names(args, kwargs), *self._captured.names]
        leaves = pytree.tree_leaves((args, kwargs))
        changes = [c for e in failed or () if (c := e.reads.change()) is not None]
        if changes:  # the entry it differs least from (train/eval graphs of one signature)
            why = min(reversed(changes), key=lambda c: c.count("; "))
        elif failed and (moved := moved_offsets(failed[-1].offsets, failed[-1].tensor_positions,
                                                leaves, names)):
            why = moved
        elif failed and failed[-1].guard is not None:
            entry = failed[-1]
            why = entry.guard.explain([leaves[i] for i in entry.tensor_positions],
                                      [names[i] for i in entry.tensor_positions])
        elif self._entries:  # against the compiled signature it differs least from, latest first
            skip = self._checked[1]  # (another structure is further than any leaf's change)
            closest = min(reversed(self._entries), key=lambda old: (
                old[0] != key[0], len(differences(old, key, names, skip))))
            why = describe_change(closest, key, names, skip)
        else:
            why = "new input signature"
        self._entries, once = live_entries(self._entries, config.recompile_limit - self._once)
        self._once += once
        if self.num_entries + self._once >= config.recompile_limit:
            raise RecompileLimitError(
                f"{self.name} has been compiled for {self.num_entries + self._once} input "
                f"signature(s){f' ({self._once} of modules or hooks freed after one call)' * (self._once > 0)}"
                f", and aotkit.config.recompile_limit is {config.recompile_limit}; this call would "
                f"compile another ({why}).\nFix: {recompile_fix(why, self.options.dynamic, self._once)}")
        counters.record("recompile", self.name, why, logger=log)


def _fake_mode(dynamic: bool, symbols: bool = False) -> FakeTensorMode:
    """The fake mode of a trace; ``symbols``: a ShapeEnv even with static sizes (a jagged
    tensor's ragged size is a symbol)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # Note [Data-dependent sizes]
    # With dynamic=True, a size or value read from tensor data (nonzero, masked_select, unique,
    # x.item(), narrow at a tensor offset) is traced as an unbacked symbol, as in torch.compile
    # with capture_scalar_outputs: the graph computes it at every call. The checks the ops make
    # on such symbols (narrow's start within the size, a torch._check) are only recorded by the
    # ShapeEnv while tracing; _insert_runtime_asserts writes them into the forward graph as
    # assertions, which raise where eager's kernel would raise, instead of the graph silently
    # slicing out of range. A read whose value the trace made a constant is kept for them
    # (aotkit.partition.graph.is_impure). A 0-dim input's value is data too (make_fake), not a
    # constant the entry would guard on.
    shape_env = ShapeEnv(allow_scalar_outputs=dynamic, allow_dynamic_output_shape_ops=dynamic) \
        if dynamic or symbols else None
    return new_fake_mode(shape_env=shape_env, allow_non_fake_inputs=True)


# Note [Subclasses with __torch_function__]
# A tensor subclass overriding __torch_function__ (a parameter wrapper scaling its weight in
# F.linear) changes what the user's calls compute. A trace on fake tensors never runs the
# override, so the graph computed without it, and the graph's own ATen calls, bound to torch.*
# functions, ran it again at run time on ops the user never called (the functional ``mul`` of a
# ``mul_``, a backward's ``mul``). aot_function and aot_module refuse such arguments, and the
# signature keys on each tensor's type so a plain tensor's graph never serves one; a subclass
# without an override keeps its type through the graphs' calls, as in eager. torch.compile's
# Dynamo traces the override into its graph, so Dynamo's graphs run with subclass
# __torch_function__ off (Dynamo gives outputs their subclass itself). Subclasses made of plain
# tensors (Note [Tensor subclasses]) and nn.Parameter / nn.Buffer are traced as before.
def aot_function(
    fn: Callable[..., Any],
    fw_compiler: Compiler,
    bw_compiler: Compiler | None = None,
    partition_fn: Partitioner = default_partition,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    num_params_buffers: int = 0,
    keep_inference_input_mutations: bool = False,
    inference_compiler: Compiler | None = None,
    dynamic: bool = False,
) -> AotFunction:
    """Trace ``fn``'s forward and backward ahead of time and compile them.

    Each new input signature (pytree structure, dtype, shape, stride, device, requires_grad,
    grad mode) is traced and compiled once; ``dynamic=True`` traces sizes symbolically so one
    entry serves every size that passes its shape guards. Non-tensor arguments are constants.
    ``num_params_buffers`` says how many leading (flattened) arguments are parameters and
    buffers, tensors all (an ``ArgumentError`` otherwise); the forward and inference graphs
    carry it as ``gm.meta["num_params_buffers"]`` for compilers.

    Args:
        fn: the function (or callable object, bound method, module) to compile; the values
            its code reads besides its arguments are keyed too (Note [Values a function
            captures]).
        fw_compiler: compiles the forward graph: ``(gm, example_inputs) -> callable`` (e.g.
            ``aotkit.compilers.nop``, ``ts_compile``, ``aotkit.compilers.inductor.forward``).
        bw_compiler: compiles the backward graph, on first use; ``None``: ``fw_compiler``.
        partition_fn: splits the joint graph: ``(joint_gm, joint_inputs, *,
            num_fwd_outputs) -> (forward_gm, backward_gm)``; ``default_partition`` saves what
            eager saves, ``min_cut_rematerialization_partition`` recomputes cheap ops.
        decompositions: ``{aten op: Python function}`` applied while tracing, on top of the
            few aotkit always applies.
        num_params_buffers: how many leading flattened arguments are parameters and buffers
            (static sizes under ``dynamic=True``; compilers may treat them as static).
        keep_inference_input_mutations: keep input mutations inside the inference graph
            (``copy_`` into the input) instead of applying them after it.
        inference_compiler: compiles the graph used when no output needs a gradient (under
            ``torch.no_grad()``); ``None``: ``fw_compiler``.
        dynamic: trace sizes symbolically (one entry for every size its guards allow).

    Example::

        >>> import torch, aotkit
        >>> f = aotkit.aot_function(lambda x, y: (x * y).sin(), aotkit.compilers.nop)
        >>> x = torch.randn(3, requires_grad=True)
        >>> f(x, torch.randn(3)).sum().backward()
        >>> x.grad.shape
        torch.Size([3])
    """
    options = AotOptions(fw_compiler, bw_compiler, partition_fn, decompositions,
                         num_params_buffers, keep_inference_input_mutations,
                         inference_compiler, dynamic)
    return AotFunction(fn, options)
