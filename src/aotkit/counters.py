"""Counters and recorded decisions: every recompile, fallback, skip or bypass is data.

A decision is logged under an ``aotkit.*`` logger, counted, and kept for :func:`explain`::

    >>> from aotkit import counters
    >>> counters.reset()
    >>> _ = counters.record("recompile", "aot_function(f)", "shape of x changed: (2,) -> (3,)")
    >>> counters.counters["recompile"]["aot_function(f)"]
    1
    >>> print(counters.explain())  # doctest: +ELLIPSIS
    aotkit: 1 decision(s)
      [recompile] aot_function(f): shape of x changed: (2,) -> (3,)
    ...
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from aotkit import config
from aotkit.errors import ArgumentError
from aotkit.locks import new_lock

#: ``counters[category][name]``, e.g. ``counters["aot"]["fw_compiles"]``.
counters: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(
    collections.Counter
)

_decisions: collections.deque[Decision] = collections.deque()
_LOCK = new_lock()  # counters and decisions are recorded and read from several threads

#: The kinds of decision aotkit records, with what each means.
KINDS: dict[str, str] = {
    "recompile": "a compiled entry traced again (new signature, option, guard or state)",
    "retrace": "a trace taken once more in another way, with the reason the first failed",
    "backward_variant": "a backward graph compiled again without gradients a backward lacks",
    "fallback": "something ran otherwise than asked (eagerly, or as DOT instead of an image)",
    "graph_break": "Dynamo split its graph where aotkit could not trace",
    "specialize": "a value compiled as a constant, so each new value compiles anew",
    "identity_key": "part of an object argument keyed by identity: in-place changes unseen",
    "partition": "what a partitioner saved for backward and what it recomputes",
    "inline": "a nested compile region traced inline",
    "hook": "module hooks traced with the forward and backward",
    "side_effect": "a number forward changes in what a module holds, changed once per trace",
    "capture": "compiled autograd captured a backward",
    "recapture": "compiled autograd captured a backward again, with the reason",
    "hook_order": "compiled autograd could not order hooks as eager does",
    "thread": "compiled autograd captured a backward of another thread",
    "cache_clear": "compiled autograd's engine cache was cleared",
    "cuda_scalars": "compiled autograd moved CPU scalars to the GPU for CUDA graphs",
    "reseed": "another thread reseeded the global generator during a trace (not the function)",
    "known_mismatch": "debug_nop let through a difference PyTorch's own kernels are known to have",
}
log = logging.getLogger("aotkit")


@dataclass(frozen=True, repr=False)
class Decision:
    """One recompile, fallback, skip or bypass, with its reason.

    ``kind`` is a short category (``"recompile"``, ``"fallback"``, ...), ``what`` names the
    compiled object it concerns, ``why`` is a sentence a user can act on, ``node`` names the FX
    node involved (if any) and ``user_stack`` is the user's source location (if known).
    """

    kind: str
    what: str
    why: str
    node: str | None = None
    user_stack: str | None = None
    timestamp: float = field(default_factory=time.time, compare=False)

    def __str__(self) -> str:
        where = f" (node {self.node})" if self.node else ""
        text = f"[{self.kind}] {self.what}{where}: {self.why}"
        if self.user_stack:
            text += "\n    at " + self.user_stack.strip().replace("\n", "\n    ")
        return text

    __repr__ = __str__  # a list of decisions prints readably


def bump(category: str, name: str, by: int = 1) -> None:
    """Add ``by`` to ``counters[category][name]``."""
    with _LOCK:
        counters[category][name] += by


def record(
    kind: str,
    what: str,
    why: str,
    *,
    node: str | None = None,
    user_stack: str | None = None,
    logger: logging.Logger | None = None,
    level: int = logging.INFO,
) -> Decision:
    """Log, count and keep one decision; returns it."""
    if not isinstance(kind, str) or not isinstance(what, str):
        raise ArgumentError(f"counters.record takes a kind and a what that are str, got "
                            f"{type(kind).__name__} and {type(what).__name__}.\nFix: name them "
                            "with strings (aotkit's kinds are listed in counters.KINDS).")
    decision = Decision(kind, what, why, node, user_stack)
    with _LOCK:
        _decisions.append(decision)
        while len(_decisions) > max(config.max_decisions, 0):
            _decisions.popleft()
        counters[kind][what] += 1
    (logger or log).log(level, "%s", decision)
    return decision


_recorded_once: set[tuple[str, str, str]] = set()


def record_once(kind: str, what: str, why: str, *, once: str,
                logger: logging.Logger | None = None) -> None:
    """:func:`record` the first decision of this ``kind``, ``what`` and ``once`` tag since
    :func:`reset`; later ones are counted only, so a fallback taken at every call keeps one
    decision (and one log line), not one per call."""
    with _LOCK:
        first = (kind, what, once) not in _recorded_once
        _recorded_once.add((kind, what, once))
        if not first:
            counters[kind][what] += 1
    if first:
        record(kind, what, why, logger=logger)


def log_graph(logger: logging.Logger, text: Callable[[], str]) -> None:
    """Log a graph's ``text()`` at INFO under ``aotkit.config.log_graphs``, else at DEBUG. Asked
    for (AOTKIT_LOG_GRAPHS=1) where nothing shows aotkit's logs, it is printed to stderr, as
    TORCH_LOGS shows PyTorch's (logging's configuration is left as it is)."""
    level = logging.INFO if config.log_graphs else logging.DEBUG
    if config.log_graphs and not logger.hasHandlers():
        print(f"[{logger.name}] {text()}", file=sys.stderr)
    elif logger.isEnabledFor(level):
        logger.log(level, "%s", text())


class Explanation:
    """What :func:`explain` returns: the decisions kept and a copy of the counters."""

    def __init__(self, decisions: list[Decision], counts: dict[str, dict[str, int]],
                 dynamo: dict[str, int] | None = None) -> None:
        self.decisions = decisions
        self.counters = counts
        # Dynamo's own graph breaks and the code it ran eagerly (``nn.GRU`` without
        # ``allow_rnn``), by reason: decided before any backend sees a graph.
        self.dynamo = dynamo or {}

    def __iter__(self) -> Iterator[Decision]:
        return iter(self.decisions)

    def __len__(self) -> int:
        return len(self.decisions)

    def of_kind(self, kind: str) -> list[Decision]:
        """The decisions of one kind (see :data:`KINDS`), e.g. ``explain().of_kind("recompile")``."""
        if not isinstance(kind, str):
            raise ArgumentError(f"of_kind takes a kind's name, got {kind!r}.\nFix: use one of "
                                f"{', '.join(KINDS)}.")
        found = [d for d in self.decisions if d.kind == kind]
        if not found and kind not in KINDS and kind not in self.counters:  # a misspelling
            import difflib

            close = difflib.get_close_matches(kind, list(KINDS), n=1)
            raise ArgumentError(f"no decision is of kind {kind!r}, and aotkit records no such "
                                f"kind{f'; did you mean {close[0]!r}?' if close else '.'}\nFix: "
                                f"use one of {', '.join(KINDS)}.")
        return found

    def __str__(self) -> str:
        lines = [f"aotkit: {len(self.decisions)} decision(s)"]
        lines += ["  " + str(d).replace("\n", "\n    ") for d in self.decisions]
        lines.append("counters:")
        for category, names in sorted(self.counters.items()):
            for name, value in sorted(names.items()):
                lines.append(f"  {category}.{name} = {value}")
        if self.dynamo:
            lines.append("Dynamo graph breaks and code it ran eagerly (torch._dynamo.utils.counters):")
            lines += [f"  {count} x {reason.splitlines()[0]}" for reason, count in self.dynamo.items()]
        return "\n".join(lines)

    __repr__ = __str__


def explain() -> Explanation:
    """Every decision recorded since the last :func:`aotkit.counters.reset` (oldest first) and
    the counters.

    Example::

        >>> import aotkit
        >>> report = aotkit.explain()
        >>> [d.why for d in report.of_kind("recompile")]  # doctest: +SKIP
    """
    with _LOCK:
        counts = {cat: dict(names) for cat, names in counters.items() if names}
        decisions = list(_decisions)
    return Explanation(decisions, counts, _dynamo_breaks())


def _dynamo_breaks() -> dict[str, int]:
    """Dynamo's graph-break and unsupported-code counts since the last :func:`aotkit.counters.reset` (Dynamo
    keeps process-wide counters, which torch._dynamo.reset() does not clear)."""
    found = {}
    for reason, count in _dynamo_totals().items():
        since = count - _dynamo_at_reset.get(reason, 0)
        if since < 0:  # Dynamo's counters were cleared since
            since = count
        if since:
            found[reason] = since
    return found


def _dynamo_totals() -> dict[str, int]:
    # Another thread may be importing Dynamo: its module is there before its counters are.
    dynamo_counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    if dynamo_counters is None:
        return {}
    found: dict[str, int] = {}
    for category in ("graph_break", "unimplemented"):
        for reason, count in dynamo_counters.get(category, {}).items():
            found[reason] = found.get(reason, 0) + count
    return found


_dynamo_at_reset: dict[str, int] = {}


def reset() -> None:
    """Forget every counter and decision (Dynamo's graph breaks counted until now included)."""
    with _LOCK:
        counters.clear()
        _decisions.clear()
        _recorded_once.clear()
    _dynamo_at_reset.clear()
    _dynamo_at_reset.update(_dynamo_totals())
