"""What a captured backward graph calls at run time: backward formulas, hooks, accumulation.

The engine hands us each C++ backward formula once per process (``bind``); the graph calls it
through an :class:`Op` so the printed graph names the formula (``MulBackward0``).
"""

from __future__ import annotations

import operator
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx
from torch.autograd.graph import _MultiHandle
from torch.utils.hooks import RemovableHandle

from aotkit import compat
from aotkit.errors import HookResultError, HookResultTypeError, UnsupportedError


class Op:
    """A C++ backward formula the engine bound by name; calls it unchanged."""

    def __init__(self, name: str, fn: Callable[..., Any], is_custom_function: bool,
                 is_traceable: bool) -> None:
        self.fn = fn
        self.is_custom_function = is_custom_function
        self.is_traceable = is_traceable  # runs on fake tensors: see aotkit.compiled_autograd.lower
        self.__name__ = name
        self.__qualname__ = name
        self.__module__ = "aotkit.compiled_autograd.ops"

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"{self.__module__}.{self.__name__}"


_ops: dict[str, Callable[..., Any]] = {}
_custom_counts: Counter[str] = Counter()


def bind(name: str, fn: Callable[..., Any], is_custom_function: bool, is_traceable: bool) -> str:
    """Register a formula; returns the name the engine must use to ask for it again.

    A compiler that runs Dynamo over the captured graph (``torch.compile(gm, ...)``) must not
    trace into the C++ formula: a traceable one stays one graph node that fake-tensor tracing
    later expands to ATen ops; one the engine marks untraceable runs eagerly (a graph break).
    """
    if is_custom_function:
        # C++ custom Functions share class names across extensions: number them.
        base = "CppNode" + name
        name = f"{base}{_custom_counts[base]}"
        _custom_counts[base] += 1
    op = Op(name, fn, is_custom_function, is_traceable)
    _ops[name] = torch._dynamo.allow_in_graph(op) if is_traceable else torch._dynamo.disable(op)
    return name


def lookup(name: str) -> Callable[..., Any]:
    """The formula bound as ``name``. See Note [Compiled autograd protocol] in aotkit.compat."""
    # The engine binds each formula once per process, to whichever implementation captured
    # first; we never borrow another implementation's registry.
    if name not in _ops:
        raise UnsupportedError(
            f"compiled autograd: the engine asked for backward formula {name!r}, which it bound "
            "to another compiled-autograd implementation earlier in this process. Workaround: "
            "do not mix torch._dynamo.compiled_autograd and aotkit.compiled_autograd in one "
            "process, or run this backward under aotkit.compiled_autograd.disable()."
        )
    return _ops[name]


def call_backward(ctx: Any, saved_tensors: Sequence[torch.Tensor], *grads: Any,
                  tensor_inputs: Sequence[bool], vjp: bool = False) -> tuple[Any, ...]:
    """Run a custom ``torch.autograd.Function``'s backward (its ``vjp`` where ``vjp``, see
    :func:`defines_vjp`) with the graph's saved tensors; ``tensor_inputs`` says which forward
    inputs were tensors, for eager's checks of what the backward returns."""
    user = ctx._forward_cls.vjp if vjp else ctx._forward_cls.backward
    try:
        out = _as_the_engine_would(user, compat.replay_ctx(ctx, list(saved_tensors)), *grads)
    except (TypeError, AttributeError) as exc:
        if all(g is not None for g in grads):
            raise
        raise _given_none(ctx, grads) from exc
    return _checked_grads(ctx, out if isinstance(out, tuple) else (out,), tensor_inputs)


def _given_none(ctx: Any, grads: Sequence[Any]) -> UnsupportedError:
    """Why a custom backward failed on None: compiled autograd cannot materialize it."""
    missing = [k for k, g in enumerate(grads) if g is None]
    return UnsupportedError(
        f"{ctx._forward_cls.__name__}.backward failed on None as the gradient of output(s) "
        f"{missing}, which got no gradient in this backward. Eager hands such a backward "
        "zeros (materialize_grads, the default); under compiled autograd the engine passes None "
        "and whether the Function materializes cannot be read (PyTorch's compiled autograd "
        "passes None too).\nFix: treat None as zeros in the backward (`if g is None: g = "
        "torch.zeros_like(out)`), or run this backward under aotkit.compiled_autograd.disable().")


def defines_vjp(cls: type) -> bool:
    """Whether a custom Function defines its backward as ``vjp``, the method's other name."""
    if cls.vjp is torch.autograd.Function.vjp:  # type: ignore[attr-defined]
        return False
    if cls.backward is not torch.autograd.Function.backward:  # type: ignore[attr-defined]
        raise RuntimeError(  # eager refuses this too
            f"{cls.__name__} defines both backward and vjp, two names for one method; define "
            "only one of them.")
    return True


def _checked_grads(ctx: Any, grads: tuple[Any, ...], tensor_inputs: Sequence[bool]) -> tuple[Any, ...]:
    """Eager's checks on a custom backward's result: one gradient per forward input (extra
    ones must be None), each a tensor or None, and None for inputs that were not tensors."""
    name = f"{ctx._forward_cls.__name__}Backward"
    expected = len(tensor_inputs)
    if len(grads) < expected or any(g is not None for g in grads[expected:]):
        raise HookResultError(
            f"function {name} returned an incorrect number of gradients (expected {expected}, "
            f"got {len(grads)}); return one gradient (or None) per forward input.")
    for position, (grad, is_tensor) in enumerate(zip(grads[:expected], tensor_inputs, strict=True),
                                                 start=1):
        if grad is not None and not isinstance(grad, torch.Tensor):
            raise HookResultError(
                f"function {name} returned {type(grad).__name__} as gradient {position}; "
                "return a Tensor or None.")
        if grad is not None and not is_tensor:
            raise HookResultError(
                f"function {name} returned a gradient other than None at position {position}, "
                "but that forward input was not a Tensor; return None there.")
    return grads[:expected]


def add_gradients(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """Sum two gradients flowing into one input of a node, as the engine's input buffer does:
    an undefined gradient (``None``) adds nothing, and a sparse sum so far is added to the new
    gradient (its indices after the new one's). A formula's output is undefined only at run
    time for some arguments (``LinalgVectorNormBackward0`` with ``ord=0``)."""
    if old is None:
        return new
    if new is None:
        return old
    return torch.add(new, old) if old.layout is not torch.strided else torch.add(old, new)


def call_hook(hook: Callable[..., Any], *args: Any, hook_type: str, hook_id: int) -> Any:
    """Run a user hook, ``hooks[hook_id]`` of the backward; a hook returning ``None`` leaves its
    first argument unchanged, and so does a hook removed earlier in this backward (Note [Hooks
    removed during a backward])."""
    removals = _replay.removals
    if removals is not None and not removals.runs(hook, hook_id):
        return args[0]
    if hook_type in ("pre_hook", "post_hook"):  # eager hands node hooks tuples
        args = tuple(map(tuple, args))
    running, _replay.running = _replay.running, hook
    try:
        result = _as_the_engine_would(hook, *args)
    finally:
        _replay.running = running
    if hook_type == "unpack_hook" and not isinstance(result, torch.Tensor):
        raise HookResultTypeError(
            f"saved-tensor unpack hook {_hook_name(hook)!r} returned {type(result).__name__}; "
            "it must return the tensor it unpacks.")
    if result is None:
        return args[0]
    if hook_type == "post_acc_grad_hook":  # eager: a TypeError unless it is a tensor
        error = HookResultError if isinstance(result, torch.Tensor) else HookResultTypeError
        raise error(
            f"a post-accumulate-grad hook returned {type(result).__name__}; such hooks must "
            "return None (modify param.grad in place instead)."
        )
    if hook_type == "tensor_pre_hook":
        _check_grad(hook, result, args[0])
    elif hook_type in ("pre_hook", "post_hook"):
        _check_grads(hook, result, args[0])
    return result


# Note [State a hook leaves behind]
# Eager's engine sets the backward's grad mode and dispatch state (autocast among it) before
# every node, so a hook or custom backward that leaves grad mode on or an autocast region open
# changes nothing after it. A replayed graph runs on in the state such code left: later hooks saw
# grad mode on, ``.grad`` came out requiring grad, later matmuls ran in bfloat16. So each user
# call is followed by the state from before it (inside one node too, where eager's stays). A
# compiler running Dynamo over the graph traces the grad mode set back (not the dispatch keys:
# it traces autocast regions as such).
def _as_the_engine_would(user: Callable[..., Any], *args: Any) -> Any:
    grad = torch.is_grad_enabled()
    if torch.compiler.is_compiling():
        out = user(*args)
        torch.set_grad_enabled(grad)
        return out
    dtypes = tuple(map(torch.get_autocast_dtype, _AUTOCAST_DEVICES))  # an autocast left open
    try:
        with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                             torch._C._dispatch_tls_local_exclude_set()):
            return user(*args)
    except Exception as exc:  # the user's own: passed on as raised (see raised_by_user)
        exc.__dict__[_RAISED_BY_USER] = True
        raise
    finally:
        torch._C._set_grad_enabled(grad)
        for device, dtype in zip(_AUTOCAST_DEVICES, dtypes, strict=True):
            if torch.get_autocast_dtype(device) != dtype:
                torch.set_autocast_dtype(device, dtype)


_AUTOCAST_DEVICES = ("cpu", "cuda")
_RAISED_BY_USER = "_aotkit_raised_by_user"


def raised_by_user(exc: BaseException) -> bool:
    """Whether a hook, custom backward or final callback the replay called raised ``exc`` (a
    bug in a custom backward), or its class is not PyTorch's (a NaN guard's own, raised by a
    dispatch mode): the user's to catch as eager raises it."""
    module = type(exc).__module__
    return bool(getattr(exc, "__dict__", {}).get(_RAISED_BY_USER)) or (module not in (
        "builtins", "torch") and not module.startswith("torch."))


def _hook_name(hook: Callable[..., Any]) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _check_grad(hook: Callable[..., Any], new: Any, old: Any) -> None:
    """Eager's checks on a gradient a hook returned: a tensor (or None) of the same size, dtype
    and device."""
    if new is None:
        return
    if not isinstance(new, torch.Tensor):
        raise HookResultTypeError(
            f"backward hook {_hook_name(hook)!r} returned {type(new).__name__}; a tensor hook "
            "must return a Tensor of the gradient's size, or None to keep the gradient."
        )
    if old is None:
        raise HookResultError(
            f"backward hook {_hook_name(hook)!r} returned a gradient where there was none "
            "(None): can't replace a None gradient with a non-None value; return None there.")
    if new.shape != old.shape:
        raise HookResultError(
            f"backward hook {_hook_name(hook)!r} changed the size of a gradient from "
            f"{tuple(old.shape)} to {tuple(new.shape)}; return a gradient of the same size."
        )
    if new.layout != old.layout:
        raise HookResultError(
            f"backward hook {_hook_name(hook)!r} changed the layout of a gradient from "
            f"{old.layout} to {new.layout}; return a gradient of the same layout.")
    if new.dtype != old.dtype or new.device != old.device:
        raise HookResultError(
            f"backward hook {_hook_name(hook)!r} changed a gradient from {old.dtype} on "
            f"{old.device} to {new.dtype} on {new.device}; return one of the same dtype and "
            "device (cast inside the hook's own computation, then back)."
        )


def _check_grads(hook: Callable[..., Any], new: Any, old: Sequence[Any]) -> None:
    """Eager's checks on the gradients a node pre/post-hook returned: a tuple, one per gradient."""
    if not isinstance(new, tuple):
        raise HookResultTypeError(
            f"backward hook {_hook_name(hook)!r} returned {type(new).__name__}; a node hook must "
            "return a tuple of gradients (or None to keep them)."
        )
    if len(new) != len(old):
        raise HookResultError(
            f"backward hook {_hook_name(hook)!r} returned {len(new)} gradients, expected "
            f"{len(old)}; return one gradient (or None) per gradient it received."
        )
    for n, o in zip(new, old, strict=True):
        _check_grad(hook, n, o)


# Note [Accumulate into the current .grad]
# The engine lifts each leaf's .grad as a graph input, read when the backward starts. Eager
# accumulates into whatever .grad holds when AccumulateGrad runs, and hooks that run earlier in
# the same backward may have replaced or cleared it (an optimizer step with zero_grad in a
# post-accumulate-grad hook). So accumulation reads variable.grad itself, and the graph does not
# take the engine's snapshot.
def call_accumulate_grad(
    variable: torch.Tensor, grad: torch.Tensor, has_post_hooks: bool, stealable: bool = False
) -> torch.Tensor:
    """Accumulate ``grad`` into ``variable.grad`` with the engine's own AccumulateGrad rules.
    See Note [Accumulate into the current .grad].

    ``stealable``: the graph proved that nothing else holds ``grad`` and that it has ``.grad``'s
    layout (Note [Lowering captured backwards]), so an empty ``.grad`` takes it without a copy.
    """
    if stealable and variable.grad is None:
        variable.grad = grad.detach()
        return variable.grad
    updated = lookup("AccumulateGrad")([grad], variable, variable.grad, has_post_hooks)
    variable.grad = updated[0]
    return variable.grad


def accumulated_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions in the graph's ``inputs`` of the leaves it accumulates ``.grad`` into."""
    return sorted({node.args[0].args[1]  # type: ignore[union-attr]
                   for node in gm.graph.find_nodes(op="call_function", target=call_accumulate_grad)
                   if isinstance(node.args[0], fx.Node) and node.args[0].target is operator.getitem
                   and node.args[0].args[0].op == "placeholder"})  # type: ignore[union-attr]


def call_cpp_tensor_pre_hooks(hook_id: int, grad: torch.Tensor) -> torch.Tensor:
    """Run C++ tensor pre-hooks such as the one ``retain_grad()`` installs; not on a missing
    gradient (a custom backward returned None), as eager does not (passed to C++: a crash)."""
    return grad if grad is None else compat.call_cpp_tensor_pre_hooks(hook_id, grad)


def copy_slices_prologue(
    inputs: Sequence[torch.Tensor],
    base_sizes: Sequence[Any],
    base_strides: Sequence[Any],
    base_offset: Any,
    view_sizes: Sequence[Any],
    view_strides: Sequence[Any],
    view_offset: Any,
) -> list[torch.Tensor]:
    """First half of an in-place-on-view backward (CopySlices): the base-shaped gradient, the
    view's slice of it, and a contiguous copy of that slice for the view's formula."""
    result = inputs[0].new_empty_strided(base_sizes, base_strides)
    result.copy_(inputs[0])
    grad_slice = result.as_strided(view_sizes, view_strides, view_offset - base_offset)
    return [result, grad_slice, grad_slice.clone(memory_format=torch.contiguous_format)]


def copy_slices_epilogue(
    needs_input_grad: Sequence[bool],
    result: torch.Tensor,
    res: Sequence[torch.Tensor | None],
    grad_slice: torch.Tensor,
) -> list[torch.Tensor | None]:
    """Second half of CopySlices: write the view formula's grad back into the base gradient."""
    out: list[torch.Tensor | None] = [None] * len(needs_input_grad)
    for i, needed in enumerate(needs_input_grad):
        if not needed or res[i] is None:
            continue
        if i == 0:
            grad_slice.copy_(res[0])  # type: ignore[arg-type]
            out[0] = result
        else:
            out[i] = res[i]
    return out


#: Calls that have effects (user code, ``.grad`` writes) and must survive dead-code elimination.
IMPURE = frozenset({call_backward, call_hook, call_accumulate_grad, call_cpp_tensor_pre_hooks})


# Note [Final callbacks]
# Code running inside a backward may queue a callback to run once the whole backward is done
# (``Variable._execution_engine.queue_callback``; FSDP2 reshards its parameters and
# reduce-scatters their gradients in one). The engine keeps such callbacks on the running graph
# task and calls them after the last node, but a compiled backward takes the place of that run
# and the engine drops whatever was queued during it: FSDP2's parameters stayed unsharded with
# unreduced gradients. So while enable() is active, ``Variable._execution_engine`` is an
# ``Engine`` that, on a thread replaying a compiled graph, collects the callbacks; the replay
# runs them after its graph, in order, including callbacks they queue, as eager does. A
# backward started inside the graph (a hook calling ``autograd.grad``) is the real engine's,
# and so are its callbacks.
class _ReplayState(threading.local):
    """What the replay running on this thread has going. ``__init__`` runs in each thread that
    reads it, so every attribute is always there: a compiler tracing the graph with Dynamo
    guards on a missing attribute, and the first replay setting it compiled the graph again."""

    def __init__(self) -> None:
        self.queued: list[Callable[[], None]] | None = None  # the replay's callbacks
        self.removals: _Removals | None = None  # its hook-call bookkeeping, if it calls hooks
        self.running: Callable[..., Any] | None = None  # the user hook it is calling
        self.together = False  # a multi-grad hook's handle is removing its registrations


_replay = _ReplayState()


# Note [Backwards during a replay]
# A backward that starts while a compiled graph replays runs in the plain engine: one a hook or
# custom backward of the graph runs (a hook calling autograd.grad, a reentrant checkpoint), and
# one another thread runs meanwhile; the engine refuses a compiled backward inside or beside
# another ("compiled autograd within another compiled autograd call"). So the engine's compiler
# slot is emptied around the replay of a graph that runs user code (``runs_user_code``), where
# such a backward may also start from C++ (a TorchScript function's autograd.grad). A graph of
# ATen ops alone starts none itself, and emptying and refilling the slot around it cost ~15-20 us
# per replay on the project's CPU machine; there the slot is emptied only for a backward that
# enters ``Engine.run_backward`` while some thread replays, another thread's. (One started from
# C++ in another thread at that moment meets the engine's refusal.) A compiler is called with
# the slot empty too: one may run a backward to check what it made.
_replaying: list[None] = []  # one item per replay running, in any thread (append/pop are atomic)
#: What a graph calls that runs no user code (hooks, custom backwards and formulas called
#: opaquely, a C++ custom Function's among them, may start a backward from C++).
_NO_USER_CODE = frozenset({operator.getitem, add_gradients, call_accumulate_grad,
                           call_cpp_tensor_pre_hooks, copy_slices_prologue, copy_slices_epilogue})


def runs_user_code(gm: fx.GraphModule) -> bool:
    """Whether running ``gm`` may run user code, which may start a backward of its own: such a
    graph is replayed with the engine's compiler slot empty (Note [Backwards during a replay])."""
    return any(node.op not in ("placeholder", "output", "get_attr") and not (
        node.op == "call_function" and (isinstance(node.target, torch._ops.OpOverload)
                                        or node.target in _NO_USER_CODE))
        for node in gm.graph.nodes)


# Note [Cache entries without a graph]
# The engine caches graphs in a tree keyed by the autograd nodes a backward visits. A capture
# that failed (create_graph=True, a compiler that raises) leaves its entry without a graph, and
# so does an earlier, larger backward for the entries on its way (torch.autograd.grad asked for
# an input it never reaches stops early). The next backward ending at such an entry captures
# again, except that with a verbose logger set the engine insists on a reason for the capture,
# finds none and fails an internal assert before running anything. That backward is run again
# without the logger (the capture then records why the engine had nothing to say), and the
# logger is set back.
_unexplained = threading.local()  # .retrying: True while such a backward runs again


def retrying_unexplained() -> bool:
    """Whether the running backward is one the engine could not explain (Note [Cache entries
    without a graph])."""
    return getattr(_unexplained, "retrying", False)


class Engine:
    """Stands in for ``Variable._execution_engine`` while enable() is active. See Note [Final
    callbacks] and Note [Cache entries without a graph]; ``before_backward`` runs first at every
    backward (enable() checks there that its compiler is still installed)."""

    def __init__(self, engine: Any, before_backward: Callable[[], None],
                 verbose_logger: Any) -> None:
        self.engine = engine
        self.before_backward = before_backward
        self.verbose_logger = verbose_logger

    def queue_callback(self, callback: Callable[[], None]) -> None:
        queued = _replay.queued
        if queued is None:
            self.engine.queue_callback(callback)
        else:
            queued.append(callback)

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        if _replaying:  # Note [Backwards during a replay]
            with compat.compiled_autograd_off():
                return self._run_backward(*args, **kwargs)
        return self._run_backward(*args, **kwargs)

    def _run_backward(self, *args: Any, **kwargs: Any) -> Any:
        self.before_backward()
        queued, _replay.queued = _replay.queued, None
        try:
            try:
                return self.engine.run_backward(*args, **kwargs)
            except RuntimeError as exc:
                if not compat.is_unexplained_cache_entry(exc):
                    raise
            compat.set_autograd_verbose_logger(None)
            _unexplained.retrying = True
            try:
                return self.engine.run_backward(*args, **kwargs)
            finally:
                _unexplained.retrying = False
                compat.set_autograd_verbose_logger(self.verbose_logger)
        finally:
            _replay.queued = queued

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def replay(fn: Callable[..., Any], inputs: list[Any], sizes: Any, scalars: Any, hooks: Any,
           packed_data: Any, accumulated: Sequence[int] = ()) -> Any:
    """Run a compiled backward, then the callbacks queued while it ran (Note [Final callbacks]),
    noting the hooks removed meanwhile (Note [Hooks removed during a backward]). ``accumulated``:
    the positions in ``inputs`` of the leaves whose ``.grad`` the graph accumulates."""
    queued: list[Callable[[], None]] = []
    outer = _replay.queued, _replay.removals
    # Without hooks there is nothing a removal could skip.
    removals = _Removals(hooks, [inputs[i] for i in accumulated]) if hooks else None
    _replay.queued, _replay.removals = queued, removals
    _replaying.append(None)
    try:
        out = fn(inputs, sizes, scalars, hooks, packed_data)
        i = 0
        while i < len(queued):  # a callback may queue more
            _as_the_engine_would(queued[i])
            i += 1
        return out
    finally:
        _replaying.pop()
        _replay.queued, _replay.removals = outer


# Note [Hooks removed during a backward]
# The engine hands the capture every hook registered when the backward starts, and the graph
# calls each. In eager, a hook that an earlier hook of the same backward removes (through its
# handle) is not called: the engine reads the hook tables as it reaches each node. So while
# enable() is active, ``RemovableHandle.remove`` tells the running replay which hook function
# leaves which table, and the graph skips the call that registration would have made. The graph
# knows a call only by its function, so the registration is found by counting: a function
# registered once in this backward is that registration; several registrations in the one table
# run in its order (and skipping any of them gives the same result); a registration whose call
# already ran (a hook removing itself) skips nothing, and neither does a removal by a hook of
# the same table (the engine calls a table's hooks from a copy taken before the first). One function registered on several tensors
# or nodes, one of which is removed while calls are still to come, cannot be told apart and is
# refused. A function registered once in this backward, on a leaf the graph accumulates into,
# and also on a tensor outside it: removing the outside registration skips nothing, since the
# leaf's own hook tables (taken when the replay starts, before the graph frees its inputs) still
# hold it. For a non-leaf tensor, a node or the inputs of torch.autograd.grad, whose tables the
# graph does not see, the outside registration is taken for the inside one. A hook registered during a backward is not seen at all (README,
# known gaps).
class _Removals:
    """The hook calls one replay is to skip."""

    def __init__(self, hooks: Sequence[Any], leaves: Sequence[torch.Tensor]) -> None:
        self.hooks = hooks  # the registrations this backward calls (held: ids stay theirs)
        # A function is keyed by the first position it has in ``hooks``. The graph names its
        # call by position: a compiler tracing the graph with Dynamo would guard on id(hook),
        # and compile again for each new closure (a module's backward hooks, made per forward).
        self.key_of: dict[int, int] = {}  # id(hook) -> its key
        self.keys = [self.key_of.setdefault(id(h), i) for i, h in enumerate(hooks)]
        self.totals = Counter(self.keys)  # key -> its calls in this backward
        self.calls: Counter[int] = Counter()  # key -> calls made or skipped so far
        self.skip: Counter[int] = Counter()   # key -> calls still to skip
        self.pending: Counter[int] = Counter()  # key -> registrations removed, undecided
        # the hook tables of the leaves the graph accumulates into
        self.leaf_tables = [table for t in leaves
                            for table in (t._backward_hooks, t._post_accumulate_grad_hooks)
                            if table]

    def runs(self, hook: Callable[..., Any], hook_id: int) -> bool:
        """Count a call of ``hook``, ``hooks[hook_id]``; whether it is to be made."""
        key = self.keys[hook_id]
        if self.pending and 0 < self.pending[key] < self.totals[key]:
            raise _which_removed(hook, self.totals[key])
        self.calls[key] += 1
        if self.skip[key]:
            self.skip[key] -= 1
            return False
        return True

    def removed(self, hook: Callable[..., Any], table: Mapping[Any, Any], handle_id: Any) -> None:
        """``hook``'s registration under ``handle_id`` in ``table`` is being removed."""
        running = _replay.running  # registered once: this table's, if here
        if running is not None and self.totals[self.key_of.get(id(running))] == 1 \
                and any(h is running for h in table.values()):
            return  # the engine calls a table's hooks from a copy: removed from the next backward
        key = self.key_of.get(id(hook))  # None: not called in this backward
        total = self.totals[key]  # not counted per removal: one-shot hooks were quadratic
        if total - self.calls[key] - self.skip[key] <= 0:
            return  # every call already ran: the removed one ran too, or is outside
        done = self.calls[key] + self.skip[key]
        in_table = [k for k, h in table.items() if h is hook]
        if total == 1:
            self.skip[key] += not any(t is not table and any(h is hook for h in t.values())
                                      for t in self.leaf_tables)
        elif len(in_table) == total:  # all in this table, called in its order
            self.skip[key] += in_table.index(handle_id) >= done
        elif _replay.together:  # a multi-grad hook's handle: removes its
            self.pending[key] += 1  # registrations at once, decided when this backward's are
            if self.pending[key] == total:
                self.skip[key] = total - self.calls[key]
        else:
            raise _which_removed(hook, total)


def _which_removed(hook: Callable[..., Any], total: int) -> UnsupportedError:
    return UnsupportedError(
        f"compiled autograd: a hook removed during the backward ({_hook_name(hook)!r}) is one "
        f"function registered {total} times in this backward on different tensors or nodes, "
        "and calls of it are still to come; the compiled graph cannot tell which "
        "registration was removed.\nFix: register a distinct function on each tensor (a "
        "closure or functools.partial), or run this backward under "
        "aotkit.compiled_autograd.disable()."
    )


_original_remove = RemovableHandle.remove


def _noting_remove(handle: RemovableHandle) -> None:
    removals = _replay.removals
    try:
        if removals is not None:
            table = handle.hooks_dict_ref()
            if table is not None and handle.id in table:
                removals.removed(table[handle.id], table, handle.id)
    finally:  # a removal this backward refuses still leaves the later ones
        _original_remove(handle)


_original_multi_remove = _MultiHandle.remove


def _noting_multi_remove(handle: _MultiHandle) -> None:
    """register_multi_grad_hook's handle: one function on every tensor, all removed."""
    _replay.together = True
    try:
        _original_multi_remove(handle)
    finally:
        _replay.together = False


def note_removed_hooks(on: bool) -> None:
    """Install (or take back) the ``RemovableHandle.remove`` of Note [Hooks removed during a
    backward]."""
    RemovableHandle.remove = _noting_remove if on else _original_remove  # type: ignore[method-assign]
    _MultiHandle.remove = _noting_multi_remove if on else _original_multi_remove  # type: ignore[method-assign]
