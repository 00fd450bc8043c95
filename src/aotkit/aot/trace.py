"""Tracing: fake inputs, the joint and inference functions, and ``make_fx`` under functionalization.

The joint function takes ``(primals, tangents)`` and returns ``forward outputs + one grad per
primal``; forward outputs are, in order, the new values of mutated inputs, the user's graph
outputs, and the intermediate bases of aliased outputs (see Note [Aliased outputs]).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import logging
import operator
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.autograd.forward_ad as fwAD
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._dispatch.python import enable_python_dispatcher
from torch._higher_order_ops.auto_functionalize import can_auto_functionalize
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from aotkit import compat, config, counters
from aotkit.aot.analysis import Alias, AotMeta, from_fun, laid_out_alike, to_fun
from aotkit.aot.backward_trace import (
    ALLCLOSE,
    custom_backwards_reached,
    formula_running,
    last_traced_node,
    note_formula,
    tag_custom_backward,
    unmaterialized,
)
from aotkit.aot.early_stop import WriteOrder
from aotkit.aot.frames import current_user_line
from aotkit.aot.ops import (
    PRINTABLE_DECOMPOSITIONS,
    EagerOps,
    UnfoldLengths,
    check_foreach_writes,
    check_out_dtype,
    functional_values,
    in_eager_devices,
    in_eager_indices,
    in_eager_layout,
    may_not_cast_in_place,
    note_unfold,
    overlaps_itself,
    run_as_eager,
    takes_generator,
    tensors_in,
    through_unfold_gaps,
    writes_out_argument,
    written_by,
)
from aotkit.aot.reads import note_constant
from aotkit.aot.signature import AUTOCAST_DEVICES, NO_AUTOCAST, AutocastState
from aotkit.aot.simplify import known_equal
from aotkit.aot.state import ReseedWatch, reseeding_refused
from aotkit.aot.subclass import is_subclass, layout_of, parts, python_subclass
from aotkit.aot.tangents import (
    name_tangent_sizes_after_outputs,
    tangent_formats,
    tangent_like,
    through_lone_views,
)
from aotkit.aot.trace_errors import (
    first_line,
    op_failed,
    traced_error,
    write_through_unfold_gaps,
    write_to_overlapping_memory,
)
from aotkit.aot.untraceable import (
    NOT_AN_ARGUMENT,
    has_tangent,
    no_autograd_kernel,
    note_no_autograd_kernel,
    reaches_autograd_fallback,
)
from aotkit.compat import (
    FakeTensor,
    FakeTensorDeviceMismatchError,
    FakeTensorMode,
    FunctionalTensor,
    FunctionalTensorMode,
    compiled_autograd_off,
    effect_tokens,
    effect_types,
    has_symbols,
    onednn_off,
)
from aotkit.errors import TraceError, UnsupportedError
from aotkit.locks import new_lock
from aotkit.partition.graph import is_impure

log = logging.getLogger("aotkit.aot")

FlatFn = Callable[..., tuple[list[Any], pytree.TreeSpec]]
_T = TypeVar("_T")

# Note [One compile at a time]
# FX keeps tracing state in module globals (torch.fx._symbolic_trace's patcher and its
# "is tracing" flag), so two traces running in two threads corrupt each other: the first call
# of a compiled function from several threads at once failed with FX's "CURRENT_PATCHER is
# None" and left the flag set for the rest of the process. Every aotkit trace, partition and
# compile holds COMPILE_LOCK (re-entrant: a lazy backward compile may run inside another
# compile's trace), as Dynamo serializes its own compiles; compiled graphs run without it.
COMPILE_LOCK = new_lock(reentrant=True)


# Note [Python dispatcher]
# The Python dispatcher is what lets composite ops decompose with symbolic sizes. Where no size
# is symbolic (no ShapeEnv, or a static Dynamo graph's ShapeEnv that holds no symbol) we leave
# it off: composites run their C++ kernels like eager, aliasing included (its Python
# decomposition of eval-mode dropout copies where eager returns the input), and fast (its
# Python ``matmul`` took a fifth of a TinyTransformer's trace). Two kinds of composites need
# another trace, taken once more with a fallback and a "retrace" decision saying why:
# - composites that read tensor data to check their arguments (complex istft checks its
#   window's envelope with aten.equal), which fake tensors cannot answer, where their Python
#   decompositions check with torch._check or not at all: "python_dispatcher", for static
#   traces;
# - composites that pick a kernel whose backward a graph cannot call: on CPU, nn.LSTM's
#   aten.lstm runs oneDNN's mkldnn_rnn_layer (also in its Python decomposition, when the
#   input needs no grad), which returns an undefined workspace tensor that its backward op
#   takes (C++ autograd passes it on; a Python call cannot): "onednn_off", oneDNN disabled
#   while tracing, so lstm becomes ATen matmuls and pointwise ops. PyTorch keeps that flag
#   process-wide: other threads' eager ops run without oneDNN while such a trace runs (one at
#   a time, Note [One compile at a time]).
#: Kernels whose outputs their backward takes but a graph cannot hold (see above).
_NO_GRAPH_BACKWARD = frozenset({torch.ops.aten.mkldnn_rnn_layer.default})
#: How a trace is taken again (Note [Python dispatcher]); None: as eager runs composites.
Fallback = Literal["python_dispatcher", "onednn_off"] | None
_FALLBACK_DOES = {
    "python_dispatcher": "composite ops decomposed in Python",
    "onednn_off": "oneDNN off, so composites pick ATen kernels",
}


class _Retrace(Exception):
    """A trace whose graph cannot run: take it again with oneDNN off."""


def _symbolic(mode: FakeTensorMode) -> bool:
    return mode.shape_env is not None and has_symbols(mode.shape_env)


def require_graph_backward(joint: fx.GraphModule, fallback: Fallback) -> None:
    """Raise _Retrace (for :func:`trace_with_fallback`) if a joint graph traced without a
    fallback calls a kernel whose backward the graph cannot call."""
    found = sorted({str(n.target) for n in joint.graph.nodes if n.target in _NO_GRAPH_BACKWARD})
    if found and fallback is None:
        raise _Retrace(f"{', '.join(found)} returns an undefined tensor its backward takes, which "
                       "a graph cannot pass on.")


def trace_with_fallback(trace: Callable[[Fallback], _T], mode: FakeTensorMode, what: str
                        ) -> tuple[_T, Fallback]:
    """``trace(fallback)``, first without one, then with the one a failure asks for (Note
    [Python dispatcher]). Also returns the fallback used, for later traces of the function."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    fallback: Fallback
    try:
        return trace(None), None
    except _Retrace as exc:
        why, error, fallback = str(exc), None, "onednn_off"
    except TraceError as exc:
        if _symbolic(mode) or not isinstance(exc.__cause__, DataDependentOutputException):
            raise
        why, error, fallback = first_line(exc), exc, "python_dispatcher"
    try:
        traced = trace(fallback)
    except Exception:  # data-dependent in Python too: the first error is the one to fix
        if error is None:
            raise
        raise error from error.__cause__
    if fallback == "onednn_off" and torch.is_autocast_enabled("cpu"):
        why += (f" Under CPU autocast the RNN then computes and returns "
                f"{torch.get_autocast_dtype('cpu')} only where its ops do (ATen's LSTM returns "
                "float32 for float32 inputs), where oneDNN's kernel returns the autocast dtype.")
    counters.record("retrace", what, f"{why} Traced again with {_FALLBACK_DOES[fallback]} "
                    "(Note [Python dispatcher]).", logger=log)
    return traced, fallback


class _QuietFakeFailures(logging.Filter):
    """Drops the fake mode's ERROR log (with a traceback) of an op that failed on fake tensors
    while an aotkit trace runs: the failure is raised as a TraceError naming the op, its message
    and the user's line (``_op_failed``), and the same traceback printed first only buries it.
    Compiled autograd's lowering too: a formula it cannot lower is a decision with the reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not ((_GUARD.get() is not None or _QUIET.get())
                    and str(record.msg).startswith("failed while attempting to run meta"))


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("aotkit_quiet_fake", default=False)


@functools.cache
def _quiet_fake_failures() -> None:
    logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietFakeFailures())


@contextlib.contextmanager
def quiet_fake_failures() -> Iterator[None]:
    """No fake-mode ERROR log of a failing op inside the block, for callers that report the
    failure themselves."""
    _quiet_fake_failures()
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


@contextlib.contextmanager
def tracing(mode: FakeTensorMode, what: str, generators: Sequence[torch.Generator] = (),
            fallback: Fallback = None, reseeds: bool = False) -> Iterator[list[torch.Generator]]:
    """Enter the fake mode and turn tracing failures into errors that say what to change.
    Yields the generators the function draws from (made outside it); a later trace of the same
    function passes them back as ``generators``, so they are not taken for ones it creates.
    The Python dispatcher is on with symbolic sizes; ``fallback`` as Note [Python dispatcher].
    ``reseeds``: reseeding the default generator is the caller's business (Dynamo's graphs),
    not refused (Note [Global state the function leaves changed])."""
    _quiet_fake_failures()
    dispatch_keys = compat.python_dispatch_keys()  # before enable_python_dispatcher() sets one
    handled = sys.exc_info()[1]  # the caller's exception, if the call is made while handling one
    python = fallback == "python_dispatcher" or _symbolic(mode)
    dispatcher = enable_python_dispatcher() if python else contextlib.nullcontext()
    onednn = onednn_off() if fallback == "onednn_off" else contextlib.nullcontext()
    guard = _OutsideTensorGuard(what, dynamic=mode.shape_env is not None)
    guard.generators.extend(generators)
    guard.seeds = None if reseeds else ReseedWatch(what)
    # Dynamo's graphs enter and leave inference mode as calls of their own, which trace.
    guard.refuse_inference_mode = not reseeds and not torch.is_inference_mode_enabled()
    token = _GUARD.set(guard)
    # Tracing code writes torch.fx.traceback's current node meta (selective checkpointing tags
    # its ops there when it sees a trace); what it writes must not outlive our trace.
    node_meta = dict(fx_traceback.current_meta)
    try:
        # Anomaly mode's NaN check reads each backward result's values: meaningless on fake
        # tensors, and a data-dependent branch to the trace. The engine still checks the
        # compiled backward's results when it runs.
        with compat.selective_checkpointing_off(), mode, dispatcher, onednn, EagerOps(), \
                compiled_autograd_off(), _saved_tensor_hooks_deferred(), \
                torch.autograd.set_detect_anomaly(False), compat.parametrize_cache_off(), \
                compat.relative_custom_op_slices(), guard:
            yield guard.generators
        if guard.seeds is not None and guard.seeds.reseeded():
            raise reseeding_refused(what)
    except Exception as exc:
        error = traced_error(what, exc, static=mode.shape_env is None, symbolic=_symbolic(mode),
                             from_dynamo=reseeds)  # reads the frames' locals: before clearing
        if reseeds:  # a Dynamo graph's frames: Note [Dispatch keys after a failure]
            _clear_frames(exc, handled)
        compat.set_python_dispatch_keys(dispatch_keys)
        if error is exc:
            raise
        raise error from exc
    finally:
        _GUARD.reset(token)
        if guard.seeds is not None:
            guard.seeds.end()
        fx_traceback.current_meta.clear()
        fx_traceback.current_meta.update(node_meta)


def _clear_frames(exc: BaseException, handled: BaseException | None) -> None:
    """Free the locals of the frames ``exc`` and the exceptions it was raised from or during
    passed through, up to ``handled``, the caller's own (Note [Dispatch keys after a
    failure])."""
    seen: set[int] = set()
    while exc is not None and exc is not handled and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def metadata_write_order() -> WriteOrder | None:
    """What the current trace's metadata pass records of its writes (Note [Checkpoint's early
    stop]); None outside a trace."""
    guard = _GUARD.get()
    return guard.write_order if guard is not None else None


def tracing_active() -> bool:
    """Whether a trace is running, aotkit's or another's (make_fx, torch.export): a compiled
    function called inside is traced as part of it, since its own graphs would see the outer
    trace's tensors (Note [Calls inside other traces])."""
    return _GUARD.get() is not None or torch._C._get_dispatch_mode(_PROXY) is not None \
        or torch._C._get_tracing_state() is not None  # torch.jit.trace records the ops run


_PROXY = torch._C._TorchDispatchModeKey.PROXY


# Note [Calls inside other traces]
# A compiled function called while something traces it (torch.export, make_fx, an aotkit trace
# of a caller, torch.fx.symbolic_trace, or on fake tensors of a mode the caller entered) runs its
# original code: the outer trace records those ops as it would without aotkit. Tracing our own
# graphs there failed (a raw "Unable to cast NotImplemented to Tensor" under torch.export, an
# unhashable SymInt under symbolic make_fx, "returned a Proxy" under symbolic_trace), or left
# our trace's own ops in the outer graph. Proxy modes are checked at every call (one C call);
# proxies and fake tensors as arguments, which no entry holds, when no entry fits.
def traced_from_outside(leaves: Sequence[Any]) -> bool:
    """Whether ``leaves`` are values of someone else's trace (Note [Calls inside other traces])."""
    return any(issubclass(type(x), (fx.Proxy, FakeTensor, FunctionalTensor, torch.SymInt,
                                    torch.SymFloat, torch.SymBool)) for x in leaves)


def refuse_kept_outputs(outputs: Sequence[Any]) -> None:
    """The guard's check of Note [Closed-over tensors] for tensors the function returns."""
    guard = _GUARD.get()
    if guard is not None:
        guard.check_kept("the function returns it", [o for o in outputs if isinstance(o, torch.Tensor)])


def _begin_graph_pass() -> None:
    guard = _GUARD.get()
    if guard is not None:
        guard.begin_graph_pass()


@contextlib.contextmanager
def _saved_tensor_hooks_deferred() -> Iterator[None]:
    """Saved-tensor hooks (``torch.utils.checkpoint``, ``save_on_cpu``) do not run while tracing.

    Tracing on fake tensors cannot replay what they do at run time: checkpoint's recompute
    restores the real RNG state, which no graph op records, so a recomputed dropout would draw a
    second, different mask, and it runs outside our dropout replacement (torch-function modes are
    not active in the backward). Without the hooks the graph saves what eager would have
    recomputed, which gives eager's values, grads and RNG state; the partitioner decides what to
    save. Hooks around the compiled call still see the tensors the compiled forward saves.
    """
    prior = torch._C._autograd._saved_tensors_hooks_set_tracing(True)
    try:
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_set_tracing(prior)


# Note [Closed-over tensors]
# A function may use tensors it was not given: closure cells, globals, attributes of objects that
# are not parameters or buffers of an aot_module. They reach tracing as real tensors and the fake
# mode (allow_non_fake_inputs=True) makes them graph constants. That is right for a tensor the
# function only reads (a mask, a table; the graph keeps a reference, so later changes show) and
# wrong in two cases, which _OutsideTensorGuard refuses before the op runs:
# * it requires grad: the graph would treat it as a constant and its gradient would be dropped;
# * the function mutates it: the fake mode runs ops on constants for real, so every tracing pass
#   would mutate the caller's tensor as well as the compiled call.
# The guard is a dispatch mode above functionalization (user modes run before every infra mode),
# where a tensor from outside is neither functional nor fake; views of one are outside too
# (``buf[0].add_(1)`` mutates ``buf``). Dynamo hands aot_module_simplified its closed-over
# tensors as inputs (parameters and buffers are lifted), so only read-only constants remain.
#
# A tensor the function computes and keeps (``self.cache = pos.cos()``, a memo dict) is a
# tracing value, not data. Read back in a later tracing pass (the joint trace after the
# metadata pass, or the next signature's trace) it would become a graph constant holding no
# data, and the outputs would be fake. The guard tags each functional
# tensor an op makes with its pass and refuses one from another pass. A weight
# ``parametrize.cached()`` holds from an eager call would be a real constant, stale once the
# block ends: traces run with that cache off and compute the weight from its original.


# Note [Custom ops writing shared memory]
# A custom op writing two arguments that share memory (``op_(x, x)``, overlapping views) is
# called by functionalization (auto_functionalized_v2) with views of one copy of their common
# base, so each write lands where eager's does and the next reads it: unlike an ATen op writing
# several tensors (Note [Foreach writes to shared memory]), it is not refused. The first
# version, which PyTorch still uses where TORCHDYNAMO_AUTO_FUNCTIONALIZED_V2=0, copies each
# argument apart, and is refused as ATen ops are.
def _hands_views_of_one_base(func: torch._ops.OpOverload) -> bool:
    import torch._inductor.config as inductor_config

    return can_auto_functionalize(func) and inductor_config.enable_auto_functionalized_v2


class _OutsideTensorGuard(TorchDispatchMode):
    """Refuse closed-over tensors that require grad or are mutated. See Note [Closed-over tensors]."""

    supports_higher_order_operators = True

    @classmethod
    def is_infra_mode(cls) -> bool:
        # Part of the tracing machinery, like the fake and proxy modes. Eager torch.cond runs
        # itself through torch.compile; Dynamo skips a frame under any other mode and keeps
        # skipping that code afterwards, which broke every later eager torch.cond.
        return True

    def __init__(self, what: str, dynamic: bool) -> None:
        super().__init__()
        self.what = what
        self.dynamic = dynamic
        # Fake views of outside tensors by id, with the outside tensor they view; held so that
        # an id is not reused while tracing.
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.detached: set[int] = set()  # of those views, the ones detach() made (or views of)
        self.generators: list[torch.Generator] = []
        self.first_pass_generators: list[torch.Generator] | None = None
        self.pass_id = next(_PASS_IDS)
        self.seeds: ReseedWatch | None = None  # None: reseeding is not refused
        self.refuse_inference_mode = False  # set by tracing()
        self.wrote = False  # whether an op wrote a tensor in place yet
        self.unfold_lengths: UnfoldLengths = {}  # Note [Writes through unfold windows]
        # Recorded in the metadata pass: Note [Checkpoint's early stop]
        self.write_order: WriteOrder | None = WriteOrder()
        self.without_autograd_kernel: set[str] = set()  # Note [Ops without an autograd kernel]
        self.custom_backward: int | None = None  # Note [Custom backwards run on zeros]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload):  # a higher-order op: its body dispatches
            return func(*args, **kwargs)
        if func is ALLCLOSE and formula_running():  # Note [Checks of well-defined losses]
            return True
        if self.refuse_inference_mode and torch.is_inference_mode_enabled():
            raise UnsupportedError(
                f"{self.what} enters torch.inference_mode() inside: its tensors (inference "
                f"tensors, without version counters or autograd) cannot be traced.\n"
                f"  at {current_user_line()}\n"
                "Fix: use torch.no_grad() inside the compiled function, enter inference_mode "
                "around the call instead, or use torch.compile(fn, backend='aotkit').")
        for t in tensors_in((args, kwargs)):
            if what := python_subclass(t):
                raise self._refusal(t, what, "PyTorch's tracing modes cannot trace it")
        self._check_writes(func, args, kwargs)
        if func.namespace not in ("aten", "prims", "prim"):  # PyTorch's own: never without
            note_no_autograd_kernel(func, args, kwargs, self.what, self.without_autograd_kernel)
        self._check_generators(func, args, kwargs)
        self.check_kept(f"{func} reads it", tensors_in((args, kwargs)))
        args = in_eager_layout(func, args)  # here for its one lookup per op: see its Note
        args = in_eager_indices(func, args)
        kwargs = in_eager_devices(kwargs)
        custom = self.custom_backward
        last = last_traced_node() if custom is not None else None
        try:
            out = run_as_eager(func, args, kwargs, self._run)
        except Exception as exc:
            note_formula(exc)
            raise
        if custom is not None:
            tag_custom_backward(custom, last)
        if not func.is_view and self._constants_only(args, kwargs):
            out = functional_values(out)
        for t in tensors_in(out):
            if isinstance(t, FunctionalTensor):
                t._aotkit_pass = self.pass_id
        self._check_grad_reads(func, args, kwargs, out)
        if func.is_view:
            self._track_views(func, args, kwargs, out)
            if func is torch.ops.aten.unfold.default:
                note_unfold(args, self.unfold_lengths)
        return out

    def _constants_only(self, args: Any, kwargs: Any) -> bool:
        """Whether every tensor argument is an outside tensor or a view of one, and there is
        one (Note [Values computed from constants])."""
        return bool(ts := tensors_in((args, kwargs))) and all(self._outside(t) is not None for t in ts)

    def _track_views(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Fake views of outside tensors, with the ones no gradient flows through
        (``w.detach()``: its base requiring grad later changes nothing)."""
        read = tensors_in((args, kwargs))
        bases = [b for b in map(self._outside, read) if b is not None]
        if bases:
            detached = func is torch.ops.aten.detach.default or id(read[0]) in self.detached
            for t in tensors_in(out):
                if not isinstance(t, FunctionalTensor):
                    self.views[id(t)] = (t, bases[0])
                    if detached:
                        self.detached.add(id(t))

    def _outside(self, t: torch.Tensor) -> torch.Tensor | None:
        """The outside tensor ``t`` is or views, if any."""
        if is_subclass(t):  # outside if one of its parts is (Note [Tensor subclasses]): the
            inner = parts(t, layout_of(t))  # caller's subclass tensor itself if all of them are
            found = list(map(self._outside, inner))
            return t if all(map(operator.is_, found, inner)) else next(
                (b for b in found if b is not None), None)
        if not isinstance(t, (FakeTensor, FunctionalTensor)):
            return t
        view, base = self.views.get(id(t), (None, None))
        return base if view is t else None

    def _check_writes(self, func: torch._ops.OpOverload, args: Any, kwargs: Any) -> None:
        """Before the op runs: the fake mode would write to the real outside tensor, and
        functionalization would get a write to overlapping memory, or an out= argument of a
        dtype the result cannot be cast to, wrong."""
        if writes_out_argument(func):
            check_out_dtype(func, args, kwargs, "meta")
        elif may_not_cast_in_place(func, args, kwargs):
            check_out_dtype(func, args, kwargs, "cpu")
        written = written_by(func, args, kwargs)
        if self.write_order is not None:
            self.write_order.note(written)
        if len(written) > 1 and not _hands_views_of_one_base(func):
            check_foreach_writes(func, args, written, self.what)
        for t in written:
            self.wrote = True  # Note [Inputs sharing memory with constants]
            if (base := self._outside(t)) is not None:
                raise self._refusal(base, f"it mutates in place ({func})", "tracing would "
                                    "mutate it too, on top of each call")
            if isinstance(t, FunctionalTensor) and through_unfold_gaps(t, self.unfold_lengths):
                raise write_through_unfold_gaps(self.what, func, current_user_line())
            if torch.Tag.inplace_view not in func.tags and overlaps_itself(t):
                raise write_to_overlapping_memory(self.what, func, t, current_user_line())

    def _check_grad_reads(self, func: torch._ops.OpOverload, args: Any, kwargs: Any,
                          out: Any) -> None:
        """After a read (reads have no effects): a gradient could flow back to an outside tensor
        that requires grad only through floating outputs of an op that is differentiable. Every
        outside tensor read is noted (Note [What a trace reads besides its inputs])."""
        outside = [(t, base) for t in tensors_in((args, kwargs))
                   if (base := self._outside(t)) is not None]
        if not outside:
            return
        # comparisons, indices, .item(): no gradient to lose
        grad = torch.is_grad_enabled() and func not in _GRADLESS_READS and any(
            t.is_floating_point() or t.is_complex() for t in tensors_in(out))
        for t, base in outside:
            if grad and t.requires_grad and self._wholly_outside(t):
                raise self._refusal(t, f"requires grad ({func} reads it)",
                                    "its gradient would be lost")
            if fwAD._current_level >= 0 and has_tangent(t):
                raise self._refusal(t, f"is a forward-mode AD dual tensor ({func} reads it)",
                                    "its tangent would be lost")
            note_constant(base, grad and id(t) not in self.detached, self.wrote)

    def _wholly_outside(self, t: torch.Tensor) -> bool:
        """Not made inside: a subclass computed in the trace from an outside one shares some
        parts with it (a jagged tensor's offsets), and its gradient is the trace's own."""
        return not is_subclass(t) or all(
            self._outside(p) is not None for p in parts(t, layout_of(t)))

    def _refusal(self, t: torch.Tensor, what: str, so: str) -> UnsupportedError:
        # Not ArgumentError: a TypeError raised inside ``x * c`` becomes NotImplemented in
        # Tensor.__mul__, and Python would report an unsupported operand type instead.
        where = current_user_line()
        error = UnsupportedError(
            f"{self.what} uses a tensor of shape {tuple(t.shape)} and dtype {t.dtype} "
            f"{NOT_AN_ARGUMENT} and that {what}; aotkit traces such tensors as graph "
            f"constants, so {so}.\n"
            + (f"  at {where}\n" if where != "<unknown location>" else "")
            + "Fix: pass it as an argument; for the parameters of a module the function "
            "calls, make that module part of the compiled one (aot_module reads its own "
            "parameters and buffers at every call) or use torch.compile(..., backend='aotkit').")
        error.outside_tensor = t  # type: ignore[attr-defined]  # for name_held_tensor
        return error

    def begin_graph_pass(self) -> None:
        """The metadata pass is over; the pass whose graph is kept starts."""
        self.first_pass_generators = list(self.generators)
        self.pass_id = next(_PASS_IDS)
        self.write_order = None
        self.wrote = False
        if self.seeds is not None:  # a restore refused only after this pass's own draws
            self.seeds.draws = 0

    def check_kept(self, how: str, tensors: Iterable[Any]) -> None:
        """A functional tensor made by another tracing pass was kept by the function."""
        for t in tensors:
            if t.layout is torch._mkldnn:  # only a real tensor is: fake ones cannot copy it
                raise UnsupportedError(
                    f"{self.what} uses a tensor of shape {tuple(t.shape)} and layout "
                    f"torch._mkldnn {NOT_AN_ARGUMENT} ({how}): PyTorch's fake tensors, which "
                    "aotkit traces with, cannot hold an mkldnn tensor.\n"
                    f"  at {current_user_line()}\n"
                    "Fix: convert it outside the compiled function (W.to_dense()) and use the "
                    "dense tensor inside.")
            if getattr(t, "_aotkit_pass", self.pass_id) != self.pass_id:
                raise UnsupportedError(
                    f"{self.what} uses a tensor of shape {tuple(t.shape)} that it computed and "
                    f"kept in an earlier tracing pass ({how}): an attribute or cache set "
                    "inside the function (self.cache = ..., a memo dict; also an "
                    "aot_function first called inside another's trace). aotkit traces the function on fake tensors, so "
                    "the kept tensor holds no data.\n"
                    f"  at {current_user_line()}\n"
                    "Fix: compute it outside the compiled function and pass it in (or register "
                    "it as a buffer in __init__ for aot_module); call a nested compiled "
                    "function once outside first; or use torch.compile(..., backend='aotkit'), "
                    "which replays such side effects."
                )

    def _check_generators(self, func: torch._ops.OpOverload, args: Any, kwargs: Any) -> None:
        """A generator the function creates is a new object in every pass; the graph would keep
        the one made while tracing and carry its state from call to call, where eager starts
        each call from the seed. Also: the default generator reseeded inside (Note [Global
        state the function leaves changed]), which tracing never advances."""
        leaves = pytree.tree_leaves((args, kwargs)) if takes_generator(func) else ()
        if torch.Tag.nondeterministic_seeded in func.tags and self.seeds is not None \
                and not any(isinstance(g, torch.Generator) for g in leaves):
            if self.seeds.reseeded():
                raise reseeding_refused(self.what)
            self.seeds.draws += 1  # Note [Catching a reseed]
        for g in leaves:
            if not isinstance(g, torch.Generator) or any(g is h for h in self.generators):
                continue
            self.generators.append(g)
            if self.first_pass_generators is not None:
                raise UnsupportedError(
                    f"{self.what} creates the torch.Generator that {func} draws from; a graph "
                    "would keep the generator made while tracing, so its state would carry over "
                    "from call to call instead of starting from its seed as in eager.\n"
                    f"  at {current_user_line()}\n"
                    "Fix: create the generator outside the function (it is then used as a "
                    "constant and advances like in eager), or seed the default generator with "
                    "torch.manual_seed outside the function."
                )

    def _run(self, func: torch._ops.OpOverload, args: Any, kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ValueError as exc:  # a Python reference's check; eager's kernel raises RuntimeError
            raise op_failed(self.what, func, current_user_line(), exc) from exc
        except RuntimeError as exc:
            generator = any(isinstance(a, torch.Generator) for a in pytree.tree_leaves((args, kwargs)))
            if not (self.dynamic and generator and "concrete" in str(exc)):
                # a kernel's own check, or fake tensors' stricter one of devices (eager's mm
                # takes a meta and a CPU tensor): see trace_errors._runtime_error
                if type(exc) in (RuntimeError, FakeTensorDeviceMismatchError):
                    exc._aotkit_failed = (func, current_user_line())  # type: ignore[attr-defined]
                raise
            raise UnsupportedError(
                f"{self.what} calls {func} with an explicit torch.Generator and symbolic sizes; "
                f"its kernel needs concrete sizes ({first_line(exc)}).\n"
                f"  at {current_user_line()}\n"
                "Fix: use dynamic=False for this function, or draw with the default generator "
                "(seeded by torch.manual_seed) instead of a torch.Generator."
            ) from exc


_PASS_IDS = itertools.count()

_GUARD: contextvars.ContextVar[_OutsideTensorGuard | None] = contextvars.ContextVar(
    "aotkit_outside_tensor_guard", default=None)


def traced_function() -> str | None:
    """The name of the function aotkit is tracing, where it is not Dynamo's graph."""
    guard = _GUARD.get()
    return guard.what if guard is not None and guard.seeds is not None else None


#: Ops that read a tensor without linking its gradient to their outputs.
_GRADLESS_READS = frozenset({
    torch.ops.aten.detach.default, torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.full_like.default, torch.ops.aten.rand_like.default,
    torch.ops.aten.randn_like.default, torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_ones.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.new_full.default,
})


def trace_joint(
    flat_fn: FlatFn,
    primals: Sequence[Any],
    meta: AotMeta,
    fw_out_fakes: Sequence[Any],
    decompositions: Mapping[Any, Callable[..., Any]] | None,
    backward_autocast: AutocastState = NO_AUTOCAST,
    grad_mode: bool = True,
    take_grads: bool = True,
) -> fx.GraphModule:
    """Trace ``(primals, tangents) -> (forward outputs, grads)`` to one ATen graph, the grads
    under autocast as ``backward_autocast`` has it (Note [Autocast around backward]), the
    function called in ``grad_mode`` (off: Note [Grad mode turned on inside]). Without
    ``take_grads`` every grad is None (Note [Saved tensors the forward changes]).

    ``fw_out_fakes`` (from :func:`aotkit.aot.analysis.analyze`) give the tangents their shapes.
    """
    formats = tangent_formats(meta, fw_out_fakes)
    tangents = [tangent_like(o, f) for o, f in zip(fw_out_fakes, formats, strict=True)]
    differentiable = meta.fw_output_differentiable()
    tangents = [t for t, d in zip(tangents, differentiable, strict=True) if d]

    # Decided before the call: ``x.add_(w)`` makes x require grad, yet x gets no grad.
    wrt = [i for i, p in enumerate(primals)
           if take_grads and isinstance(p, torch.Tensor) and p.requires_grad]

    _begin_graph_pass()
    in_backward: list[fx.Node] = []
    written_inputs: list[int] = []
    reach: dict[int, int] = {}  # Note [Custom backwards run on zeros]

    def joint(primals: list[Any], tangents: list[Any]) -> list[Any]:
        with functionalized(), unmaterialized() as unmaterialized_ctxs:
            f_primals = [to_fun(p) for p in primals]
            f_tangents = [to_fun(t) for t in tangents]
            fw_outs = _forward_outputs(flat_fn, f_primals, meta, clone_mutated=True,
                                       grad_mode=grad_mode)
            # Taken before the backward runs, which may write a mutated input again.
            fw_values = _outputs_from_fun(fw_outs, meta)
            writes = list(map(_writes, f_primals))
            before = _traced_nodes()
            outs_and_tangents = through_lone_views(fw_outs, f_tangents, differentiable, meta)
            with autocast_as(backward_autocast), \
                    custom_backwards_reached(outs_and_tangents[0], len(tangents),
                                             unmaterialized_ctxs, _GUARD.get()) as found:
                grads = _grads(*outs_and_tangents, f_primals, wrt)
            reach.update(found)
            written = {i: from_fun(p) for i, p in enumerate(f_primals) if _writes(p) != writes[i]}
            outs = [*fw_values, *map(from_fun, grads)]
        with torch.no_grad():  # as backward() runs: a leaf requiring grad may be written
            for i, value in written.items():  # Note [Inputs the backward writes]
                primals[i].copy_(value)
        in_backward.extend(n for n in _traced_nodes() if n not in before)
        written_inputs.extend(written)
        return outs

    gm = _make_fx(joint, [list(primals), tangents], decompositions)
    for node in in_backward:  # Note [Effects of the backward]
        node.meta["in_backward"] = True
        if (custom := node.meta.pop("custom_backward", None)) in reach:
            node.meta["custom_backward"] = reach[custom]
            node.meta["custom_formula"] = -custom in reach  # given None, not zeros
    _split_token_chains(gm)
    _tag_sides(gm, len(primals))
    name_tangent_sizes_after_outputs(gm, len(tangents), differentiable)
    placeholders = gm.graph.find_nodes(op="placeholder")
    for i in meta.mutated_inputs:  # Note [Saving inputs the function mutates]
        placeholders[i].meta["mutated_input"] = True
    for i in written_inputs:  # Note [Inputs the backward writes]
        placeholders[i].meta["written_by_backward"] = True
    return gm


def _tag_sides(gm: fx.GraphModule, num_primals: int) -> None:
    """Tag each node with the side it was traced on (Note [Partitioners from PyTorch])."""
    tangents = set(gm.graph.find_nodes(op="placeholder")[num_primals:])
    for node in gm.graph.nodes:
        if node.op != "output":
            backward = node in tangents or node.meta.get("in_backward", False)
            node.meta["partitioner_tag"] = "is_backward" if backward else "is_forward"


# Note [Partitioners from PyTorch]
# ``partition_fn`` takes any partitioner with our signature, PyTorch's own included, and code
# moving from functorch passes ``torch._functorch.partitioners.default_partition``. That one
# finds the forward by a tag on each node (``partitioner_tag``), not by data flow: untagged, it
# took the primals alone as the forward, and the backward ran the whole forward again, dropout
# drawing a new mask (silently wrong gradients). The joint graph carries PyTorch's tags, taken
# from the side each node was traced on; aotkit's partitioners read ``in_backward`` instead.


# Note [Inputs the backward writes]
# A backward formula may write in place to a tensor it saved from the forward's inputs (a custom
# Function or a custom op's registered backward accumulating statistics: ``stats.add_(g)``),
# whether or not the forward wrote it too (the forward's value is taken before the backward).
# Functionalization turns that write into a new value inside the backward, which nothing copied
# back to the caller's tensor: the write was lost silently. The joint graph now ends with a
# ``copy_`` of that value into the input, recorded with the backward (Note [Effects of the
# backward]), so the backward graph makes the write when backward() runs, as eager does. The
# runtime keeps such an input for the backward as a reference, not a saved tensor, whose
# version check would fail where eager's ``ctx.stats`` passes: the tensor changed in place
# between forward and backward, a second call's backward wrote it first, or retain_graph.
def _writes(p: Any) -> int:
    """How many times a functionalized input has been written so far."""
    return torch._functionalize_mutation_counter(p.elem) if isinstance(p, FunctionalTensor) else 0


def _traced_nodes() -> set[fx.Node]:
    """The nodes make_fx has recorded so far in the graph it is tracing."""
    mode = get_proxy_mode()
    return set(mode.tracer.graph.nodes) if mode is not None else set()


# Note [Autocast around backward]
# Eager's backward formulas run under the autocast state of the backward() call, not of the
# forward (a custom Function with custom_bwd restores its forward's state itself): in a forward
# under autocast with a region that turns it off, that region's backward runs in full precision
# when backward() is called outside autocast, as PyTorch recommends. So the joint traces its
# backward part with autocast off. A backward() called under autocast gets a backward graph from
# the joint traced again, its forward part in the forward's grad mode and autocast state and its
# backward part under the backward()'s: the engine's own casts
# between formulas (a gradient cast to its input's dtype) are then traced as eager runs them,
# which a cast-by-cast retrace of the finished backward graph cannot know about. The forward has
# already run and saved its tensors by then, so the new partition must give the very same
# forward graph (it does: the formulas read the same saved tensors under any autocast state);
# if a partitioner decides otherwise, the backward() raises instead of running a graph that
# reads other tensors. The runtime keeps one compiled backward per state.
@contextlib.contextmanager
def autocast_as(state: AutocastState = NO_AUTOCAST) -> Iterator[None]:
    """Autocast as ``state`` has it (off everywhere by default), whatever the caller's is. See
    Note [Autocast around backward]."""
    with contextlib.ExitStack() as stack:
        for device, dtype in zip(AUTOCAST_DEVICES, state, strict=True):
            if dtype:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def trace_inference(
    flat_fn: FlatFn,
    args: Sequence[Any],
    meta: AotMeta,
    decompositions: Mapping[Any, Callable[..., Any]] | None,
    keep_input_mutations: bool,
) -> fx.GraphModule:
    """Trace the forward alone. With ``keep_input_mutations`` data mutations stay in the graph
    as ``copy_`` into the inputs instead of being returned."""

    _begin_graph_pass()

    def inference(primals: list[Any]) -> list[Any]:
        with functionalized():
            f_primals = [to_fun(p) for p in primals]
            fw_outs = _forward_outputs(flat_fn, f_primals, meta, clone_mutated=False)
        outs = _outputs_from_fun(fw_outs, meta)
        if keep_input_mutations:
            outs = _copy_mutations_in_graph(primals, outs, meta)
        return outs

    return _make_fx(inference, [list(args)], decompositions)


@contextlib.contextmanager
def functionalized() -> Iterator[FunctionalTensorMode]:
    """Functionalization in which ordered side effects (e.g. ``aten._linalg_check_errors``) chain
    through tokens made and sunk inside the graph, so graphs need no token inputs or outputs.
    A chain no op used is removed after tracing (``_drop_unused_tokens``)."""
    mode = FunctionalTensorMode()
    tokens = effect_tokens(mode)
    for effect in effect_types():
        tokens[effect] = torch.ops.prims._make_token.default()
    with mode:
        yield mode
    torch.ops.prims._sink_tokens.default([from_fun(t) for t in tokens.values()])


def _drop_unused_tokens(graph: fx.Graph) -> None:
    make, sink = torch.ops.prims._make_token.default, torch.ops.prims._sink_tokens.default
    for node in graph.find_nodes(op="call_function", target=sink):
        if all(t.target is make for t in node.args[0]):
            graph.erase_node(node)


# Note [Effect tokens do not cross to the backward]
# Ordered side effects (``aten._linalg_check_errors``, which raises for a singular matrix) chain
# through one token per effect type, made at the start of the joint trace and sunk at its end.
# The sink, traced with the backward, took the forward's last token, so the forward's checks were
# ancestors of the backward's sink only: partitioned into the backward, ``torch.linalg.inv`` of
# a singular matrix returned NaNs and raised in backward() at best; min-cut saved the token for
# the backward instead, which Inductor cannot lower. Each chain is now cut where it crosses:
# the forward sinks its own last token and the backward starts from a fresh one.
def _split_token_chains(gm: fx.GraphModule) -> None:
    graph = gm.graph
    make, sink = torch.ops.prims._make_token.default, torch.ops.prims._sink_tokens.default
    with_effects = torch.ops.higher_order.with_effects
    for node in list(graph.nodes):
        if not node.meta.get("in_backward") or node.target not in (sink, with_effects):
            continue
        tokens = list(node.args[0]) if node.target is sink else [node.args[0]]
        for token in tokens:
            if not isinstance(token, fx.Node) or token.meta.get("in_backward") \
                    or token.target is make:
                continue
            with graph.inserting_after(token):
                graph.call_function(sink, ([token],))
            with graph.inserting_before(node):
                fresh = graph.call_function(make, ())
            fresh.meta = {**token.meta, "in_backward": True}
            node.replace_input_with(token, fresh)
    _drop_unused_tokens(graph)
    gm.recompile()


def _forward_outputs(flat_fn: FlatFn, f_primals: list[Any], meta: AotMeta, *, clone_mutated: bool,
                     grad_mode: bool = True) -> list[Any]:
    # A mutated input that requires grad is cloned first, so grads are taken w.r.t. the value
    # before the mutation (the input the caller passed) rather than the mutated one.
    call_args = [
        p.clone() if clone_mutated and info.mutated and info.requires_grad else p
        for p, info in zip(f_primals, meta.inputs, strict=True)
    ]
    with torch.set_grad_enabled(grad_mode) if clone_mutated else contextlib.nullcontext():
        outs, _ = flat_fn(*call_args)
    mutated = [call_args[i] for i in meta.mutated_inputs]
    user = [outs[i] for i in meta.graph_user_outputs()]
    bases = [o._base for o in _intermediate_base_owners(outs, meta)]
    return [*mutated, *user, *bases]


def _outputs_from_fun(fw_outs: list[Any], meta: AotMeta) -> list[Any]:
    """What :func:`_forward_outputs` returned, unwrapped: the user's outputs, and intermediate
    bases of static sizes, with eager's conj/neg bits; the mutated inputs' new values and
    symbolic-size bases as they are, so that views stay placed by the memory they share with
    them (Note [Conj bits of views after a write])."""
    bases = len(fw_outs) - len(meta.intermediate_bases_requires_grad)
    return [from_fun(x, eager_bits=i >= len(meta.mutated_inputs) and (
        i < bases or not _has_symbolic_sizes(x))) for i, x in enumerate(fw_outs)]


def _has_symbolic_sizes(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)


def _intermediate_base_owners(outs: list[Any], meta: AotMeta) -> list[torch.Tensor]:
    """For each intermediate base, the first user output viewing it (its ``_base`` is the base)."""
    owners: dict[int, torch.Tensor] = {}
    for out, info in zip(outs, meta.outputs, strict=True):
        if info.alias is Alias.OF_INTERMEDIATE and info.base not in owners:
            owners[info.base] = out  # type: ignore[index]
    return [owners[i] for i in range(len(meta.intermediate_bases_requires_grad))]


def _grads(outs: list[Any], f_tangents: list[Any], f_primals: list[Any], wrt: list[int]
           ) -> list[Any]:
    grads: list[Any] = [None] * len(f_primals)
    if wrt and outs:
        # The engine would run CUDA nodes on its device thread, beside CPU nodes on this one:
        # two threads in one fake mode trip over its in-kernel flag. Trace on this thread.
        if reaches_autograd_fallback(outs):  # Note [Ops without an autograd kernel]
            guard = _GUARD.get()
            raise no_autograd_kernel(guard.what if guard else "the function",
                                     sorted(guard.without_autograd_kernel) if guard else [],
                                     "gives it a tensor")
        with torch.autograd.set_multithreading_enabled(False):
            found = torch.autograd.grad(
                outs, [f_primals[i] for i in wrt], f_tangents, allow_unused=True
            )
        for i, g in zip(wrt, found, strict=True):
            if is_subclass(g):
                raise _subclass_gradient(g)
            grads[i] = g
    return grads


def _subclass_gradient(grad: torch.Tensor) -> UnsupportedError:
    """A plain input whose gradient is a subclass (a weight used with a TwoTensor-like
    activation); eager makes its ``.grad`` that subclass. See Note [Tensor subclasses]."""
    return UnsupportedError(
        f"the gradient of a plain tensor input of shape {tuple(grad.shape)} is a "
        f"{type(grad).__name__}: the tensor "
        "subclass it was combined with propagates into its gradient, which aotkit's graphs "
        "cannot return for a plain input.\nFix: pass that input as the same subclass too, or "
        "run this function eagerly (or with backend='aot_eager')."
    )


def _copy_mutations_in_graph(primals: list[Any], outs: list[Any], meta: AotMeta) -> list[Any]:
    kept, copied = [], {}
    for k, i in enumerate(meta.mutated_inputs):
        if meta.inputs[i].copied_in_graph:
            primals[i].copy_(outs[k])
            copied[i] = outs[k]
        else:
            kept.append(outs[k])
    user = outs[len(meta.mutated_inputs):]
    for k, j in enumerate(meta.graph_user_outputs()):
        info = meta.outputs[j]
        if info.alias is Alias.OF_INPUT and info.base in copied:
            user[k] = _view_of_copied_input(primals[info.base], copied[info.base], user[k])
    return kept + user


def _view_of_copied_input(primal: torch.Tensor, new: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """An output viewing an input whose mutation the graph copies in, taken from the input
    itself: the functional graph made it a view of the new value, whose memory the runtime never
    sees, and with symbolic sizes its place cannot be recorded as numbers. Left as it is when
    the new value is laid out unlike the input (the runtime then says so)."""
    alike = (new.dtype == primal.dtype == out.dtype and known_equal(new.size(), primal.size())
             and laid_out_alike(new, primal)
             and new.untyped_storage()._cdata == out.untyped_storage()._cdata)
    if not alike:
        return out
    offset = out.storage_offset() - new.storage_offset() + primal.storage_offset()
    return primal.as_strided(out.size(), out.stride(), offset)


def _refuse_traced_constants(gm: fx.GraphModule) -> None:
    """A graph constant holding a fake or functional tensor is a value the trace lost track of
    (an op that ran outside it, as sparse conversions do under torch 2.11's fake tensors): the
    graph would hand that trace-time value to every call. One that requires grad and that a
    higher-order op takes is a closed-over tensor a branch of torch.cond read where the guard of
    Note [Closed-over tensors] does not see it: its gradient would be lost."""
    guard = _GUARD.get()
    what = guard.what if guard is not None else "the function"
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor):
            continue
        if value.requires_grad and torch.is_grad_enabled() and guard is not None and any(
                isinstance(u.target, torch._ops.HigherOrderOperator) for u in node.users):
            raise guard._refusal(value, "requires grad (read by a higher-order op such as "
                                 "torch.cond)", "its gradient would be lost")
        if isinstance(value, (FakeTensor, FunctionalTensor)) or torch._is_functional_tensor(value):
            readers = ", ".join(sorted({str(u.target) for u in node.users}))
            raise UnsupportedError(
                f"{what} computes a tensor of shape {tuple(value.shape)} that the trace lost "
                f"track of (read by {readers}): the graph would return its trace-time value on "
                "every call. Some code runs outside the trace (torch.func.linearize; sparse "
                "conversions on torch < 2.13).\nFix: move that computation out of the compiled "
                f"function{', or use torch >= 2.13' if compat.TORCH_VERSION < (2, 13) else ''}."
            )


def _make_fx(fn: Callable[..., Any], args: list[Any], decompositions: Mapping[Any, Any] | None) -> fx.GraphModule:
    gm = make_fx(fn, decomposition_table={**PRINTABLE_DECOMPOSITIONS, **(decompositions or {})},
                 tracing_mode="real",
                 record_stack_traces=config.record_stack_traces)(*args)
    _refuse_traced_constants(gm)
    # Flat placeholders and a plain list output: every graph is ``forward(primals_1, ...)``.
    gm.graph._codegen = fx.graph.CodeGen()
    _drop_unused_tokens(gm.graph)
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)
    gm.recompile()
    if config.debug_graphs:
        gm.graph.lint()
    return gm
