"""The one place for PyTorch-version differences (CI runs 2.13; lent GPU machines run 2.11).

Everything here is a thin alias over a primitive; callers never test versions themselves.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from aotkit.locks import new_lock

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]

# What torch.utils.checkpoint raises to stop a recompute early (Note [Checkpoint's early stop]).
StopRecomputation: type[Exception] = getattr(
    torch.utils.checkpoint, "_StopRecomputationError", type("_NeverRaised", (Exception,), {}))

# What fake tensors raise for tensors on two devices: a RuntimeError subclass from 2.13 on.
FakeTensorDeviceMismatchError: type[RuntimeError] = getattr(
    fake_tensor, "FakeTensorDeviceMismatchError", RuntimeError)

__all__ = [
    "TORCH_VERSION",
    "FakeTensor",
    "FakeTensorDeviceMismatchError",
    "FakeTensorMode",
    "FunctionalTensor",
    "FunctionalTensorMode",
    "StopRecomputation",
    "StorageWeakRef",
    "data_dependent_errors",
    "effect_tokens",
    "effect_types",
    "guard_globals",
    "inductor_joint_graph_passes",
    "keep_stack_traces_of",
    "size_hint",
    "treespec_children",
]


def effect_types() -> list[Any]:
    """Every kind of ordered side effect functionalization threads a token through."""
    from torch._higher_order_ops.effects import _EffectType

    return list(_EffectType)


def effect_tokens(mode: FunctionalTensorMode) -> dict[Any, torch.Tensor]:
    """The mode's effect-type -> token map (ordered side effects such as
    ``aten._linalg_check_errors`` chain through these tokens)."""
    return mode._tokens


def guard_globals() -> dict[str, Any]:
    """The names ShapeEnv's guard expressions refer to (Min, Max, math helpers...)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    return dict(SYMPY_INTERP)


def has_symbols(shape_env: Any) -> bool:
    """Whether ``shape_env`` has made a symbol yet: a symbolic size or a value read from data."""
    return bool(shape_env.var_to_range)


def tensor_layout_check(tensors: list[torch.Tensor]) -> Any:
    """A C++ check that tensors have exactly these tensors' sizes, strides, dtypes, devices
    (dispatch keys) and requires_grad: ``.check(*ts)`` -> bool, ``.check_verbose(*ts,
    tensor_check_names=[...])`` -> True or what differs first (Dynamo's tensor guard)."""
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                        dynamic_dims_strides=[list(t.stride()) for t in tensors])


# Note [Fake modes forget the real tensors]
# A fake mode remembers each real tensor it faked in a weak-keyed table, and a tensor with a
# weak reference cannot be swapped: after aot_module's first call, ``m.double()`` of a module
# with tensor-subclass parameters (which PyTorch converts by ``torch.utils.swap_tensors``), or
# any conversion under ``torch.__future__.set_swap_module_params_on_conversion(True)``, failed
# with "Couldn't swap Linear.weight" (PyTorch's aot_module too). Compiled entries keep their
# mode (through their graphs' fake values), so once a trace is done the mode forgets the real
# tensors; nothing fakes them with that mode again.
def forget_real_tensors(mode: Any) -> None:
    """Drop ``mode``'s weak references to the real tensors it faked."""
    describer = mode.fake_tensor_converter.meta_converter.describer
    describer.lookup_tensor.clear()
    describer.lookup_storage.clear()


# Note [Dispatch keys after a failure]
# A trace that fails inside ``torch.inference_mode()`` (Dynamo's graph enters it as a call;
# "Cannot set version_counter for inference tensor") leaves the guard object of that
# inference mode in a frame of the traceback; when it is freed, later, it restores the
# thread's dispatch settings it saw on entry, with the Python keys the fake and functional
# modes turned on, and every later eager op in the process hit an INTERNAL ASSERT (PyTorch's
# aot_eager too). A failing trace frees its frames' locals first, then puts the keys back as
# it found them.
_PYTHON_KEYS = (torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot,
                torch._C.DispatchKey.PythonDispatcher)


def python_dispatch_keys() -> tuple[bool, ...]:
    """Whether each of the Python dispatch keys is included in this thread's dispatch."""
    return tuple(torch._C._dispatch_tls_is_dispatch_key_included(k) for k in _PYTHON_KEYS)


def set_python_dispatch_keys(included: tuple[bool, ...]) -> None:
    for key, on in zip(_PYTHON_KEYS, included, strict=True):
        torch._C._dispatch_tls_set_dispatch_key_included(key, on)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """Exceptions fake-tensor tracing raises when Python control flow reads tensor data."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


@contextlib.contextmanager
def onednn_off() -> Iterator[None]:
    """``torch.backends.mkldnn.enabled`` False inside the block (process-wide, as PyTorch keeps
    it), without ``torch.backends.mkldnn.flags``, which also resets precision settings and warns
    on builds without Intel GPU support."""
    prior = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(prior)


def dynamo_fallback_errors() -> tuple[type[BaseException], ...]:
    """The exceptions at which Dynamo splits its graph when a backend raises them (instead of
    failing the compile): ``torch._dynamo.exc.exceptions_allowed_to_be_fallback``."""
    from torch._dynamo import exc

    return tuple(getattr(exc, "exceptions_allowed_to_be_fallback", ()))


def dynamo_compiles_one_graph() -> bool:
    """Whether the frame Dynamo is compiling must be one graph (``fullgraph=True``), where a
    backend error raises whatever ``suppress_errors`` says. False when unknown."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # no frame being compiled, or another torch's layout
        return False
    return bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))


# --- compiled autograd: the C++ engine's private protocol -------------------------------------
# Note [Compiled autograd protocol]
# The C++ autograd engine (torch/csrc/dynamo/python_compiled_autograd.cpp) calls a Python object
# method by method while it walks the autograd graph; the method names and arguments are private
# and have moved between releases. Everything that touches the engine's own entry points lives
# here so aotkit.compiled_autograd has one place to adapt per version.


def _engine() -> Any:
    return torch._C._dynamo.compiled_autograd


# Note [The engine's compiler slot]
# The engine holds one compiler for the whole process. enable() sets it for its block; "off"
# windows clear it for a while (a trace's own autograd.grad, a replayed graph whose hooks run a
# backward, disable()). Each saving and restoring the slot itself, threads undid each other:
# a block exiting while another thread traced had its compiler put back by the trace, left
# installed after the block. So the slot has one writer here: off windows are counted across
# threads, the slot stays empty while any is open, and the compiler set meanwhile is
# remembered and installed when the last one closes. (A backward of the enable() thread that
# runs while another thread traces is therefore not captured: it runs eagerly.)
_slot_lock = new_lock()
_slot_off = 0  # off windows open, in all threads
_slot_wanted: tuple[Any, bool] = (None, False)  # the compiler to hold once none is open
_logger_wanted: Any = None  # the engine's verbose logger, as last set


def set_autograd_compiler(factory: Any, dynamic: bool) -> tuple[Any, bool]:
    """Install ``factory`` (called once per capture) as the engine's compiler, now or when the
    off windows open close; returns the prior ``(factory, dynamic)`` pair to restore. ``None``
    turns compiled autograd off (Note [The engine's compiler slot])."""
    global _slot_wanted
    with _slot_lock:
        if _slot_off:
            prior, _slot_wanted = _slot_wanted, (factory, dynamic)
            return prior
        return _engine().set_autograd_compiler(factory, dynamic)


def pytorch_disable_is_open() -> bool:
    """Whether PyTorch's own off window, ``torch._dynamo.compiled_autograd._disable()``, is
    open: ``torch.func``'s transforms and Inductor's compile empty the engine's compiler slot
    in one around their ``autograd.grad`` (Note [Compiler cleared inside enable()])."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "active_disable_ctx", False))


def keep_pytorch_compiled_autograd_off() -> None:
    """Undo what PyTorch's off window does to its own flag inside enable(). Leaving
    ``torch._dynamo.compiled_autograd._disable()`` (``torch.func``'s transforms and AOT compiles
    open one) sets ``compiled_autograd_enabled`` whenever the engine's slot held a compiler, ours
    included; Dynamo then traces hooks for PyTorch's compiled autograd (``BackwardState``), and
    a later ``torch.compile`` of a function with a hook on an intermediate failed, even after
    the block. Only Dynamo reads the flag, when it compiles: this runs before each of its
    compiles in the block (:func:`pytorch_compiled_autograd_kept_off`) and when the block ends.
    PyTorch's own enable() (``depth``) is left alone."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    if module is not None and module.compiled_autograd_enabled and not module.depth:
        module.compiled_autograd_enabled = False


def _before_dynamo_compiles(_args: Any) -> None:
    keep_pytorch_compiled_autograd_off()


@contextlib.contextmanager
def pytorch_compiled_autograd_kept_off() -> Iterator[None]:
    """:func:`keep_pytorch_compiled_autograd_off` before every frame Dynamo compiles inside the
    block (an evaluation step compiled by ``aot_eager`` opens PyTorch's off window, and the
    training step traced next took the flag's path), and when the block ends."""
    load_dynamo()
    keep_pytorch_compiled_autograd_off_at_compiles()
    try:
        yield
    finally:
        callbacks = _dynamo_start_callbacks()
        if _before_dynamo_compiles in callbacks:
            callbacks.remove(_before_dynamo_compiles)
        keep_pytorch_compiled_autograd_off()


def keep_pytorch_compiled_autograd_off_at_compiles() -> None:
    """Register Dynamo's start-of-compile callback of :func:`pytorch_compiled_autograd_kept_off`
    where it is missing: ``torch._dynamo.reset()`` drops every callback."""
    callbacks = _dynamo_start_callbacks()
    if _before_dynamo_compiles not in callbacks:
        callbacks.append(_before_dynamo_compiles)


def _dynamo_start_callbacks() -> list[Callable[[Any], None]]:
    """Dynamo's list of functions called as a compile starts (``callback_handler``; a list no
    one reads on a release without it)."""
    handler = getattr(sys.modules.get("torch._dynamo"), "callback_handler", None)
    return getattr(handler, "start_callbacks", _NO_CALLBACKS)


_NO_CALLBACKS: list[Callable[[Any], None]] = []


def engine_cache_is_empty() -> bool:
    """Whether the engine holds no captured graph (``torch._dynamo.reset()`` empties it); False
    on a release that cannot tell."""
    is_empty = getattr(_engine(), "is_cache_empty", None)
    return bool(is_empty()) if is_empty is not None else False


def compiled_autograd_is_off() -> bool:
    """Whether a :func:`compiled_autograd_off` block (``disable()``, a trace) is open."""
    return _slot_off > 0


@contextlib.contextmanager
def compiled_autograd_off() -> Iterator[None]:
    """No compiled autograd inside the block, in any thread (Note [The engine's compiler
    slot]): tracing's own ``autograd.grad`` on fake tensors must run in the plain engine, not
    be captured as a user backward."""
    global _slot_off, _slot_wanted
    with _slot_lock:
        if not _slot_off:
            _slot_wanted = _engine().set_autograd_compiler(None, False)
        _slot_off += 1
    try:
        yield
    finally:
        with _slot_lock:
            _slot_off -= 1
            if not _slot_off:
                _engine().set_autograd_compiler(*_slot_wanted)
                # torch._dynamo.reset() inside the window emptied the logger too
                _engine().set_verbose_logger(_logger_wanted)


def clear_autograd_cache() -> None:
    """Drop every graph the engine cached by autograd-graph structure."""
    _engine().clear_cache()


def set_autograd_verbose_logger(logger: Any) -> None:
    """Give the engine a ``logging.Logger`` (or ``None``). With one set, the engine also reports
    why its cache missed through ``log_compile_reasons``; it must be a real Logger (other
    objects crash the process on 2.13). Set again when an off window closes."""
    global _logger_wanted
    _logger_wanted = logger
    _engine().set_verbose_logger(logger)


def is_unexplained_cache_entry(exc: RuntimeError) -> bool:
    """Whether the engine refused a backward because its cache held an entry without a graph
    and its verbose logger wanted a reason (Note [Cache entries without a graph] in
    aotkit.compiled_autograd.runtime). Raised before any node runs, on 2.11 and 2.13 alike."""
    return "compile_reason.has_value()" in str(exc)


def execution_engine() -> Any:
    """The object Python's autograd entry points call (``Variable._execution_engine``:
    ``run_backward``, ``queue_callback``)."""
    from torch.autograd.variable import Variable

    return Variable._execution_engine


def set_execution_engine(engine: Any) -> None:
    """Make ``engine`` the one :func:`execution_engine` returns."""
    from torch.autograd.variable import Variable

    Variable._execution_engine = engine


def replay_ctx(ctx: Any, saved_tensors: list[torch.Tensor]) -> Any:
    """The ``ctx`` a custom Function's backward gets when a captured graph replays it: the
    engine's node, with ``saved_tensors`` taken from the graph's inputs. Dynamo (a compiler such
    as ``torch.compile(gm)``) traces ``Function.backward(ctx, ...)`` only for a ctx of exactly
    this Dynamo-provided type, so that is the one we build."""
    from torch._dynamo.external_utils import FakeBackwardCFunction

    return FakeBackwardCFunction(ctx, saved_tensors)


@contextlib.contextmanager
def parametrize_cache_off() -> Iterator[None]:
    """``torch.nn.utils.parametrize.cached()`` off and its cache set aside (private to
    PyTorch): a trace computes parametrized weights from their originals (Note [Closed-over
    tensors])."""
    from torch.nn.utils import parametrize

    enabled, cache = parametrize._cache_enabled, parametrize._cache
    parametrize._cache_enabled, parametrize._cache = 0, {}  # a cached() in forward starts empty
    try:
        yield
    finally:
        parametrize._cache_enabled, parametrize._cache = enabled, cache


@contextlib.contextmanager
def relative_custom_op_slices() -> Iterator[None]:
    """Note [Slices a custom op writes]: within the block, a custom op's written slice of a
    base is described by its start in the base, as auto_functionalized replays it."""
    from torch._higher_order_ops import auto_functionalize

    original = auto_functionalize.try_use_slice
    if getattr(original, "aotkit_relative", False):  # a trace inside a trace
        yield
        return
    auto_functionalize.try_use_slice = functools.partial(_slice_in_base, original)
    auto_functionalize.try_use_slice.aotkit_relative = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        auto_functionalize.try_use_slice = original


# Note [Slices a custom op writes]
# Functionalizing a custom op that writes a slice of a tensor (``op_(y[1:3])``), PyTorch
# (2.11-2.13) records the slice by its start in the whole memory (the view's storage offset over
# its stride), and auto_functionalized replays it as a slice of the base: for a base that starts
# inside its memory (``buf[2:6]``) the op wrote other rows, or none (and under dynamic=True the
# start was read at each call from the view's storage offset). aotkit's traces record the start
# counted from the base, a number; where it is no number (``y[:, -1:]`` of a symbolic width),
# the view is recorded by size, stride and storage offset instead (Note [Absolute storage
# offsets]).
def _constant(value: Any) -> Any:
    """``value`` as an int where it is one (``s0 // s0``), else as it is."""
    if isinstance(value, torch.SymInt) and (known := value.node.maybe_as_int()) is not None:
        return known
    return value


def _slice_in_base(original: Callable[[Any, Any], Any], base: Any, tensor: Any) -> Any:
    """``(dim, start, end)`` of ``tensor`` as a slice of ``base`` along one dimension, counted
    from the base, where that is what it is, with numbers for start and end; else None."""
    from torch._higher_order_ops.auto_functionalize import is_alias
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    if is_alias(base, tensor):
        return original(base, tensor)
    if tensor.dim() != base.dim() or not all(known(a == b) for a, b in
                                             zip(tensor.stride(), base.stride(), strict=True)):
        return None
    dims = [d for d in range(tensor.dim()) if not known(tensor.size(d) == base.size(d))]
    if len(dims) != 1:
        return None
    dim = dims[0]
    step, relative = tensor.stride(dim), tensor.storage_offset() - base.storage_offset()
    if not known(step > 0):  # an expanded dimension
        return None
    start = _constant(relative // step)  # ((s0 + s1) - s1) // s0 is 1 under dynamic=True
    end = _constant(start + tensor.size(dim))
    if type(start) is not int or not known(relative % step == 0) or start < 0 \
            or not known(end <= base.size(dim)):  # a view reaching past the base is no slice
        return None
    return dim, start, end


@contextlib.contextmanager
def selective_checkpointing_off() -> Iterator[None]:
    """Selective activation checkpointing's dispatch modes (a ``context_fn`` made by
    ``create_selective_checkpoint_contexts``; private to PyTorch) taken off the dispatch mode
    stack for the block, the modes above them (a user's mode entered in the region) kept in
    order: a trace's tensors are not values to cache for the recompute (the compiled graph's
    ops run under them)."""
    from torch.utils._python_dispatch import (
        _get_current_dispatch_mode_stack,
        _pop_mode,
        _push_mode,
    )

    kinds = tuple(k for k in (getattr(torch.utils.checkpoint, name, None) for name in (
        "_CachingTorchDispatchMode", "_CachedTorchDispatchMode")) if isinstance(k, type))
    stack = _get_current_dispatch_mode_stack()
    lowest = next((i for i, m in enumerate(stack) if isinstance(m, kinds)), None) if kinds \
        else None
    if lowest is None:
        yield
        return
    popped = [_pop_mode() for _ in range(len(stack) - lowest)]  # the top first
    kept = [m for m in reversed(popped) if not isinstance(m, kinds)]
    for mode in kept:
        _push_mode(mode)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for mode in reversed(popped):
            _push_mode(mode)


def source_name(source: Any) -> str:
    """A Dynamo ``Source``'s name, e.g. ``L['arg0'].size()[1]``: a method before torch 2.13."""
    name = source.name
    return name() if callable(name) else name


def call_cpp_tensor_pre_hooks(hook_id: int, grad: torch.Tensor) -> torch.Tensor:
    """Run the C++ tensor pre-hooks (``retain_grad``) the engine registered under ``hook_id``."""
    return _engine().call_cpp_tensor_pre_hooks(hook_id, grad)


def accumulate_grad_args(
    variable: Any, variable_grad: Any, grad: Any, has_post_hooks: bool | None
) -> tuple[Any, Any, Any, bool]:
    """Normalize the engine's ``accumulate_grad`` arguments to
    ``(variable, variable_grad, grad, has_post_hooks)``: older engines pass
    ``(variable, grad, has_post_hooks)`` and leave ``variable_grad`` to be read from ``.grad``."""
    if has_post_hooks is None:
        return variable, variable.grad, variable_grad, bool(grad)
    return variable, variable_grad, grad, bool(has_post_hooks)


def size_hint(size: int | torch.SymInt, fallback: int = 4096) -> int:
    """A concrete value for a possibly symbolic size, for cost estimates only (never guards);
    ``fallback`` for an unbacked size with no hint."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    from torch.fx.experimental import symbolic_shapes

    if hasattr(symbolic_shapes, "optimization_hint"):  # 2.13
        return int(symbolic_shapes.optimization_hint(size, fallback=fallback))
    return int(symbolic_shapes.size_hint(size, fallback=fallback))  # 2.11 (hint_int: deprecated)


# --- Inductor -----------------------------------------------------------------------------------


def inductor_joint_graph_passes(gm: Any, device: torch.device | None) -> Any:
    """Run Inductor's joint-graph passes (pattern rewrites, its own RNG) on ``gm``; returns the
    rewritten GraphModule. ``device`` picks which device's patterns load (older releases take
    none)."""
    import inspect

    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    if "input_device" in inspect.signature(joint_graph_passes).parameters:
        return joint_graph_passes(gm, input_device=device)
    return joint_graph_passes(gm)


def treespec_children(spec: Any) -> list[Any]:
    """The child specs of a pytree TreeSpec (2.13 deprecates ``children_specs``); not to be
    changed (a key's walk reads them at every call)."""
    return spec.children() if _TREESPEC_HAS_CHILDREN else spec.children_specs


_TREESPEC_HAS_CHILDREN = callable(getattr(pytree.TreeSpec, "children", None))


def keep_stack_traces_of(fn: Any) -> None:
    """Let ``make_fx(record_stack_traces=True)`` keep ``fn``'s frames in ``node.meta
    ["stack_trace"]`` (by default it keeps only frames of functions named ``forward``)."""
    from torch.fx import proxy

    register = getattr(proxy, "_register_stack_trace_anchor", None)
    if register is not None:  # absent in older releases: module forwards only
        register(getattr(fn, "__func__", fn))


@contextlib.contextmanager
def fx_tracing() -> Iterator[None]:
    """Mark a pass as an FX trace, as make_fx marks its own (``torch.fx._symbolic_trace``'s
    module flag): code that asks (Dynamo's ``torch.compile`` wrapper, torch.nested) then acts
    in the metadata pass as it will in the traced one."""
    import torch.fx._symbolic_trace as symbolic_trace

    before = symbolic_trace._is_fx_tracing_flag
    symbolic_trace._is_fx_tracing_flag = True
    try:
        yield
    finally:
        symbolic_trace._is_fx_tracing_flag = before


def is_nested_compile_refusal(error: BaseException) -> bool:
    """Dynamo's RuntimeError for a ``torch.compile``'d function called under an FX trace
    (``torch._dynamo.eval_frame``; same words in torch 2.11 and 2.13)."""
    return isinstance(error, RuntimeError) and "a dynamo-optimized function" in str(error)


def rename_unbacked_symbol(shape_env: Any, old: Any, new: Any) -> None:
    """Tell the ShapeEnv that unbacked symbol ``old`` is ``new`` (its private rename, the one
    PyTorch uses when re-tracing gives a data-dependent size a fresh symbol); one already
    replaced is left as it is."""
    if old not in shape_env.replacements:
        shape_env._rename_unbacked_to(old, new)


def dynamo_recompile_reason() -> str | None:
    """The guard failure that made Dynamo compile the current frame again, from the metrics of
    the running compile (private: ``MetricsContext`` has no public getter)."""
    from torch._dynamo.utils import get_metrics_context

    metrics = getattr(get_metrics_context(), "_metrics", {})
    reason = metrics.get("recompile_reason")
    return tidy_guard_failure(str(reason)) if reason else None


def tidy_guard_failure(text: str) -> str:
    """Dynamo's guard failure text in one line: ``0/2: k == 2`` padded to a column, a comment
    with the source line and a cut-off path, then a "User stack trace" block, becomes
    ``0/2: k == 2 (from f.py:9 in fb: return x * k)``."""
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return text.strip()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith("File \"")]
    where = lines[frames[-1]].strip() if frames else ""
    source = lines[frames[-1] + 1].strip() if frames and frames[-1] + 1 < len(lines) else ""
    if source.startswith("File \""):
        source = ""
    # "<guard, padded>  # <source line>  # <cut-off path>:<line> in <function>": the guard
    # itself may hold "  # " (inside a string), so cut where the source comment starts.
    first = lines[0]
    cut = first.rfind(f"# {source}  # ") if source else -1
    if cut < 0:
        cut = first.rfind("#   # ") if "#   # " in first else first.find("  # ")
    guard = (first[:cut] if cut > 0 else first).rstrip()
    try:
        path = where.split('"')[1]
        line_no = where.split(", line ")[1].split(",")[0]
        function = where.rsplit(" in ", 1)[1]
    except IndexError:
        return guard
    shown = f": {source}" if source.strip("()[]{} ") else ""
    return f"{guard} (from {os.path.basename(path)}:{line_no} in {function}{shown})"


# Note [aotkit's code is not user code to Dynamo]
# Dynamo's frame callback stays active while a torch.compile'd function runs eagerly across a
# graph break, such as the ``loss.backward()`` inside a compiled training step. The engine then
# calls aotkit's Python code (a compiled backward, compiled autograd's capture and replay), and
# Dynamo would compile each of those frames as user code: ~100 frames of aotkit traced, or a
# crash inside the capture. PyTorch's own AOT autograd lives under torch/, which Dynamo skips.
# So every code object of aotkit's machinery, and of the graphs its own compilers run as Python
# (nop's), is marked to be skipped when it starts a frame; a graph a user's compiler returns is
# theirs (it may be gm.compile()d later). That only concerns frames Dynamo would start compiling:
# Dynamo still inlines them when it traces code that calls them (a compiled autograd graph
# compiled with torch.compile calls aotkit's runtime functions).
_hidden_modules: set[str] = set()
_modules_seen = 0  # len(sys.modules) at the last walk
#: The machinery the engine can call into; not aotkit.models, whose models users compile.
_MACHINERY = ("aotkit.aot", "aotkit.compilers", "aotkit.compiled_autograd", "aotkit.partition",
              "aotkit.backends", "aotkit.compat", "aotkit.counters", "aotkit.config",
              "aotkit.errors")
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


# Note [Importing Dynamo once]
# Making a FakeTensorMode imports Dynamo (about a second, on first use), as does marking
# aotkit's code for Dynamo to skip. PyTorch's modules import one another lazily, and two
# threads importing parts of Dynamo at once (one thread's first aot_function call, another's
# compiled_autograd.enable()) could see a partially initialized module ("cannot import name
# 'skip_code' from partially initialized module 'torch._dynamo.eval_frame'"), after which
# compiled autograd failed for the rest of the process. aotkit imports Dynamo in one place,
# under a lock, before either.
_dynamo_lock = new_lock()
_dynamo_loaded = False


def load_dynamo() -> None:
    """Import Dynamo, once, in one thread at a time (Note [Importing Dynamo once])."""
    global _dynamo_loaded
    if _dynamo_loaded:
        return
    with _dynamo_lock:
        import torch._dynamo  # noqa: F401  (its eval_frame, compiled_autograd and utils too)

        _dynamo_loaded = True


def new_fake_mode(**kwargs: Any) -> FakeTensorMode:
    """``FakeTensorMode(**kwargs)``, made after Dynamo is imported (Note [Importing Dynamo
    once])."""
    load_dynamo()
    return FakeTensorMode(**kwargs)


def hide_from_dynamo(*extra: Any) -> None:
    """Mark aotkit's machinery (its modules imported so far, and ``extra`` callables) to be
    skipped by Dynamo's frame callback (Note [aotkit's code is not user code to Dynamo])."""
    load_dynamo()
    from torch._dynamo.eval_frame import skip_code

    def skip(obj: Any, seen: set[int], anywhere: bool = False) -> None:
        obj = getattr(obj, "__func__", obj)
        code = getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType) and (anywhere or code.co_filename.startswith(_OWN_DIR)):
            skip_nested(code, seen)
        wrapped = getattr(obj, "__wrapped__", None)  # a @contextmanager's generator
        if wrapped is not None and wrapped is not obj:
            skip(wrapped, seen)

    def skip_nested(code: types.CodeType, seen: set[int]) -> None:
        if id(code) in seen:
            return
        seen.add(id(code))
        skip_code(code)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                skip_nested(const, seen)

    global _modules_seen
    seen: set[int] = set()
    for obj in extra:  # generated graph code: no file of ours
        skip(getattr(obj, "forward", obj), seen, anywhere=True)
    if len(sys.modules) == _modules_seen:  # nothing imported since the last walk
        return
    _modules_seen = len(sys.modules)
    for name, module in list(sys.modules.items()):
        if not name.startswith(_MACHINERY) or name in _hidden_modules:
            continue
        _hidden_modules.add(name)
        for value in list(vars(module).values()):
            if not isinstance(value, dict) and getattr(value, "__module__", None) != name:
                continue
            if isinstance(value, type):
                for member in vars(value).values():
                    for part in (member, getattr(member, "fget", None), getattr(member, "fset", None)):
                        skip(part, seen)
            elif isinstance(value, dict):  # tables of functions (bind.py's stand-ins)
                for member in value.values():
                    skip(member, seen)
            else:
                skip(value, seen)


@contextlib.contextmanager
def dynamo_frames_off() -> Iterator[None]:
    """Dynamo's frame callback off while aotkit traces a user's function. Called from a frame
    Dynamo skipped (``torch.compile`` of an ``aot_function``), the function would otherwise be
    compiled by Dynamo as well, its graph traced twice (Note [aotkit's code is not user code to
    Dynamo])."""
    if "torch._dynamo.eval_frame" not in sys.modules:
        yield
        return
    from torch._C._dynamo.eval_frame import set_eval_frame

    prior = set_eval_frame(None)
    try:
        yield
    finally:
        set_eval_frame(prior)


def hide_from_dynamo_if_loaded() -> None:
    """:func:`hide_from_dynamo` when Dynamo is imported already (a compiled function made after
    ``torch.compile`` was used, which may be handed to it); importing Dynamo costs ~0.6 s."""
    if "torch._dynamo.eval_frame" in sys.modules:
        hide_from_dynamo()


def on_dynamo_recompile_limit(callback: Callable[[str, Any, str, str | None, bool], None],
                              ) -> None:
    """Call ``callback(limit_type, limit, function, last_reason, raises)`` whenever Dynamo gives
    up compiling a frame (its recompile limit): it runs the frame eagerly from then on, or
    raises (``raises``: ``fullgraph=True`` or ``fail_on_recompile_limit_hit``). Dynamo also logs
    a warning, but a program that quiets the ``torch`` loggers never sees it: Dynamo's check
    itself is wrapped, reading the frame's code and reason from the caller (``_compile``'s
    ``code`` and ``recompile_reason`` locals, on 2.11 and 2.13)."""
    import torch._dynamo.convert_frame as convert_frame

    check = convert_frame.exceeds_recompile_limit

    def checked(*args: Any, **kwargs: Any) -> Any:
        exceeded, limit_type = check(*args, **kwargs)
        if exceeded:
            caller = sys._getframe(1).f_locals
            code = caller.get("code")
            function = (f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})"
                        if isinstance(code, types.CodeType) else "a frame")
            raises = bool(caller.get("one_graph")) or torch._dynamo.config.fail_on_recompile_limit_hit
            callback(limit_type, getattr(torch._dynamo.config, limit_type, "?"), function,
                     caller.get("recompile_reason"), raises)
        return exceeded, limit_type

    convert_frame.exceeds_recompile_limit = checked

