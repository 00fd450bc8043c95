"""What the trace of a backward notes about the formulas the autograd engine runs in it: the
ops each custom autograd.Function's backward records, with the tangents its incoming gradients
depend on (Note [Custom backwards run on zeros] in aotkit.aot.simplify), and the checks of
PyTorch's formulas a trace cannot answer (Note [Checks of well-defined losses])."""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from aotkit.aot.frames import AOTKIT_DIR, TORCH_DIR
from aotkit.compat import FunctionalTensor


@contextlib.contextmanager
def unmaterialized() -> Iterator[list[Any]]:
    """The custom Functions' contexts ``ctx.set_materialize_grads(False)`` is called on
    meanwhile and not set back to True (the setting cannot be read back)."""
    off: list[Any] = []
    cls = torch.autograd.function.FunctionCtx
    original = cls.set_materialize_grads

    def recorded(ctx: Any, value: bool) -> None:
        off[:] = [c for c in off if c is not ctx]
        if not value:
            off.append(ctx)
        original(ctx, value)

    cls.set_materialize_grads = recorded  # type: ignore[method-assign]
    try:
        yield off
    finally:
        cls.set_materialize_grads = original  # type: ignore[method-assign]


@contextlib.contextmanager
def custom_backwards_reached(outs: list[Any], num_tangents: int, unmaterialized: list[Any],
                             guard: Any) -> Iterator[dict[int, int]]:
    """While the backward is traced: per run of a custom autograd.Function's backward (a
    number, ``guard.custom_backward`` while it runs, whose ops the guard tags with it), a bit
    mask of the tangents whose presence makes it run (Note [Custom backwards run on zeros]),
    and under minus that number ``FORMULA`` for those in ``unmaterialized``, whose backward
    eager gives None for the missing ones. One node may run twice (also inside another's
    ``autograd.grad``), with other incoming gradients each time."""
    reach: dict[int, int] = {}
    mode = get_proxy_mode()
    if mode is None or guard is None:
        yield reach
        return
    graph = mode.tracer.graph
    tangents = list(graph.find_nodes(op="placeholder"))[-num_tangents:] if num_tangents else []
    tangent_bits = {node: 1 << k for k, node in enumerate(tangents)}
    masks: dict[fx.Node, int] = dict(tangent_bits)
    running: list[int | None] = []  # the custom backwards a nested backward interrupted
    runs = itertools.count(1)
    # node id -> the tangents that make its runs in the backward itself run (not those nested
    # in another's autograd.grad, a graph task of its own)
    runs_of: dict[int, int] = {}
    paths = _Paths(outs)

    def reached(node: Any, grads: tuple[Any, ...]) -> None:
        outer = guard.custom_backward
        running.append(outer)
        found = [get_proxy_slot(torch._from_functional_tensor(g.elem), mode.tracer, None)
                 for g in grads if isinstance(g, FunctionalTensor)]
        materialized_outer = outer is not None and -outer not in reach
        if outer is not None and not materialized_outer:  # by what that one's values read
            incoming = [_tangent_mask(p.proxy.node, dict(tangent_bits), reach, outer)
                        for p in found if p is not None]
        else:
            incoming = [_tangent_mask(p.proxy.node, masks, reach) for p in found if p is not None]
        run = next(runs)
        # Inside another custom backward (its autograd.grad): whenever that one runs, on the
        # values it has, zeros for missing gradients (given None instead, it may skip the
        # call: then by the gradients it passes, as any other; with none, whenever a node
        # after it runs). A gradient made from no tangent (Inductor's zeros for a round's) is
        # taken for one eager computes whatever is missing: it always runs then. In the
        # backward itself, eager's engine runs it whenever a node after it runs, also one that
        # sends it None: the structural walk says when (nested runs, another graph task, not
        # counted).
        if materialized_outer:
            reach[run] = reach[outer]
        elif 0 in incoming:
            reach[run] = ALWAYS
        elif outer is None:
            reach[run] = functools.reduce(operator.or_, incoming, paths.reach(node, runs_of))
            runs_of[id(node)] = runs_of.get(id(node), 0) | reach[run]
        else:
            reach[run] = functools.reduce(operator.or_, incoming, 0) if incoming else \
                paths.reach(node, runs_of)
        if any(node is ctx for ctx in unmaterialized):  # eager passes None, not zeros: a
            reach[-run] = FORMULA  # formula where it runs
        guard.custom_backward = run

    def ran(*_: Any) -> None:  # before the engine adds what it returned into the next nodes'
        guard.custom_backward = running.pop() if running else None

    nodes = _custom_nodes(outs)  # held: their ids (runs_of's keys) are not reused meanwhile
    handles = [h for node in nodes for h in (
        node.register_prehook(functools.partial(reached, node)), node.register_hook(ran))]
    try:
        yield reach
    finally:
        guard.custom_backward = None
        for handle in handles:
            handle.remove()


class _Paths:
    """The autograd graph behind the outputs, walked backward from a node: when the engine
    runs it (Note [Custom backwards run on zeros])."""

    def __init__(self, outs: list[Any]) -> None:
        self.outs = outs
        self.parents: dict[int, list[Any]] | None = None  # built when first asked
        self.roots: dict[int, int] = {}  # a node an output comes from -> those outputs' bits
        self.memo: dict[int, int] = {}

    def reach(self, node: Any, ran: dict[int, int]) -> int:
        """The tangents whose presence makes the engine run ``node``: those of the outputs it
        comes from, and those that make the nodes before it run (``ran``: custom backwards'
        as they ran; others', the same way, further up)."""
        parents = self._parents()
        memo = self.memo  # builtin nodes' answers, kept: the nodes before them ran already
        todo = [node]
        while todo:
            last = todo[-1]
            if last is not node and (id(last) in ran or id(last) in memo):
                todo.pop()
                continue
            unknown = [p for p in parents.get(id(last), ())
                       if id(p) not in memo and id(p) not in ran]
            if unknown:
                todo.extend(unknown)
                continue
            mask = functools.reduce(
                operator.or_, (ran[id(p)] if id(p) in ran else memo[id(p)]
                               for p in parents.get(id(last), ())), self.roots.get(id(last), 0))
            if last is node:
                return mask
            memo[id(last)] = mask
            todo.pop()
        raise AssertionError("unreachable")

    def _parents(self) -> dict[int, list[Any]]:
        if self.parents is None:
            self.parents = {}
            for k, out in enumerate(self.outs):
                if isinstance(out, torch.Tensor) and out.grad_fn is not None:
                    self.roots[id(out.grad_fn)] = self.roots.get(id(out.grad_fn), 0) | 1 << k
            for node in _graph(self.outs):
                for child, _ in node.next_functions:
                    if child is not None:
                        self.parents.setdefault(id(child), []).append(node)
        return self.parents


def tag_custom_backward(custom: int, last: fx.Node | None) -> None:
    """Tag the nodes an op of custom backward ``custom`` recorded after ``last``."""
    node = last_traced_node()
    while node is not None and node is not last and node.op != "root":
        node.meta["custom_backward"] = custom
        node = node.prev


def _custom_nodes(outs: list[Any]) -> list[Any]:
    """The custom autograd.Function nodes behind ``outs``."""
    return [node for node in _graph(outs)
            if isinstance(node, torch.autograd.function.BackwardCFunction)]


def _graph(outs: list[Any]) -> list[Any]:
    """The autograd nodes behind ``outs``, each once."""
    seen: set[int] = set()
    todo = [t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    found = []
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


#: The mask of a custom backward that runs whichever tangents are missing.
ALWAYS = -1
#: Marks a custom backward given None for missing gradients (set_materialize_grads(False)).
FORMULA = 0


def _tangent_mask(node: fx.Node, masks: dict[fx.Node, int], reach: dict[int, int],
                  through: int | None = None) -> int:
    """The tangents whose presence makes traced node ``node`` a value eager computes, as a bit
    mask (``masks`` is the memo): those it depends on, or, made by a custom backward (but run
    ``through``, whose values are taken by what they read), those that make that one run (on
    zeros for the rest)."""
    todo = [node]
    while todo:
        last = todo[-1]
        if last in masks:
            todo.pop()
            continue
        if (custom := last.meta.get("custom_backward")) in reach and custom != through:
            masks[last] = reach[custom]
            todo.pop()
            continue
        unknown = [a for a in last.all_input_nodes if a not in masks]
        if unknown:
            todo.extend(unknown)
            continue
        masks[last] = functools.reduce(operator.or_, (masks[a] for a in last.all_input_nodes), 0)
        todo.pop()
    return masks[node]


# Note [Checks of well-defined losses]
# Some of PyTorch's backward formulas check, on the data, that the loss is well defined (complex
# SVD: that it does not depend on the singular vectors' phases) and raise otherwise. A trace has
# no data: the check is taken as passed, as PyTorch's AOT autograd's trace of linalg.eig's does,
# where eager raises for an ill-defined loss (README). Only where the formula itself asks: a
# hook the engine runs for that node (``torch.allclose(g, 0)`` in a tensor hook) is the user's
# Python, called from no frame of the engine's caller, and is refused as before.
ALLCLOSE = torch.ops.aten.allclose.default
_PASSED_THROUGH = tuple(os.path.join(TORCH_DIR, *path.split("/")) for path in (
    "_dynamo/eval_frame.py", "_compile.py", "_ops.py", "utils/_python_dispatch.py"))


def formula_running() -> bool:
    """Whether the autograd engine is running one of PyTorch's backward formulas (C++: the
    nearest Python frame is the engine's caller's)."""
    node = torch._C._current_autograd_node()
    if node is None or isinstance(node, torch.autograd.function.BackwardCFunction):
        return False
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename in _PASSED_THROUGH
                                 or frame.f_code.co_filename.startswith(AOTKIT_DIR)):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "_engine_run_backward"


def last_traced_node() -> fx.Node | None:
    """The node make_fx recorded last in the graph it is tracing, if it traces."""
    mode = get_proxy_mode()
    return next(iter(reversed(mode.tracer.graph.nodes)), None) if mode is not None else None


def note_formula(exc: BaseException) -> None:
    """Name on ``exc`` the backward formula the engine was running when it was raised, if any
    (``IndexPutBackward0``), for the message that says what failed."""
    node = torch._C._current_autograd_node()
    if node is not None and not hasattr(exc, "aotkit_backward_of"):
        exc.aotkit_backward_of = node.name()  # type: ignore[attr-defined]
