"""Running compiled graphs: an ``autograd.Function`` around forward/backward, then an epilogue
that writes input mutations back and regenerates aliased outputs (Note [Aliased outputs])."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import operator
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._prims_common import is_non_overlapping_and_dense_or_false

from aotkit import config, counters
from aotkit.aot import feeding, unreached
from aotkit.aot.analysis import Alias, AotMeta, InputInfo, OutputInfo, extent
from aotkit.aot.bases import OverlapLayout, overlap_layout
from aotkit.aot.boxing import Compiler, compile_boxed
from aotkit.aot.regenerate import (
    ViewSource,
    elements_apart,
    regenerate_view,
    replayable_on_input,
    same_storage,
    view_taken_from,
)
from aotkit.aot.saved import NOTHING_SAVED, Saved
from aotkit.aot.signature import AUTOCAST_DEVICES, NO_AUTOCAST, AutocastState, autocast_state
from aotkit.aot.simplify import tangent_masks, without_gradients
from aotkit.aot.state import GlobalState
from aotkit.aot.subclass import Boundary
from aotkit.aot.trace import COMPILE_LOCK
from aotkit.aot.untraceable import SavedAfterWrite
from aotkit.compat import StopRecomputation, dynamo_frames_off
from aotkit.errors import ArgumentError, UnsupportedError
from aotkit.partition.graph import copy_graph_module

log = logging.getLogger("aotkit.aot")


@dataclass
class CompiledGraphs:
    """Everything needed to run one traced signature."""

    name: str
    meta: AotMeta
    fw: Callable[[list[Any]], Any]
    returned_mutations: list[int]       # inputs whose new value the forward returns
    num_inputs: int
    training: bool = False
    num_params_buffers: int = 0  # leading inputs, leaves (their hooks seen on their nodes)
    bw_gm: fx.GraphModule | None = None
    bw_compiler: Compiler | None = None
    # The tensors the forward saves, and the inputs among them the backward writes or reads.
    saved: Saved = NOTHING_SAVED
    differentiable: list[bool] = field(default_factory=list)
    # Per forward output: its tangent's memory format (Note [Tangents in the outputs' memory
    # format]).
    tangent_formats: list[Any] = field(default_factory=list)
    # The backward graph with backward() under an autocast state (Note [Autocast around backward]).
    backward_under: Callable[[AutocastState], fx.GraphModule] | None = None
    # The compiled backward per autocast state of backward() (Note [Autocast around backward]).
    _bw: dict[tuple[AutocastState, int], Callable[[list[Any]], Any]] = field(default_factory=dict)
    # Where subclass arguments and outputs are flattened (Note [Tensor subclasses]).
    boundary: Boundary | None = None
    # Called under no_grad, the function turns grad mode on (Note [Grad mode turned on inside]).
    grad_inside: bool = False
    # What backward raises instead of running (Note [Saved tensors the forward changes]).
    backward_error: str | None = None
    # The entry for a call whose inputs overlap, and its outputs that are inputs (position ->
    # input), traced on first use (Note [Overlapping mutated inputs]).
    rebase: Callable[[OverlapLayout, list[Any]], tuple[CompiledGraphs, dict[int, int]]] | None = None
    # Grad mode, autocast and default dtype as the function leaves them, where it changes them.
    state_after: GlobalState | None = None
    # Inputs requiring grad that get no gradient (Note [Inputs without a gradient]).
    gradless: tuple[int, ...] = ()
    # Per forward output: (shape, dtype, device) of a zero tangent, the shape None where it is
    # symbolic (Note [Outputs backward does not reach]).
    tangent_specs: list[tuple[Any, torch.dtype, torch.device] | None] = field(default_factory=list)
    # The graph places a view at an absolute storage offset (Note [Absolute storage offsets]).
    absolute_offsets: bool = False
    # Around the graphs' calls: Dynamo's graphs run with subclass __torch_function__ off, as
    # Dynamo traced the overrides in (Note [Subclasses with __torch_function__] in api).
    no_overrides: Callable[[], Any] = contextlib.nullcontext

    def __post_init__(self) -> None:
        self.num_fw_outputs = len(self.returned_mutations) + len(self.meta.graph_user_outputs()) + len(
            self.meta.intermediate_bases_requires_grad
        )
        self.non_differentiable = [i for i, d in enumerate(self.differentiable) if not d]
        # Per tangent (differentiable output): its position among the outputs, memory format.
        self.tangent_slots = [(i, f) for i, (d, f) in enumerate(
            zip(self.differentiable, self.tangent_formats, strict=True)) if d]
        graph_outputs = self.meta.graph_user_outputs()
        self.graph_output_position = {flat: pos for pos, flat in enumerate(graph_outputs)}
        # Also mutations the graph keeps as copy_ (keep_inference_input_mutations).
        self.mutates_inputs = bool(self.meta.mutated_inputs or self.saved.inputs_written)
        self.mutated_in_graph = [i for i in self.meta.mutated_inputs
                                 if i not in self.returned_mutations]
        # Note [Checkpoint's early stop]: only writes it repeats or refuses need their values.
        stop = self.meta.early_stop
        self.keeps_written_values = bool(self.returned_mutations and (stop.repeated or stop.split))
        # The common case: nothing to write back, every output is a fresh graph output.
        self.outputs_are_graph_outputs = not self.returned_mutations and all(
            o.alias is Alias.NONE and not o.fresh_leaf and not o.made_as
            for o in self.meta.outputs
        ) and len(graph_outputs) == self.num_fw_outputs
        # See Note [Replaying views]: only graphs returning views need view functions recorded.
        self.returns_views = any(o.alias in _VIEW_ALIASES for o in self.meta.outputs)
        start = len(self.returned_mutations)
        bases = range(start + len(self.graph_output_position), self.num_fw_outputs)
        self.plain_outputs = [*(start + self.graph_output_position[flat]
                                for flat, o in enumerate(self.meta.outputs) if o.alias is Alias.NONE),
                              *bases]  # the intermediates aliased outputs are views of
        self.symbolic_tangents = any(spec is not None and spec[0] is None
                                     for spec in self.tangent_specs)
        self._reached: dict[int, list[int]] = {}  # Note [Outputs backward does not reach]
        self._variant_graphs: dict[int, fx.GraphModule] = {}  # by missing tangents
        self._told_skipped_on_zeros = False
        self.replayed_outputs = [flat for flat, o in enumerate(self.meta.outputs) if o.replay_only]
        self.epilogue_order = epilogue_order(self.meta.outputs)
        # Note [Outputs other outputs are computed from]: (output, those computed from it,
        # each with where its gradient is read: the node's incoming one at its position; for a
        # view made from the node's outputs, which runs before the node, "ran", a hook notes
        # it; for one of an input, "input", a hook on its node refuses it there, as the node's
        # backward may never run).
        def where(j: int) -> int | str:
            alias = self.meta.outputs[j].alias
            return start + self.graph_output_position[j] if alias is Alias.NONE \
                else "input" if alias is Alias.OF_INPUT else "ran"

        self.feeding = [(k, [(j, where(j)) for j in range(len(self.meta.outputs))
                             if o.feeds >> j & 1])
                        for k, o in enumerate(self.meta.outputs) if o.feeds]
        self.fed = sorted({k for k, _ in self.feeding})  # the hooked outputs' tensors, read
        self.fed_views = sorted({j for _, deps in self.feeding for j, at in deps
                                 if isinstance(at, str)})
        self.watched = [_Watch.of(self, i, where) for i, where
                        in self.meta.saved_after_write.items()] if self.training else []

    def reached_by(self, missing: int = 0) -> list[int]:
        """Per backward output (an input's gradient), a bit mask of the tangents it depends on
        (bit k: the k-th differentiable output's), read off the backward graph once; with
        ``missing``, off its variant without those tangents where one was compiled (a custom
        backward's ``gb + x`` then depends on none: eager's x, not None)."""
        if missing in self._reached:
            return self._reached[missing]
        assert self.bw_gm is not None
        if 0 not in self._reached:
            self._reached[0] = tangent_masks(self.bw_gm, sum(self.differentiable))
        if not missing:
            return self._reached[0]
        # Past the variants' limit (backward_fn): the whole graph ran, or the variant without
        # the custom backwards eager skips, on zeros for the other missing tangents (the custom
        # backwards eager runs on zeros among the rest).
        skipped = self._skipped_tangents(missing)
        gm = self._variant_graphs.get(skipped, self.bw_gm) if skipped else self.bw_gm
        if gm is self.bw_gm:
            skipped = 0
        masks = tangent_masks(gm, sum(self.differentiable), missing & ~skipped)
        if len(self._reached) < 4 * config.recompile_limit:
            self._reached[missing] = masks
        return masks

    def contexts_matter(self) -> bool:
        """Whether turning autocast and ``no_overrides`` off around a graph changes anything
        now (entering the contexts costs a few microseconds a call)."""
        return self.no_overrides is not contextlib.nullcontext or \
            torch._C._is_any_autocast_enabled()

    def run_forward(self, args: Sequence[Any]) -> Any:
        """The compiled forward on ``args``, with autocast off (Note [Autocast is traced]) and,
        when it returns views, their view functions recorded (Note [Replaying views])."""
        if self.returns_views or self.contexts_matter():
            views = torch.autograd._force_original_view_tracking(True) if self.returns_views \
                else contextlib.nullcontext()
            with torch._C._DisableAutocast(), self.no_overrides(), views:
                outs = self.fw(list(args))
        else:
            outs = self.fw(list(args))  # a copy of args: the graph may empty its list
        for i in self.plain_outputs:  # Note [Outputs that are views only inside the graph]
            out = outs[i]
            if isinstance(out, torch.Tensor) and out._is_view() and not any(
                    out._base is a for a in args):
                outs = list(outs)
                outs[i] = out.detach()
        return outs

    def backward_fn(self, autocast: AutocastState = NO_AUTOCAST,
                    missing: int = 0) -> Callable[[list[Any]], Any]:
        """The compiled backward for backward() under ``autocast``, without the tangents of
        bit mask ``missing``, compiled on first use (the forward may never be differentiated).
        See Note [Autocast around backward], Note [Gradients backward does not bring]."""
        compiled = self._bw.get((autocast, missing))
        variants = len({m for _, m in self._bw if m > 0})  # sets, under any autocast
        if compiled is None and missing and variants >= config.recompile_limit:
            # a random subset of heads per step: not 2**heads; what eager skips stays out, to
            # twice the limit of variants in all
            skipped = self._skipped_tangents(missing)
            if skipped and (variants < 2 * config.recompile_limit or (autocast, skipped) in self._bw):
                return self._bw.get((autocast, skipped)) or self._compiled(autocast, skipped)
            if skipped and not self._told_skipped_on_zeros:
                counters.record("backward_variant", self.name, (
                    f"{2 * config.recompile_limit} backward variants were compiled (twice "
                    "aotkit.config.recompile_limit): custom Functions' backwards eager does "
                    "not run now run on zeros with the rest of the graph (one not zero on "
                    "zeros, adding a constant, changes the gradients)"), logger=log)
                self._told_skipped_on_zeros = True
            if (autocast, -1) not in self._bw:
                counters.record("backward_variant", self.name, (
                    f"backwards brought no gradient for {config.recompile_limit} different sets "
                    "of outputs (aotkit.config.recompile_limit); from now on others run the "
                    "whole backward graph with zeros for them, as PyTorch's AOT autograd does "
                    "(an infinite derivative on their path makes NaN there), but for custom "
                    "Functions' backwards eager does not run, left out until twice the limit"),
                    logger=log)
                self._bw[(autocast, -1)] = self.backward_fn(autocast)
            return self._bw[(autocast, -1)]
        return compiled if compiled is not None else self._compiled(autocast, missing)

    def _compiled(self, autocast: AutocastState, missing: int) -> Callable[[list[Any]], Any]:
        with COMPILE_LOCK:  # Note [One compile at a time]
            compiled = self._bw.get((autocast, missing)) or \
                self._compile_backward(autocast, missing)
            self._bw[(autocast, missing)] = compiled
        return compiled

    def _skipped_tangents(self, missing: int) -> int:
        """Past the variants' limit, the whole graph on zeros would run the custom backwards
        eager skips when the tangents of bit mask ``missing`` are missing (Note [Custom
        backwards run on zeros]): the tangents that make those run, a subset of ``missing``
        whose variant leaves them out and runs the rest on zeros (0: none is skipped)."""
        every = (1 << sum(self.differentiable)) - 1
        present = ~missing & every
        return functools.reduce(operator.or_, (custom & every for custom in self._custom_reaches
                                               if not custom & present), 0)

    @functools.cached_property
    def _custom_reaches(self) -> frozenset[int]:
        assert self.bw_gm is not None
        return frozenset(custom for node in self.bw_gm.graph.nodes
                         if (custom := node.meta.get("custom_backward")) is not None)

    def _compile_backward(self, autocast: AutocastState, missing: int) -> Callable[[list[Any]], Any]:
        # backward() may run under Dynamo's frame callback (a compiled training step's
        # loss.backward()): aotkit's frames and the compiler's are not user code to compile.
        with dynamo_frames_off():
            compiled = compile_boxed(self.bw_compiler, *self._backward_graph(autocast, missing),
                                     "backward")
        counters.bump("aot", "bw_compiles")
        log.debug("compiled backward of %s", self.name)
        return compiled

    def _backward_graph(self, autocast: AutocastState, missing: int) -> tuple[fx.GraphModule,
                                                                              list[Any]]:
        """The backward graph to compile for a backward() under ``autocast`` without the
        tangents of bit mask ``missing``, a copy a compiler may rewrite, and its inputs."""
        assert self.bw_gm is not None and self.bw_compiler is not None
        gm = self.bw_gm
        if autocast != NO_AUTOCAST:
            on = ", ".join(f"{d}: {dtype}" for d, dtype in zip(AUTOCAST_DEVICES, autocast,
                                                                strict=True) if dtype)
            counters.record("recompile", self.name, (
                f"backward() runs under torch.autocast ({on}); its backward is "
                "traced again under autocast, as eager runs its backward's ops"), logger=log)
            assert self.backward_under is not None
            gm = self.backward_under(autocast)
        if missing:
            gm = self._without_tangents(gm, missing)
            self._reached[missing] = tangent_masks(gm, sum(self.differentiable))
            if self._custom_reaches:  # read past the variants' limit (reached_by)
                self._variant_graphs.setdefault(missing, gm)
        if gm is self.bw_gm:  # later variants are cut from it
            gm = copy_graph_module(gm)
        return gm, [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]

    def _without_tangents(self, gm: fx.GraphModule, missing: int) -> fx.GraphModule:
        """``gm`` without the tangents of bit mask ``missing`` (Note [Gradients backward does
        not bring]); the tangents are the last placeholders."""
        num_tangents = sum(self.differentiable)
        first = len(list(gm.graph.find_nodes(op="placeholder"))) - num_tangents
        unused = [k for k in range(num_tangents) if missing >> k & 1]
        counters.record("backward_variant", self.name, (
            f"a backward brings no gradient for output(s) {unused} (differentiable "
            "outputs, counted from 0); the backward graph is compiled without them, as eager "
            "never runs their formulas (Note [Gradients backward does not bring])"), logger=log)
        return without_gradients(gm, [first + k for k in unused], num_tangents)


def _dense(grad: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """The layout the backward graph was traced for: strided (the grad of a sparse output
    arrives sparse; eager's own backward densifies it too) in the output's memory format
    (Note [Tangents in the outputs' memory format])."""
    if grad.layout is not torch.strided:
        grad = grad.to_dense()
    return grad.contiguous(memory_format=memory_format)


class CompiledFunction(torch.autograd.Function):
    """Runs the compiled forward; its backward runs the (lazily) compiled backward graph."""

    @staticmethod
    def forward(ctx: Any, graphs: CompiledGraphs, *args: Any) -> tuple[Any, ...]:  # type: ignore[override]
        outs = graphs.run_forward(args)
        if graphs.keeps_written_values:  # Note [Checkpoint's early stop]
            _forward_values.mutations = outs[: len(graphs.returned_mutations)]
        n = graphs.num_fw_outputs
        saved = outs[n : n + graphs.saved.tensors]
        if graphs.saved.written:  # Note [Inputs the backward writes]
            ctx.written = [(k, saved[k]) for k in graphs.saved.written]
            saved = [t for k, t in enumerate(saved) if k not in graphs.saved.written]
        if graphs.returned_mutations:
            saved = _unshare_with_mutated_inputs(saved, args, graphs.returned_mutations)
        ctx.saved_syms = outs[n + graphs.saved.tensors :]
        anchor = torch.empty(0)
        _save(ctx, saved, anchor)
        ctx.graphs = graphs
        ctx.set_materialize_grads(False)  # Note [Outputs backward does not reach]
        if graphs.symbolic_tangents:
            ctx.shapes = [o.shape if isinstance(o, torch.Tensor) else None for o in outs[:n]]
        fw_outs = outs[:n]
        if graphs.non_differentiable:
            fw_outs = _distinct_non_differentiable(fw_outs, graphs.non_differentiable)
            ctx.mark_non_differentiable(*(fw_outs[i] for i in graphs.non_differentiable
                                          if isinstance(fw_outs[i], torch.Tensor)))
        # For a later compiled call's backward: do these outputs have hooks? (Note [Outputs
        # backward does not reach])
        ctx.outputs = [(weakref.ref(o),) if isinstance(o, torch.Tensor) else () for o in fw_outs]
        # And the inputs made by other ops: hooks on them, as backward finds them (or, the
        # tensor gone, as they were now).
        ctx.made = [(i, weakref.ref(a), bool(a._backward_hooks))
                    for i in range(graphs.num_params_buffers, len(args))
                    if getattr(a := args[i], "grad_fn", None) is not None]
        return (*fw_outs, anchor)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise UnsupportedError(
            f"forward-mode AD (torch.autograd.forward_ad dual tensors) through {ctx.graphs.name}, "
            "whose inputs require grad, is not supported: its compiled forward has no "
            "forward-mode derivative.\nFix: run the function eagerly inside "
            "forward_ad.dual_level(), use torch.func.jvp on the eager function, or call the "
            "compiled function under torch.no_grad(), where its graph's ATen ops carry the "
            "dual tensors themselves.")

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:  # type: ignore[override]
        graphs: CompiledGraphs = ctx.graphs
        if graphs.backward_error is not None:
            raise RuntimeError(graphs.backward_error)
        for watch, ref, version in getattr(ctx, "watched", ()):  # Note [Inputs saved after a write]
            if watch.eager_checks(ctx, grads):
                _check_version(ref(), version, watch.index, graphs.name)
        grads = grads[:-1]  # the anchor's
        if graphs.feeding:
            feeding.refuse_hooks_missing_inner_gradients(ctx, graphs, grads)
        unreached = 0
        for k, (i, _) in enumerate(graphs.tangent_slots):
            if grads[i] is None:
                unreached |= 1 << k
        if unreached:
            quiet = _quiet_inputs(ctx, graphs)
            if unreached == (1 << len(graphs.tangent_slots)) - 1 and len(quiet) == len(
                    ctx.next_functions):
                return (None,) * (1 + graphs.num_inputs)
            grads = _zeros_for_unreached(ctx, graphs, grads)
        tangents = [_dense(grads[i], f) for i, f in graphs.tangent_slots]
        # a failed compile is retried at the next backward
        backward = graphs.backward_fn(autocast_state() if torch._C._is_any_autocast_enabled()
                                      else NO_AUTOCAST, unreached)
        try:
            saved, anchor = _saved(ctx)
        except RuntimeError as exc:
            if "a second time" not in str(exc):  # a saved tensor changed in place, say
                raise
            raise _freed_by_an_earlier_backward(graphs.name) from exc
        for k, t in getattr(ctx, "written", ()):  # Note [Inputs the backward writes]
            saved.insert(k, t)
        if isinstance(ctx, _COMPILED_NODE):  # not replayed by compiled autograd
            ctx.maybe_clear_saved_tensors()  # Note [Freeing inputs as the graph goes]
            if ctx.written and _saved_freed(ctx):  # released with the others
                ctx.written = ()
        args = [*ctx.saved_syms, *saved, *tangents]
        del saved
        try:
            input_grads = _run_backward(graphs, backward, args)
        except RuntimeError as exc:
            if any(torch._C._functorch.is_legacy_batchedtensor(t)  # is_grads_batched
                   or torch._C._functorch.is_batchedtensor(t)
                   for t in tangents if isinstance(t, torch.Tensor)):
                raise _batched_gradients(graphs.name) from exc
            raise
        if torch.is_grad_enabled():  # create_graph=True: we cannot differentiate our backward
            input_grads = _refuse_double_backward(graphs.name, anchor, tangents, input_grads)
        if unreached:
            input_grads = [None if mask and not mask & ~unreached and i in quiet else g
                           for i, (g, mask) in enumerate(zip(input_grads, graphs.reached_by(unreached),
                                                             strict=True))]
        return (None, *input_grads)


def _run_backward(graphs: CompiledGraphs, backward: Callable[[list[Any]], Any],
                  args: list[Any]) -> Any:
    """``backward(args)`` under no_grad, autocast off and ``graphs.no_overrides``, entering
    only the contexts that change something (a backward runs with grad mode off and autocast
    off unless create_graph=True or an autocast region around backward())."""
    if torch.is_grad_enabled() or graphs.contexts_matter():
        with torch.no_grad(), torch._C._DisableAutocast(), graphs.no_overrides():
            return backward(args)
    return backward(args)


# Note [Outputs backward does not reach]
# A backward from a loss that uses some outputs only (one head of two, ``a, b = f(x, y)`` with
# ``a.sum().backward()``) never reaches, in eager, the ops that made the others: inputs that
# only fed them keep ``.grad`` None (optimizers skip them; zeros would move them under weight
# decay or momentum), and ``autograd.grad(..., allow_unused=False)`` raises. One Function node
# stands for all of the compiled outputs, so its backward is told which got no gradient
# (materialize_grads off: None instead of zeros), and an input's gradient that depends on
# missing tangents only (a bit mask per input, read off the backward graph once, or off its
# variant without them: Note [Gradients backward does not bring]) is None where
# that None goes nowhere else: into no edge, into nodes the running backward does not execute
# (``autograd.grad`` with ``inputs``), or through eager C++ ops only (they pass None on) to
# leaves without hooks (a parameter: ``.grad`` stays None) and other compiled calls' outputs
# without hooks (that call applies the same rule; each call keeps weak references to its
# outputs and to the views regenerated from them to tell). aotkit.aot.unreached walks there.
# The engine still visits every node behind an input, with no gradient, and would hand None to
# hooks eager never calls (on such a leaf or output) and zeros to a Python Function's backward
# (a module's backward hook): there the zero gradient goes, as PyTorch's AOT autograd sends it;
# so do hooks on the inputs themselves, as backward finds them. A hook on a tensor an eager op
# made further back cannot be seen (autograd keeps node hooks in C++): it gets None (README).
# With no output reached and every input quiet, nothing runs; otherwise the backward graph runs
# with zeros for the missing tangents. (An eager graph freed by an earlier backward raises when
# visited: README, known gaps.)
# The engine's node class of CompiledFunction; bound as a plain class, which Dynamo tracing a
# compiled-autograd graph's call of the backward (compiler_fn = torch.compile) can compare
# with, where it refused the Function's attribute.
_COMPILED_NODE = CompiledFunction._backward_cls
# What a node has unless the forward set it: read at every backward, found on the class.
_COMPILED_NODE.watched, _COMPILED_NODE.written, _COMPILED_NODE.anchor = (), (), None
_COMPILED_NODE.fed, _COMPILED_NODE.fed_ran = {}, frozenset()


def _quiet_inputs(ctx: Any, graphs: CompiledGraphs) -> set[int]:
    """Inputs whose missing gradient may be None: no edge, or only eager C++ ops between the
    input and hook-free leaves and compiled calls' outputs (ctx.next_functions lists the tensor
    inputs)."""
    tensors = [i for i, info in enumerate(graphs.meta.inputs) if info.is_tensor]
    hooked = {i for i, ref, had in ctx.made if (bool(t._backward_hooks) if (t := ref()) is not None
                                                 else had)}
    return {i for i, edge in zip(tensors, ctx.next_functions, strict=True)
            if i not in hooked and unreached.quiet(edge, _COMPILED_NODE)}


def _zeros_for_unreached(ctx: Any, graphs: CompiledGraphs, grads: Sequence[Any]) -> list[Any]:
    out = list(grads)
    for i, (g, d) in enumerate(zip(grads, graphs.differentiable, strict=True)):
        if d and g is None:
            shape, dtype, device = graphs.tangent_specs[i]  # type: ignore[misc]
            out[i] = torch.zeros(ctx.shapes[i] if shape is None else shape, dtype=dtype,
                                 device=device)
    return out


# Note [Refusing double backward]
# Under create_graph=True the grads we return must stay connected to the inputs, or a second
# backward silently sees no dependence on them (zero or missing second-order terms). We cannot
# differentiate the compiled backward, so the grads go through _DoubleBackwardGuard, whose
# backward raises. The guard reaches the inputs through an "anchor": an empty extra output of
# CompiledFunction that it saves for backward. Unpacked there under create_graph, the anchor's
# grad_fn is this very node, whose edges lead to the inputs. It costs one empty tensor per call,
# holds no memory, and is never differentiated unless a second backward runs. The guard also
# takes the incoming gradients that require grad: a second backward with respect to them (a
# jvp through the double-vjp trick, a penalty reaching parameters before the compiled part)
# must raise too, not see the grads as constants and answer zeros.
#
# The anchor is an output of the very node that saves it. Saved through save_for_backward,
# autograd stores it without its grad_fn, so no reference cycle forms; but a saved-tensor pack
# hook that keeps the tensor it is given (an identity hook counting bytes, an offload hook
# keeping small tensors) holds the anchor with its grad_fn: a cycle through C++ that the
# garbage collector cannot see, which kept every call's saved tensors alive. So while such hooks
# are active the anchor is a plain attribute of ctx instead, a cycle the collector frees. (A
# second backward without retain_graph raises as the saved anchor is freed, which eager does
# whenever a formula saved anything, ``x * 2``'s scalar included.)
def _save(ctx: Any, saved: Sequence[Any], anchor: torch.Tensor) -> None:
    """Save ``saved`` and the anchor (Note [Refusing double backward])."""
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
        ctx.save_for_backward(*saved, anchor)
    else:
        ctx.anchor = anchor
        ctx.nothing_saved = not saved
        ctx.save_for_backward(*saved)


def _saved(ctx: Any) -> tuple[list[Any], torch.Tensor]:
    """The saved tensors and the anchor, as :func:`_save` kept them."""
    if getattr(ctx, "anchor", None) is None:
        *saved, anchor = ctx.saved_tensors
        return saved, anchor
    # Reading saved_tensors after a backward raises even when there were none.
    return [] if ctx.nothing_saved else list(ctx.saved_tensors), ctx.anchor


def _freed_by_an_earlier_backward(name: str) -> UnsupportedError:
    return UnsupportedError(
        f"{name}: backward through its graph a second time, whose saved tensors an earlier "
        "backward freed. One autograd node stands for all of its outputs and a backward runs "
        "it whenever it reaches one of them (also through a later compiled call that reads "
        "one only for outputs that backward did not use), freeing what a backward from the "
        "others needs too (eager frees only each output's own part).\nFix: pass "
        "retain_graph=True to the earlier backward, or add the losses and call backward once.")


def _saved_freed(ctx: Any) -> bool:
    """Whether autograd freed ``ctx``'s saved tensors (a backward without retain_graph)."""
    try:
        ctx.saved_tensors  # noqa: B018 - raises once they are freed
    except RuntimeError:
        return True
    return False


class _DoubleBackwardGuard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str, num_links: int, anchor: torch.Tensor,  # type: ignore[override]
                *links_and_grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.name = name
        # detach, not view_as: a view of a Function's input cannot be changed in place (a
        # gradient clipped with clamp_, a hook editing it), nor made of a sparse gradient. But
        # a gradient that is an incoming gradient requiring grad (x + y passes it through)
        # stays a view: written in place, autograd must see the write to that gradient.
        links = {t.untyped_storage().data_ptr() for t in links_and_grads[:num_links]
                 if t.layout is torch.strided} - {0}  # 0: every empty storage's
        return tuple(g.view_as(g) if g.layout is torch.strided
                     and g.untyped_storage().data_ptr() in links else g.detach()
                     for g in links_and_grads[num_links:])

    @staticmethod
    def backward(ctx: Any, *unused: Any) -> Any:  # type: ignore[override]
        raise UnsupportedError(
            f"double backward through {ctx.name} is not supported: aotkit's compiled backward "
            "is not itself differentiable.\nFix: compile the function that takes the first "
            "gradient too (aot_function(lambda x: penalty(torch.autograd.grad(f(x), x, "
            "create_graph=True)), ...) traces both into one graph; under torch.compile, Dynamo "
            "splits its graph at torch.autograd.grad, so take the first gradient with "
            "torch.func.grad, jacrev or vmap(grad), which it traces into one graph), compute higher-order gradients on the "
            "eager function, or run the first backward without create_graph=True."
        )


def _batched_gradients(name: str) -> UnsupportedError:
    """Batched gradients (vmap's BatchedTensors) reached a compiled backward that cannot take
    them: kernels compiled for plain tensors (Inductor's)."""
    return UnsupportedError(
        f"the compiled backward of {name} was given batched gradients "
        "(torch.autograd.grad(..., is_grads_batched=True), or a vectorized jacobian), which "
        "its compiled kernels cannot take: they were compiled for plain tensors.\nFix: pass "
        "the gradients one at a time (is_grads_batched=False, vectorize=False), or compile "
        "with a compiler running ATen ops (backend='aotkit', aotkit.compilers.nop), whose "
        "backward takes them.")


def _refuse_double_backward(name: str, anchor: torch.Tensor, tangents: Sequence[torch.Tensor],
                            grads: Sequence[Any]) -> list[Any]:
    """See Note [Refusing double backward]."""
    tensors = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    if not tensors:
        return list(grads)
    links = [t for t in tangents if t.requires_grad]
    guarded = _DoubleBackwardGuard.apply(name, len(links), anchor, *links,
                                         *(grads[i] for i in tensors))
    out = list(grads)
    for i, g in zip(tensors, guarded, strict=True):
        out[i] = g
    return out


def _distinct_non_differentiable(outs: Sequence[Any], non_differentiable: list[int]) -> list[Any]:
    """mark_non_differentiable applies to tensor objects: when the graph returns one tensor both
    as a differentiable output (a mutated input's new value) and a non-differentiable one (the
    same input returned to the user), the latter must be a separate alias or both lose grads."""
    outs = list(outs)
    held = collections.Counter(id(o) for o in outs)  # by how many positions
    for i in non_differentiable:
        if isinstance(outs[i], torch.Tensor) and held[id(outs[i])] > 1:
            held[id(outs[i])] -= 1
            outs[i] = outs[i].detach()
    return outs


def _unshare_with_mutated_inputs(saved: Sequence[Any], args: Sequence[Any], mutated: list[int]) -> list[Any]:
    """Saved tensors that alias an input the epilogue is about to change are cloned first: a copy_
    would overwrite them, and even a metadata-only as_strided_ bumps the version counter they
    share with the input, which autograd would then reject in backward."""
    storages = {args[i].untyped_storage().data_ptr() for i in mutated}
    return [
        s.clone() if isinstance(s, torch.Tensor) and s.untyped_storage().data_ptr() in storages else s
        for s in saved
    ]


def run(graphs: CompiledGraphs, args: list[Any]) -> list[Any]:
    """Run one compiled signature on flat inputs; returns the flat user outputs."""
    if graphs.boundary is not None:
        outs = graphs.boundary.call(functools.partial(_run_plain, graphs), args)
    else:
        outs = _run_plain(graphs, args)
    if graphs.state_after is not None:  # Note [Global state the function leaves changed]
        graphs.state_after.restore()
    return outs


def _run_plain(graphs: CompiledGraphs, args: list[Any]) -> list[Any]:
    if len(args) != graphs.num_inputs:
        raise ArgumentError(f"{graphs.name} expects {graphs.num_inputs} inputs, got {len(args)}.")
    if graphs.mutates_inputs and (layout := overlap_layout(
            graphs.name, graphs.meta, args, graphs.saved.inputs_written, graphs.saved.inputs_read,
            copies=graphs.training)):
        return _run_on_bases(graphs, layout, args)
    if graphs.grad_inside or graphs.training:
        unreached.forget_ended()
        try:
            fw_outs, anchor = _apply(graphs, args)
        except StopRecomputation:
            _mutate_at_early_stop(graphs, args)
            raise
        finally:
            if graphs.keeps_written_values:  # the values it kept: not held past the call
                _forward_values.mutations = None
    else:
        with torch.no_grad():
            fw_outs = graphs.run_forward(args)
        for i in graphs.mutated_in_graph:  # Note [Versions of inputs mutated in the graph]
            torch.autograd.graph.increment_version(args[i])
        return epilogue(graphs, args, fw_outs)
    outs = epilogue(graphs, args, fw_outs)
    if graphs.fed and anchor.grad_fn is not None:  # Note [Outputs other outputs are computed
        feeding.note_fed(anchor.grad_fn, graphs, outs)  # from]
    if graphs.watched and anchor.grad_fn is not None:  # the node backward gets as ctx
        # Note [Inputs saved after a write]; weak: the caller's tensor leads back to the node.
        anchor.grad_fn.watched = [(w, weakref.ref(args[w.index]), args[w.index]._version)
                                  for w in graphs.watched]
    return outs


def _apply(graphs: CompiledGraphs, args: list[Any]) -> tuple[list[Any], torch.Tensor]:
    if graphs.grad_inside:  # Note [Grad mode turned on inside]
        with torch.enable_grad():
            *fw_outs, anchor = _call_function(graphs, args)
    else:
        *fw_outs, anchor = _call_function(graphs, _cut_gradless(graphs.gradless, args))
    return fw_outs, anchor


# autograd.Function.apply is Python around the engine's entry: for functorch transforms (which
# CompiledFunction does not support: it raises) and, otherwise, unwrapping tensors a transform
# left behind ("dead" wrappers). Called at every step, that Python is done here directly.
_ENGINE_APPLY = super(torch.autograd.Function, CompiledFunction).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _call_function(graphs: CompiledGraphs, args: list[Any]) -> Any:
    if torch._C._are_functorch_transforms_active():
        return CompiledFunction.apply(graphs, *args)
    return _ENGINE_APPLY(graphs, *[_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a
                                   for a in args])


# The values of the inputs the forward writes, for Note [Checkpoint's early stop].
_forward_values = threading.local()


def _mutate_at_early_stop(graphs: CompiledGraphs, args: list[Any]) -> None:
    """Make the writes eager's recompute makes before it stops (Note [Checkpoint's early stop])."""
    values = getattr(_forward_values, "mutations", None)
    if values is None or not graphs.keeps_written_values:
        return
    stop = graphs.meta.early_stop
    if split := [i for i in graphs.returned_mutations if i in stop.split]:
        raise UnsupportedError(
            f"{graphs.name}, recomputed by torch.utils.checkpoint, writes input {split[0]} both "
            "before and after the last tensor it saves for backward: eager's recompute stops "
            "at that save, with the input written halfway, a value the compiled graph does not "
            "have.\nFix: turn the early stop off for that checkpoint (checkpoint(..., "
            "early_stop=False), or set_checkpoint_early_stop(False) around its forward), or "
            "make the writes together in the function.")
    for i, new in zip(graphs.returned_mutations, values, strict=True):
        if i in stop.repeated:
            apply_mutation(args[i], new, graphs.meta.inputs[i])


@dataclass(frozen=True)
class _Watch:
    """An input of Note [Inputs saved after a write], and when eager would check it: a gradient
    arrived at one of ``positions`` (forward outputs; None: always), and the engine runs one of
    ``slots`` (the Function's input edges)."""

    index: int
    positions: tuple[int, ...] | None
    slots: tuple[int, ...]

    @staticmethod
    def of(graphs: CompiledGraphs, index: int, where: SavedAfterWrite) -> _Watch:
        outputs, start = graphs.meta.outputs, len(graphs.returned_mutations)
        positions: list[int] | None = [graphs.returned_mutations.index(j) for j in where.written]
        for o in where.outputs:  # a view's gradient goes through its base: always check
            if positions is not None and outputs[o].alias is Alias.NONE:
                positions.append(start + graphs.graph_output_position[o])
            else:
                positions = None
        tensors = [i for i, info in enumerate(graphs.meta.inputs) if info.is_tensor]
        return _Watch(index, None if positions is None else tuple(positions),
                      tuple(tensors.index(j) for j in where.leads_to))

    def eager_checks(self, ctx: Any, grads: Sequence[Any]) -> bool:
        if self.positions is not None and all(grads[p] is None for p in self.positions):
            return False
        return not self.slots or any(_will_run(ctx.next_functions[s][0]) for s in self.slots)


def _will_run(node: Any) -> bool:
    """Does the running backward execute ``node``? PyTorch does not tell for a leaf's
    AccumulateGrad under autograd.grad: no check then, rather than a false error."""
    try:
        return node is not None and torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return False


def _check_version(t: torch.Tensor | None, version: int, index: int, name: str) -> None:
    if t is not None and t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}], input {index} of {name}, which "
            f"the function wrote and then saved, is at version {t._version}; expected version "
            f"{version} instead. (Note [Inputs saved after a write] in aotkit.aot.untraceable)")


# Note [Inputs without a gradient]
# Eager links an output to an input only through the ops that use it differentiably; an input
# the function ignores (old-style weight_norm recomputes ``module.weight`` before reading it) or
# reads under no_grad gets no edge, so backward never visits the graph that made it. Handed to
# CompiledFunction as they are, such inputs would get an edge each, and backward would run their
# graphs with zero gradients: a graph already freed raised "backward through the graph a second
# time", and one still alive gave its leaves zero gradients where eager leaves None (which
# optimizers skip). The backward graph says which inputs get no gradient; the Function sees a
# detached alias of each (same memory and version counter), while mutations and aliased outputs
# still use the caller's tensor. Mutated inputs keep their edge, as eager's in-place op does,
# and so do inputs outputs view: their views are regenerated on the caller's tensor, with
# eager's view nodes (Note [Replaying views]).
def _cut_gradless(gradless: tuple[int, ...], args: list[Any]) -> list[Any]:
    if not gradless:
        return args
    args = list(args)
    for i in gradless:
        args[i] = args[i].detach()
    return args


def _run_on_bases(graphs: CompiledGraphs, layout: OverlapLayout, args: list[Any]) -> list[Any]:
    """See Note [Overlapping mutated inputs]."""
    assert graphs.rebase is not None
    graph_args = layout.graph_args(args)
    entry, returned = graphs.rebase(layout, graph_args)
    outs = run(entry, graph_args)
    for position, index in returned.items():
        outs[position] = args[index]
    return outs


# Note [Outputs that are views only inside the graph]
# ``x = b * 1; x.t()[0].add_(1); return x``: eager's x is a tensor of its own, but
# functionalization computes its final value as a view of the write's result, so the graph
# returns a view of a tensor nobody else sees, and ``x.detach_()`` (or anything refusing views)
# failed. Such an output is handed out detached inside the forward: same memory and strides, no
# view, its autograd link made by the Function as for any output. So is an intermediate that
# outputs are views of: a view of one still a view inside the graph (``v = (a @ b).mT;
# v.clamp_(...); return v``) inherited autograd's mark for views of a Function with several
# outputs, and the caller's ``v.mul_(2)`` was refused. Outputs eager returns as views are other
# aliases (Note [Aliased outputs]); a view of an input stays as it is.


# Note [Versions of inputs mutated in the graph]
# With keep_inference_input_mutations the graph writes into the input itself. Eager bumps the
# input's version counter, so that a backward needing its old value refuses to run; the nop
# compiler's copy_ bumps it too, but a generated kernel (Inductor) writes the memory directly and
# a tensor saved earlier would silently give gradients of the new value. So the runtime bumps
# it once more: autograd only compares versions for equality.


# Note [Autocast is traced]
# Tracing under autocast records its casts in the graph (and an autocast region inside the
# function records its own dtype, or none where it is disabled). Running the graph under the
# caller's autocast would cast again and override those regions, so graphs run with autocast
# off, and the autocast dtype is part of the signature (aotkit.aot.signature).


_VIEW_ALIASES = (Alias.OF_INPUT, Alias.OF_OUTPUT, Alias.OF_INTERMEDIATE)


def epilogue(graphs: CompiledGraphs, args: Sequence[Any], fw_outs: Sequence[Any]) -> list[Any]:
    if graphs.outputs_are_graph_outputs:
        return list(fw_outs)
    meta = graphs.meta
    new_values = dict(zip(graphs.returned_mutations, fw_outs, strict=False))
    _refuse_views_of_restrided_inputs(graphs, args, new_values)
    _refuse_growth_beyond_memory(graphs, args, new_values)
    start = len(graphs.returned_mutations)
    graph_outs = fw_outs[start : start + len(graphs.graph_output_position)]
    if graphs.replayed_outputs:
        _refuse_unplaceable_views(graphs, args, new_values, graph_outs)
    for i, new in new_values.items():
        apply_mutation(args[i], new, meta.inputs[i])
    bases = fw_outs[start + len(graph_outs) :]
    position = graphs.graph_output_position
    results: list[Any] = [None] * len(meta.outputs)
    for flat in graphs.epilogue_order:
        info = meta.outputs[flat]
        if info.alias is Alias.CONSTANT:
            results[flat] = info.constant
            continue
        out = graph_outs[position[flat]]
        if info.fresh_leaf:  # Note [Leaves made inside]
            result = out.detach().requires_grad_()
        elif info.alias is Alias.NONE:
            result = out
        elif info.alias is Alias.IS_INPUT:
            result = args[info.base]
        elif info.alias is Alias.SAME_AS_OUTPUT:
            result = results[info.base]
        else:
            if info.alias is Alias.OF_INPUT:
                source = ViewSource(args[info.base], new_values.get(info.base), info.base)
            else:
                base = graph_outs[position[info.base]] if info.alias is Alias.OF_OUTPUT \
                    else bases[info.base]
                source = ViewSource(base)
            if info.through is not None and elements_apart(results[info.through]):
                result = view_taken_from(results[info.through], source, out, info, graphs.name)
            else:
                result = regenerate_view(source, out, info, graphs.name)
                if info.through is not None:
                    feeding.note_beside(graphs, results, result, flat)
        if info.alias in (Alias.OF_OUTPUT, Alias.OF_INTERMEDIATE):
            unreached.note_view(base, result, _COMPILED_NODE)
        if info.made_as and not isinstance(result, (torch.nn.Parameter, torch.nn.Buffer)):
            result = _remade(result, info.made_as)  # not one returned again
        results[flat] = result
    return results


def epilogue_order(outputs: Sequence[OutputInfo]) -> list[int]:
    """Output positions in an order that makes each output after those it is made from
    (Note [Views taken from returned views])."""
    order: list[int] = []
    placed: set[int] = set()
    for k in range(len(outputs)):
        chain = []  # k, the view it is taken from, and so on, up to one placed or none
        j: int | None = k
        while j is not None and j not in placed:
            chain.append(j)
            placed.add(j)
            j = outputs[j].through
        order.extend(reversed(chain))
    return order


def _remade(out: torch.Tensor, made_as: str) -> torch.Tensor:
    """``out`` as the nn.Parameter or nn.Buffer the function made (Note [Leaves made inside])."""
    if made_as == "parameter":
        return torch.nn.Parameter(out, requires_grad=out.requires_grad)
    return torch.nn.Buffer(out, persistent=made_as == "buffer")


def _refuse_views_of_restrided_inputs(graphs: CompiledGraphs, args: Sequence[Any],
                                      new_values: Mapping[int, Any]) -> None:
    """An input that takes its traced layout (Note [Layout after t_()]) where the graph laid its
    new value out otherwise: a view of it placed from the graph's layout would show other
    elements, so returning one is refused before anything is written; so is an input with gaps
    the graph gave a new value whose layout the trace could not tell (dynamic sizes)."""
    inputs = graphs.meta.inputs
    for i, new in new_values.items():
        info = inputs[i]
        if info.layout_unknown and not same_storage(args[i], new) \
                and not is_non_overlapping_and_dense_or_false(args[i]):
            raise UnsupportedError(
                f"{graphs.name} changes the shape or strides of input {i} in place (t_(), "
                "unsqueeze_(), ...) and also writes it, or the input requires grad, and that "
                "input has gaps between its elements: the graph then makes a new value of it, "
                "and traced with dynamic sizes it does not know the strides eager would give "
                "the caller's tensor, whose elements would land in the wrong places.\nFix: pass "
                "a contiguous input (x.contiguous()), compile with dynamic=False, or change the "
                "shape out of place (x = x.t())."
            )
    apart = {i for i, new in new_values.items() if inputs[i].layout_after is not None
             and not same_storage(args[i], new) and tuple(new.stride()) != inputs[i].layout_after[1]}
    if apart and (viewed := sorted({o.base for o in graphs.meta.outputs
                                    if o.alias is Alias.OF_INPUT and o.base in apart})):
        raise UnsupportedError(
            f"{graphs.name} changes the shape or strides of input {viewed[0]} in place (t_(), "
            "unsqueeze_(), ...), which has gaps between its elements, and returns a view of it; "
            "the compiled graph laid the input's new value out contiguously, so aotkit cannot "
            "place the view in the input's memory as eager does.\nFix: pass a contiguous input "
            "(x.contiguous()), or return a clone of the view."
        )


def apply_mutation(inp: torch.Tensor, new: torch.Tensor, info: InputInfo) -> None:
    """Make the caller's tensor show what the function did to it, in autograd too."""
    if info.swaps_storage:  # Note [Storage changes of inputs]
        with torch.no_grad():
            inp.set_(new)
        return
    if info.mutates_metadata:
        # Like eager's x.t_() on a non-leaf: later grads to x must arrive in the new shape. (A
        # leaf that requires grad can only have been changed under no_grad, or eager raises.)
        tracked = info.requires_grad and not inp.is_leaf and torch.is_grad_enabled()
        with contextlib.nullcontext() if tracked else torch.no_grad():
            inp.as_strided_(*_layout_after(inp, new, info))
    if info.mutates_data:
        if inp.shape != new.shape:
            _resize_as_eager(inp, new)
        if info.mutation_is_differentiable and torch.is_grad_enabled():
            inp.copy_(new)
        else:
            with torch.no_grad():
                inp.copy_(new)


def _layout_after(inp: torch.Tensor, new: torch.Tensor,
                  info: InputInfo) -> tuple[Sequence[int], Sequence[int], int]:
    """Size, strides and storage offset of an input whose shape the function changed."""
    if same_storage(inp, new):
        return new.size(), new.stride(), new.storage_offset()
    if info.layout_after is not None:  # Note [Layout after t_()]
        size, stride, shift = info.layout_after
        return size, stride, inp.storage_offset() + shift
    return new.size(), new.stride(), inp.storage_offset()


def _refuse_growth_beyond_memory(graphs: CompiledGraphs, args: Sequence[Any],
                                 new_values: Mapping[int, Any]) -> None:
    """An entry traced for an ``out=`` argument with room for its new size (a view into a larger
    tensor) may be called with one of just its old size, whose memory the layout would pass:
    refused as the trace refuses it, before any input is written (as_strided_ failed with a
    bare RuntimeError, after the writes before it)."""
    for i, new in new_values.items():
        info = graphs.meta.inputs[i]
        if not info.mutates_metadata or info.swaps_storage:
            continue
        size, stride, offset = _layout_after(args[i], new, info)
        if extent(size, stride, offset, args[i].element_size()) > args[i].untyped_storage().nbytes():
            raise UnsupportedError(
                f"{graphs.name} resizes input {i} of shape {tuple(args[i].shape)} in place to "
                f"{tuple(size)} (an out= argument, resize_ or as_strided_), beyond its memory; "
                "the graph was traced for a call whose tensor had room, and aotkit cannot give "
                "the caller's tensor new memory. Nothing was written.\nFix: pass a tensor of "
                "the result's size, or build a new tensor inside and return it.")


def _resize_as_eager(inp: torch.Tensor, new: torch.Tensor) -> None:
    """An op that resizes its argument inside its kernel (a fake-quant observer growing
    ``scale`` from (1,) to its channel count) is functionalized into a new value of the new size,
    while the input keeps its size; the caller's tensor is resized first, as the kernel resizes
    it in eager. A view or a tensor requiring grad cannot be resized (eager's kernel fails too)."""
    if inp._base is not None or inp.requires_grad:
        raise UnsupportedError(
            f"the compiled function resizes an input of shape {tuple(inp.shape)} to "
            f"{tuple(new.shape)} in place (an op that resizes its argument, such as a "
            "quantization observer), but that input is a view or requires grad, which cannot be "
            "resized.\nFix: pass a tensor of the final size, or one of its own (.clone())."
        )
    with torch.no_grad():
        inp.resize_(new.shape)


def _refuse_unplaceable_views(graphs: CompiledGraphs, args: Sequence[Any],
                              new_values: Mapping[int, Any], graph_outs: Sequence[Any]) -> None:
    """Before anything is written: a view of an input with gaps the graph did not make with
    view ops from the input's new value cannot be placed (Note [Views of inputs with gaps])."""
    for flat in graphs.replayed_outputs:
        i = graphs.meta.outputs[flat].base
        if not replayable_on_input(new_values.get(i), graph_outs[graphs.graph_output_position[flat]]):
            raise UnsupportedError(
                f"{graphs.name}: the function mutates input {i} (strides "
                f"{tuple(args[i].stride())}, with gaps between elements) in place and returns "
                "a view of it that the compiled graph did not make with view ops from the "
                "input's new value (a tensor of its own, an expand or a dtype view of a view it "
                "wrote through, or a compiler's own kernels), so aotkit cannot place it in the "
                "input's memory as eager does; nothing was written.\nFix: pass a contiguous "
                "input (x.contiguous()), write the input itself (x.add_(1), not "
                "x.unsqueeze(0).add_(1)), or return a clone of the view; a compiler of your own "
                "that wraps one returning no views can say so with a returns_views = False "
                "attribute, and aotkit then runs such graphs as traced.")
