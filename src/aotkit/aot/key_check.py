"""Telling a call's key from the last ones without computing it (Note [Keys checked in C++]).

Note [Keys checked in C++]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Every call of a compiled function computes its key (:func:`aotkit.aot.signature.signature`) to
find its graph: per tensor argument its dtype, device, layout, requires_grad and leafness, shape,
strides, conjugate and negative bits and type, each read through Python, about 1.5 us a tensor on
this project's CPU machine. aot_module passes every parameter and buffer as an argument, so a
model of 200 small tensors paid ~0.3 ms a call for its key alone, as much as its forward.

So a key computed twice for calls made of plain tensors (no tensor subclass made of parts, no
other value besides what the function captures) gets a check, :class:`SameKey`, that tells
whether a later call has that very key without computing it: Dynamo's C++ tensor check
(``TensorGuards``: Python type, dispatch keys, which hold the layout and the conjugate and
negative bits, dtype, device, requires_grad, sizes and strides, the sizes and strides only where
the key holds them, and that no tensor object is passed twice), then in Python the leafness of
the tensors requiring grad, the call's modes and the captured values' keys. A call the check accepts has the
key exactly; it is more strict than the key in one way (an inference-mode tensor's dispatch keys
differ), where the call computes its key as before. A key is checked after it was computed twice
(a key computed once per call, such as a step counter among the captured values, never pays for
a check's construction), and the last few checks are kept, most recent first, so that calls
alternating between two keys (training and evaluation) take the check too. Where checks keep
being dropped before they ever hold (more keys recurring than are kept, bucketed batch sizes),
building them costs more than it saves: after a few, the function stops building them, a
``fallback`` decision at DEBUG level, until one key comes ``_SETTLED`` calls in a row (a warm-up
over bucketed lengths, then training at one length), when it starts again. None is built under a
dispatch mode (it would check the mode's dispatch key too).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch._C._dynamo.guards import TensorGuards

from aotkit import counters
from aotkit.aot.signature import call_context, leaf_key, signature

_IS_LEAF = operator.attrgetter("is_leaf")
_KEPT = 4  # checks kept per compiled function, and keys remembered to build them from
_UNUSED_LIMIT = 8  # checks dropped without holding once, after which no more are built...
_SETTLED = 64  # ...until one key comes this many calls in a row
log = logging.getLogger("aotkit.aot")


class SameKey:
    """Whether a call made of ``count`` plain tensors (and values after them) has ``key``."""

    __slots__ = ("context", "count", "extras", "grad_positions", "guards", "hash", "hits", "key",
                 "leafs")

    def __init__(self, key: tuple[Any, ...], key_hash: int, tensors: Sequence[torch.Tensor],
                 dynamic_at: Sequence[bool]) -> None:
        self.key, self.hash, self.hits = key, key_hash, 0
        self.count, self.context = len(tensors), key[3:]
        self.extras = key[1][self.count:]
        # Last first: aot_module's arguments follow its parameters, and a call of another
        # key differs in them mostly.
        self.guards = TensorGuards(
            *tensors[::-1],
            dynamic_dims_sizes=[[None] * t.dim() if d else list(t.shape)
                                for t, d in zip(tensors[::-1], dynamic_at[::-1], strict=True)],
            dynamic_dims_strides=[[None] * t.dim() if d else list(t.stride())
                                  for t, d in zip(tensors[::-1], dynamic_at[::-1], strict=True)])
        positions = [i for i, t in enumerate(tensors) if t.requires_grad]
        self.grad_positions = operator.itemgetter(*positions) if positions else None
        self.leafs = _leafness(self.grad_positions, tensors)

    def holds(self, leaves: Sequence[Any], context: tuple[Any, ...], dynamic: bool) -> bool:
        n = self.count
        if len(leaves) != n + len(self.extras) or context != self.context:
            return False
        tensors = leaves[:n] if self.extras else leaves
        return (self.guards.check(*tensors[::-1])
                and _leafness(self.grad_positions, tensors) == self.leafs
                and (not self.extras
                     or tuple(leaf_key(x, dynamic) for x in leaves[n:]) == self.extras))


def _leafness(positions: operator.itemgetter[Any] | None, tensors: Sequence[torch.Tensor]) -> Any:
    if positions is None:
        return ()
    picked = positions(tensors)
    return tuple(map(_IS_LEAF, picked)) if isinstance(picked, tuple) else picked.is_leaf


class RecentKeys:
    """A compiled function's keys, checked in C++ where a recent one holds (Note [Keys
    checked in C++])."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._checks: list[SameKey] = []
        self._computed: list[int] = []  # the hashes of the last keys computed, latest last
        self._static: Collection[int] = ()  # the checks' static positions under dynamic
        self._unused = 0  # checks dropped without ever holding; at _UNUSED_LIMIT, no more
        self._last_hash, self._streak = 0, 0  # then: the last key, and how many calls in a row

    def key(self, structure: Any, leaves: Sequence[Any], dynamic: bool,
            config_parts: tuple[str, ...], static: Collection[int]) -> tuple[Any, ...]:
        """``signature(structure, leaves, dynamic, config_parts, static)``."""
        context = call_context(config_parts)
        plain = type(structure) is int  # a call made of positional tensors only
        if static is not self._static and static != self._static:  # aot_module made a
            # buffer's size dynamic: its keys differ from now on
            self._checks, self._computed, self._static = [], [], static
        if plain:
            for i, check in enumerate(self._checks):
                if check.holds(leaves, context, dynamic):
                    check.hits += 1
                    if i:
                        self._checks.insert(0, self._checks.pop(i))
                    return check.key
        key = signature(structure, leaves, dynamic, config_parts, static, context=context)
        if plain:
            self._remember(key, leaves[:structure], dynamic, static)
        return key

    def _remember(self, key: tuple[Any, ...], tensors: Sequence[Any], dynamic: bool,
                  static: Collection[int]) -> None:
        # First: comparing a key of a trace's symbolic sizes would guard them (``s0 == 3``).
        if key[2]:
            return
        try:
            key_hash = hash(key)
        except TypeError:  # a fake tensor's symbolic size (it is not checkable either)
            return
        if self._unused >= _UNUSED_LIMIT and not self._settled(key_hash):
            return
        if not all(_checkable(t) for t in tensors) or torch._C._len_torch_dispatch_stack():
            return  # under a mode, its dispatch key would be checked too
        if key_hash not in self._computed:
            self._computed = [*self._computed[1 - _KEPT:], key_hash]
            return
        # A check of this key that did not hold (an inference tensor's dispatch keys) is
        # replaced, and counts as unused.
        kept = [c for c in self._checks if c.hash != key_hash or c.key != key]
        replaced = len(self._checks) - len(kept)
        dynamic_at = [dynamic and i not in static for i in range(len(tensors))]
        self._checks = [SameKey(key, key_hash, tensors, dynamic_at), *kept[: _KEPT - 1]]
        self._unused += replaced + sum(not c.hits for c in kept[_KEPT - 1:])
        if self._unused >= _UNUSED_LIMIT:
            counters.record("fallback", self.name, (
                f"{_UNUSED_LIMIT} key checks were dropped unused (more than {_KEPT} keys "
                "recur, or a key's tensors change dispatch keys): its calls compute their "
                f"keys in Python until one key comes {_SETTLED} calls in a row (Note [Keys "
                "checked in C++])"), logger=log,
                level=logging.DEBUG)

    def _settled(self, key_hash: int) -> bool:
        """With checks given up: whether this key came ``_SETTLED`` calls in a row; if so,
        checks are built again."""
        self._streak = self._streak + 1 if key_hash == self._last_hash else 1
        self._last_hash = key_hash
        if self._streak < _SETTLED:
            return False
        self._unused = self._streak = 0
        log.debug("%s: one key for %d calls in a row: key checks are built again", self.name,
                  _SETTLED)
        return True


_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


def _checkable(t: Any) -> bool:
    """A plain strided tensor: no subclass (a trace's fake or functional tensors are)."""
    return type(t) in _PLAIN and t.layout is torch.strided and not t.is_nested
