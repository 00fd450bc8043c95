"""The state of one ``enable`` block and the compiled backward the engine replays."""

from __future__ import annotations

import dis
import functools
import logging
import re
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from aotkit import compat, config, counters
from aotkit.compiled_autograd import runtime
from aotkit.compiled_autograd.lower import Example, Lowered, changed_value, lower
from aotkit.errors import AotkitError, CompilerError, UnsupportedError

log = logging.getLogger("aotkit.compiled_autograd")

CREATE_GRAPH_MESSAGE = (
    "aotkit.compiled_autograd does not support create_graph=True (double backward): the captured "
    "graph calls backward formulas opaquely and would return gradients without a graph. "
    "Workaround: run this backward under aotkit.compiled_autograd.disable(), or compute "
    "higher-order gradients with torch.autograd.grad outside the enable() block."
)
NAN_CHECK_MESSAGE = (
    "aotkit.compiled_autograd does not check each node's gradients for NaN (anomaly mode: "
    "torch.autograd.detect_anomaly() or set_detect_anomaly(True), with check_nan): eager would "
    "raise at the node that made one, a captured graph would leave it in .grad. Fix: run the "
    "backward under aotkit.compiled_autograd.disable() while debugging, or pass "
    "check_nan=False."
)


def refuse_unsupported_modes(replay: bool = False) -> None:
    """What a backward cannot be captured or replayed under: create_graph=True (grad mode is
    on in its backward) and anomaly mode's NaN checks (not in the engine's cache key: a
    backward captured before anomaly mode was turned on replayed without them; the engine has
    released the autograd graph's saved tensors by then)."""
    if torch.is_grad_enabled():
        raise UnsupportedError(CREATE_GRAPH_MESSAGE)
    if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
        raise UnsupportedError(NAN_CHECK_MESSAGE + (
            " The engine has released this backward's graph already (unless retain_graph=True"
            "): run the forward again before retrying." if replay else ""))


# A formula replayed for a size that decides its structure fails on sizes (Note in
# CompiledBackward._structure_changed); other errors of a replay are eager's too.
_SIZES = re.compile(r"size|shape|dimension|split|expand|numel|broadcast|view|match", re.I)


@dataclass
class Session:
    """One ``enable(compiler_fn)`` block: the compiler and how many graphs it captured."""

    compiler_fn: Callable[..., Any]
    dynamic: bool
    captures: int = 0
    #: See Note [Compiler identity].
    identity: tuple[Any, ...] = field(init=False)
    #: The aotkit.config options that change what is captured, as the block began.
    options: tuple[tuple[str, Any], ...] = field(init=False)
    #: The thread that entered the block (the engine's compiler slot is one per process).
    thread: threading.Thread = field(default_factory=threading.current_thread)

    def __post_init__(self) -> None:
        self.identity = compiler_identity(self.compiler_fn)
        self.options = config.cache_key("compiled_autograd")


_active: Session | None = None
#: Graphs captured since the engine's cache was last cleared (0: the next capture is the first).
graphs_cached = 0


def active() -> Session | None:
    """The session of the innermost ``enable`` block, or ``None`` outside one."""
    return _active


def set_active(session: Session | None) -> None:
    global _active
    _active = session


# Note [Compiler identity]
# Two enable() blocks share captured graphs only when their compilers compile alike: the same
# object, or two Python functions made from one definition with the same defaults, globals,
# closed-over objects and values of the globals they read (``enable(lambda gm: gm)`` in a
# training loop makes a new, identical lambda every step; a lambda reading a global that changed
# between blocks compiles differently). Objects are compared by identity, numbers, strings and
# devices by value, and lists, tuples and dicts (up to 64 items, 4 levels deep) item by item
# (``partial(torch.compile, options={...})`` or ``partial(f, passes=(pass_a,))`` made anew
# every step). Bound methods
# (``enable(backend.compile)`` makes a new one at every attribute access) compare by their
# object and function, ``functools.partial``s by their function and arguments. Those values are
# read when the block starts, so a compiler is compared as it was when its block began. One
# object stays one, whatever it holds now (a list a recording compiler appends to, a dict
# counting its calls), as for PyTorch's compiled autograd; a container that changed since its
# block began belongs to a compiler that writes to it, and an equal new one is another compiler.
# A variable the compiler itself assigns (``nonlocal``) is its state: it counts as the cell.
# Globals count by the names the code loads (``LOAD_GLOBAL``, not attribute names: ``gm.graph``
# reads no global ``graph``), with their values, also those it assigns: a default it sets
# lazily may be changed by the user later.
def compiler_identity(fn: Callable[..., Any]) -> tuple[Any, ...]:
    """What decides how ``fn`` compiles, compared object by object by :func:`same_compiler`.
    See Note [Compiler identity]."""
    if isinstance(fn, types.MethodType):
        return (types.MethodType, fn.__self__, *compiler_identity(fn.__func__))
    if type(fn) is functools.partial:
        keywords = sorted(fn.keywords)
        return (functools.partial, *_sized(compiler_identity(fn.func)), *_sized(_values(fn.args)),
                *_sized(tuple(keywords)), *_sized(_values(fn.keywords[k] for k in keywords)))
    if not isinstance(fn, types.FunctionType):
        return (fn,)
    kwdefaults = fn.__kwdefaults__ or {}
    return (
        fn.__code__,
        fn.__globals__,
        *_sized(_values(fn.__defaults__ or ())),
        *_sized(tuple(sorted(kwdefaults))),
        *_sized(_values(kwdefaults[k] for k in sorted(kwdefaults))),
        *_sized(_values(_cells(fn))),
        *_globals_read(fn),
    )


def same_compiler(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two :func:`compiler_identity` results name compilers that compile alike."""
    return _identical(a, b)


def _sized(xs: Sequence[Any]) -> list[Any]:
    """``xs`` preceded by its length, so neighbouring parts of an identity cannot run together."""
    return [len(xs), *xs]


@dataclass(frozen=True, eq=False)
class _Contents:
    """A list, tuple or dict of plain values as it was when its block began: ``obj`` itself, or
    another object with the same kind and items."""

    obj: Any
    items: tuple[Any, ...]


def _values(xs: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(map(_snapshot, xs))


def _snapshot(x: Any, depth: int = 0) -> Any:
    """A list, tuple or dict as its contents, items other than plain values and containers
    compared by identity (``partial(compile_with, passes=(pass_a,))`` made anew every step is
    one compiler); anything else as itself. A list a recording compiler appends graphs to is
    one compiler while it is the same list (Note [Compiler identity])."""
    if isinstance(x, (list, tuple, dict)) and depth < 4 and len(x) <= 64:  # namedtuples too
        items = [i for pair in x.items() for i in pair] if isinstance(x, dict) else list(x)
        return _Contents(x, tuple(_snapshot(i, depth + 1) for i in items))
    return x


#: Immutable values compared by value: a compiler made anew with ``float("0.5")`` or a string
#: built at run time compiles as one made with an equal object.
_BY_VALUE = (int, float, complex, str, bytes, torch.device)


def _identical(xs: Sequence[Any], ys: Sequence[Any]) -> bool:
    return len(xs) == len(ys) and all(
        _object(x) is _object(y)
        or (type(x) is type(y) and type(x) in _BY_VALUE and _same_value(x, y))
        or (type(x) is type(y) is _Contents and type(x.obj) is type(y.obj)
            and _identical(x.items, y.items) and _unchanged(x) and _unchanged(y))
        for x, y in zip(xs, ys, strict=True))


def _unchanged(contents: _Contents) -> bool:
    """The container still holds what it held when its block began: a compiler that writes to
    its own (a list it records graphs in, a dict counting calls) is not one made anew from
    equal options, and a new one must compile its graphs itself."""
    now = _snapshot(contents.obj)
    return type(now) is _Contents and _identical(now.items, contents.items)


def _object(x: Any) -> Any:
    return x.obj if type(x) is _Contents else x


def _same_value(x: Any, y: Any) -> bool:
    """Equal, with floats told apart as they print: -0.0 is not 0.0, and NaN is NaN."""
    return repr(x) == repr(y) if isinstance(x, (float, complex)) else x == y


def _globals_read(fn: types.FunctionType) -> list[Any]:
    """The names of the globals ``fn``'s code reads (nested functions included), each followed by
    its current value; a name not defined in the module's globals (a builtin) by itself."""
    found = []
    for name in sorted(_names_read(fn.__code__)):
        found.append(name)
        if name in fn.__globals__:
            found.append(_snapshot(fn.__globals__[name]))
    return found


def _cells(fn: types.FunctionType) -> list[Any]:
    """The objects ``fn`` closes over; a cell not yet assigned, or one ``fn`` itself assigns
    (``nonlocal count; count += 1``: its state, not an option), counts as the cell itself."""
    written = _cells_written(fn.__code__)
    contents = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            contents.append(cell if name in written else cell.cell_contents)
        except ValueError:
            contents.append(cell)
    return contents


@functools.lru_cache(maxsize=256)
def _names_read(code: types.CodeType) -> frozenset[str]:
    """The global names ``code`` and the functions defined in it load (not attribute names:
    ``node.target`` reads no global ``target``)."""
    names: set[str] = set()
    codes = [code]
    while codes:
        c = codes.pop()
        names.update(i.argval for i in dis.get_instructions(c)
                     if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
        codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return frozenset(names)


@functools.lru_cache(maxsize=256)
def _cells_written(code: types.CodeType) -> frozenset[str]:
    """The free variables ``code`` assigns (``nonlocal``)."""
    return frozenset(i.argval for i in dis.get_instructions(code)
                     if i.opname == "STORE_DEREF" and i.argval in code.co_freevars)


def compile_graph(gm: fx.GraphModule, compiler_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Compile a captured backward once; counted under ``compiled_autograd.compiles``."""
    counters.bump("compiled_autograd", "compiles")
    try:
        with compat.compiled_autograd_off():  # a compiler running a backward: eagerly
            compiled = compiler_fn(gm)
    except Exception as exc:
        raise CompilerError(
            f"compiled autograd: compiler {compiler_fn!r} failed on graph {gm.__class__.__name__}: "
            f"{exc}.\nFix: try aotkit.compiled_autograd.enable(lambda gm: gm) to check the "
            "capture."
        ) from exc
    if not callable(compiled):
        raise CompilerError(
            f"compiled autograd: compiler {compiler_fn!r} returned {type(compiled).__name__}, "
            "not a callable.\nFix: return a callable; a compiler takes a GraphModule and returns "
            "one (the GraphModule itself, or torch.compile(gm))."
        )
    return _checked(compiled, len(gm.graph.output_node().args[0]), compiler_fn)


def _checked(compiled: Callable[..., Any], expected: int,
             compiler_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, made to return the list of gradients (tensors or None) the engine reads;
    anything else would fail inside the engine's C++ (a tuple trips an internal assert, numbers
    crash the process)."""

    def run(*args: Any) -> list[Any]:
        out = compiled(*args)
        if type(out) is tuple:
            out = list(out)
        if type(out) is not list or len(out) != expected or not all(
                o is None or isinstance(o, torch.Tensor) for o in out):
            got = (f"{len(out)} value(s) of types {sorted({type(o).__name__ for o in out})}"
                   if isinstance(out, list) else type(out).__name__)
            raise CompilerError(
                f"compiled autograd: the callable compiler {compiler_fn!r} made returned {got}; "
                f"the captured graph returns a list of {expected} gradient(s), each a tensor or "
                "None.\nFix: return what the GraphModule returns (return gm, or "
                "torch.compile(gm), or call gm(*args) and return its result)."
            )
        return out

    return run


@dataclass
class Variant:
    """One compiled graph of a captured backward: lowered to ATen for the values its guard
    accepts, or the captured graph itself (``lowered`` is None) for any values."""

    gm: fx.GraphModule
    lowered: Lowered | None
    compiled: Callable[..., Any]
    #: Whether the graph may run user code (Note [Backwards during a replay]).
    user_code: bool = field(init=False)

    def __post_init__(self) -> None:
        self.user_code = runtime.runs_user_code(self.gm)


def make_variant(captured: fx.GraphModule, example: Example, session: Session,
                 why_captured: str | None = None) -> Variant:
    """Lower ``captured`` for ``example`` and compile it with the session's compiler; the
    captured graph itself when lowering is off, fails, or is not wanted (``why_captured``), recorded.
    See Note [Lowering captured backwards]."""
    if why_captured is None and not config.compiled_autograd_lower:
        why_captured = "aotkit.config.compiled_autograd_lower is off"
    if why_captured is None:
        try:
            lowered = lower(captured, example)
        except Exception as exc:  # any failure keeps the captured graph, recorded
            why_captured = f"lowering to ATen failed: {type(exc).__name__}: {exc}"
        else:
            # The captured graph is logged at INFO; its lowered form too where asked for.
            counters.log_graph(log, lambda: f"lowered {captured.__class__.__name__} to ATen:\n"
                                            f"{lowered.gm.print_readable(print_output=False)}")
            return Variant(lowered.gm, lowered, compile_graph(lowered.gm, session.compiler_fn))
    if config.compiled_autograd_lower:
        counters.record("fallback", "compiled_autograd",
                        f"{captured.__class__.__name__} runs its formulas opaquely: {why_captured}",
                        logger=log)
    return Variant(captured, None, compile_graph(captured, session.compiler_fn))


# Note [grad_dtype is not in the engine's cache key]
# A leaf's ``grad_dtype`` (float32 gradients for a bfloat16 parameter) is a cast the engine's
# shape check makes before accumulation, and the captured graph keeps it as a constant. The
# engine's cache key leaves grad_dtype out, so after ``p.grad_dtype`` changed, or for a second
# model of the same structure with another grad_dtype, it replayed the old cast: a ``.grad`` of
# the old dtype without a word, or PyTorch's "attempting to assign a gradient with dtype". Each
# replay now compares the grad_dtype of every leaf it accumulates into with the capture's and
# refuses, before anything runs, where one changed.
class CompiledBackward:
    """What the engine caches per autograd-graph structure and calls on each replay.

    Note [Stale compiled backward]: the engine keeps calling a cached entry until its cache is
    cleared, whichever compiler is active. So the entry remembers which compiler built its
    callables and compiles its graphs again when another compiler is active; a graph built by a
    previous compiler is never run.
    """

    def __init__(self, captured: fx.GraphModule, session: Session, first: Variant,
                 to_cuda: list[int], captured_for: Example,
                 grad_dtypes: list[tuple[int, torch.dtype | None]]) -> None:
        self.captured = captured
        self.variants = [first]
        self.to_cuda = to_cuda
        self.captured_for = captured_for  # the capturing backward's sizes and scalars
        self._identity = session.identity
        self._checked = session  # the block whose compiler built the callables, or was compared
        self.accumulated = runtime.accumulated_inputs(captured)  # the leaves taking .grad
        self.grad_dtypes = grad_dtypes  # (input position, grad_dtype) of those leaves

    def _check_grad_dtypes(self, inputs: list[Any]) -> None:
        """Note [grad_dtype is not in the engine's cache key]."""
        for i, dtype in self.grad_dtypes:
            if inputs[i].grad_dtype != dtype:
                raise UnsupportedError(
                    f"compiled autograd: {self.captured.__class__.__name__} accumulates into a "
                    f"leaf of shape {tuple(inputs[i].shape)} whose grad_dtype is now "
                    f"{inputs[i].grad_dtype}, but was {dtype} when this backward was captured; "
                    "PyTorch's engine replays the graph, with that cast in it, without looking "
                    "at grad_dtype. Nothing ran.\nFix: after changing a grad_dtype, call "
                    "aotkit.compiled_autograd.reset() outside the enable() block (the next "
                    "backward is captured again), or run this backward under "
                    "aotkit.compiled_autograd.disable()."
                )

    def _check_compiler(self, session: Session | None) -> Session:
        """The active session, its compiler's graphs compiled again after a switch."""
        if session is None:
            raise UnsupportedError(
                "the autograd engine replayed an aotkit compiled backward outside "
                "aotkit.compiled_autograd.enable(): PyTorch's own compiled autograd is active in "
                "a process where aotkit's captured backwards. The engine binds each backward "
                "formula once per process to the implementation that captured it first, so the "
                "two cannot share a process (reset() does not undo that).\nFix: use one of "
                "them per process."
            )
        if session is self._checked:  # once per block and entry
            return session
        if not same_compiler(session.identity, self._identity):
            counters.record("recompile", "compiled_autograd",
                            f"compiler changed to {session.compiler_fn!r}; compiling the captured "
                            "graph again", logger=log)
            for variant in self.variants:
                variant.compiled = compile_graph(variant.gm, session.compiler_fn)
            self._identity = session.identity
        self._checked = session
        return session

    def compiled_for(self, session: Session | None, example: Example) -> Variant:
        """The graph to run ``example`` with: the first whose guard accepts it, else a new one.
        See Note [Lowering captured backwards]."""
        session = self._check_compiler(session)
        for variant in self.variants:
            if variant.lowered is None or variant.lowered.guard.accepts(example):
                return variant
        lowered = [v.lowered for v in self.variants if v.lowered is not None]
        why = lowered[-1].guard.why_not(example)
        name = self.captured.__class__.__name__
        if session.dynamic:
            variant = make_variant(self.captured, example, session, why_captured=(
                f"{why}, and under enable(dynamic=True) the captured graph serves every size its "
                "lowered graphs do not accept"))
        elif len(lowered) >= config.recompile_limit:
            variant = make_variant(self.captured, example, session, why_captured=(
                f"{why}, and aotkit.config.recompile_limit={config.recompile_limit} graphs "
                "were lowered already"))
        else:
            counters.record("recompile", "compiled_autograd", f"{name}: {why}; lowering it again",
                            logger=log)
            variant = make_variant(self.captured, example, session)
        self.variants.append(variant)
        return variant

    def __call__(self, _engine_fn: Any, inputs: list[Any], sizes: Any, scalars: Any,
                 hooks: Any, packed_data: Any) -> Any:
        refuse_unsupported_modes(replay=True)
        self._check_grad_dtypes(inputs)
        example = Example(inputs, list(sizes), list(scalars))
        variant = self.compiled_for(active(), example)
        for i in self.to_cuda:
            inputs[i] = inputs[i].to("cuda", non_blocking=True)
        try:  # a backward run inside it runs eagerly (Note [Backwards during a replay])
            with compat.compiled_autograd_off() if variant.user_code else nullcontext():
                return runtime.replay(variant.compiled, inputs, example.sizes, example.scalars,
                                      hooks, packed_data, self.accumulated)
        except RuntimeError as exc:
            changed = changed_value(example, self.captured_for, made="captured")
            if changed is None or isinstance(exc, AotkitError) or runtime.raised_by_user(exc) \
                    or not _SIZES.search(str(exc)):  # eager's own (a write into an expanded .grad)
                raise  # ours already say what failed; the user's are theirs
            raise self._structure_changed(changed, exc, active()) from exc

    def _structure_changed(self, changed: str, exc: RuntimeError,
                           session: Session | None) -> UnsupportedError:
        """The engine replays a captured backward whenever only sizes changed (under
        ``dynamic=False``, from the second value of a size on), though a size can decide a
        formula's structure (``x.split(k)``'s chunk count); the replay then fails inside that
        formula. Say so, and how to avoid it in this block's mode."""
        why = ("The graph was captured, or compiled by compiler_fn, for a backward whose "
               "formulas depend on that value (a split whose split size changed; a compiler "
               "specializing an interpolation's output size), which PyTorch's engine does not "
               "notice when sizes are dynamic.")
        if type(exc).__module__.startswith("torch._dynamo"):  # compiler_fn's torch.compile
            why = ("compiler_fn's torch.compile raised it: it compiles the graph again with "
                   "dynamic sizes at this replay, and failed on it.")
            fix = ("Fix: compile with static sizes inside compiler_fn, torch.compile(gm, ..., "
                   "dynamic=False), which compiles again for each new value, or use a "
                   "compiler that does not trace (lambda gm: gm).")
        elif session is not None and not session.dynamic:
            fix = ("Under enable(dynamic=False) the engine captures again for the first new "
                   "value only, then treats the value as dynamic. Fix: run the backwards whose "
                   "value varies under aotkit.compiled_autograd.disable(), or call "
                   "aotkit.compiled_autograd.reset() outside the enable() block before a "
                   "backward with a new value.")
        else:
            fix = ("Fix: aotkit.compiled_autograd.enable(compiler_fn, dynamic=False), which "
                   "captures again for the first new value, or run this backward under "
                   "aotkit.compiled_autograd.disable().")
        return UnsupportedError(
            f"compiled autograd: {self.captured.__class__.__name__} failed on a replay with "
            f"values it was not captured for ({changed}): "
            f"{type(exc).__name__}: {exc}\n{why} {fix}"
        )
