"""Tracing: fake inputs, the joint and inference functions, and ``make_fx`` under functionalization.

The joint function takes ``(primals, tangents)`` and returns ``forward outputs + one grad per
primal``; forward outputs are, in order, the new values of mutated inputs, the user's graph
outputs, and the intermediate bases of aliased outputs (see Note [Aliased outputs]).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from aotkit import config
from aotkit.aot.analysis import Alias, AotMeta, from_fun, to_fun
from aotkit.compat import (
    FakeTensorMode,
    FunctionalTensorMode,
    compiled_autograd_off,
    data_dependent_errors,
    effect_tokens,
    effect_types,
)
from aotkit.errors import TraceError
from aotkit.partition.graph import is_impure

log = logging.getLogger("aotkit.aot")

FlatFn = Callable[..., tuple[list[Any], pytree.TreeSpec]]


def make_fake(mode: FakeTensorMode, t: torch.Tensor, index: int, dynamic: bool) -> torch.Tensor:
    """A fake copy of ``t`` (same leafness and requires_grad); symbolic sizes when ``dynamic``."""
    if not dynamic:  # no symbols to name, and torch._dynamo.source would load all of Dynamo
        return mode.from_tensor(t, static_shapes=True)
    from torch._dynamo.source import LocalSource

    return mode.from_tensor(t, static_shapes=False, source=LocalSource(f"arg{index}"))


@contextlib.contextmanager
def tracing(mode: FakeTensorMode, what: str) -> Iterator[None]:
    """Enter the fake mode and turn tracing failures into errors that say what to change."""
    # The Python dispatcher is what lets composite ops decompose with symbolic sizes; with static
    # shapes we leave it off so composites run their C++ kernels like eager, aliasing included
    # (its Python decomposition of eval-mode dropout copies where eager returns the input).
    dispatcher = enable_python_dispatcher() if mode.shape_env is not None else _EagerDropout()
    try:
        with mode, dispatcher, compiled_autograd_off():
            yield
    except data_dependent_errors() as exc:
        raise _data_dependent(what, exc) from exc
    except RuntimeError as exc:
        # A kernel without a fake implementation read the (absent) data of a fake tensor.
        if "data is not allocated yet" not in str(exc):
            raise
        raise _data_dependent(what, exc) from exc


class _EagerDropout(torch.overrides.TorchFunctionMode):
    """Training-mode dropout traced as ``aten.native_dropout``, the kernel eager runs.

    Without the Python dispatcher ``aten.dropout`` traces through its C++ composite, which draws
    the mask with a functional ``bernoulli`` laid out like the input: for a non-contiguous input
    (a transposed attention output) the same random numbers land on other elements than in
    eager. Eval mode and p in {0, 1} keep the composite (eager returns the input itself).
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout or func is torch.dropout:
            call = _DROPOUT_SIGNATURES[func].bind(*args, **kwargs).arguments
            p, train = call["p"], call.get("training", call.get("train"))
            if train and not call.get("inplace") and 0 < p < 1:
                return torch.ops.aten.native_dropout.default(call["input"], p, True)[0]
        return func(*args, **kwargs)


def _dropout_signatures() -> dict[Any, inspect.Signature]:
    def vf_dropout(input: Any, p: float, train: bool) -> Any: ...

    return {torch.nn.functional.dropout: inspect.signature(torch.nn.functional.dropout),
            torch.dropout: inspect.signature(vf_dropout)}


_DROPOUT_SIGNATURES = _dropout_signatures()


def _data_dependent(what: str, exc: BaseException) -> TraceError:
    return TraceError(
        f"{what} could not be traced: Python control flow or a Python value depends on "
        f"tensor data ({type(exc).__name__}: {_first_line(exc)}).\n"
        f"  at {_user_frame(exc)}\n"
        "Fix: express the branch with tensor ops (torch.where, torch.cond) or move the "
        "data-dependent part out of the compiled function; torch.compile splits the graph "
        "there for you."
    )


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


_AOTKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _user_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(_AOTKIT_DIR)]
    user = [f for f in frames if not os.path.abspath(f.filename).startswith(_TORCH_DIR)]
    # The data dependence may sit in a library check (torch.nn.functional): show that line too.
    library = [f for f in frames if os.path.abspath(f.filename).startswith(
        (_TORCH_DIR + "nn" + os.sep, _TORCH_DIR + "functional.py"))]
    shown = []
    if library and (not user or frames.index(library[-1]) > frames.index(user[-1])):
        shown.append(library[-1])
    shown += user[-1:]
    if not shown:
        return "<unknown location>"
    return "\n  called from ".join(f"{f.filename}:{f.lineno} in {f.name}: {f.line}" for f in shown)


def trace_joint(
    flat_fn: FlatFn,
    primals: Sequence[Any],
    meta: AotMeta,
    fw_out_fakes: Sequence[Any],
    decompositions: Mapping[Any, Callable[..., Any]] | None,
) -> fx.GraphModule:
    """Trace ``(primals, tangents) -> (forward outputs, grads)`` to one ATen graph.

    ``fw_out_fakes`` (from :func:`aotkit.aot.analysis.analyze`) give the tangents their shapes.
    """
    tangents = [_tangent_like(o) for o in fw_out_fakes]
    differentiable = meta.fw_output_differentiable()
    tangents = [t for t, d in zip(tangents, differentiable, strict=True) if d]

    # Decided before the call: ``x.add_(w)`` makes x require grad, yet x gets no grad.
    wrt = [i for i, p in enumerate(primals) if isinstance(p, torch.Tensor) and p.requires_grad]

    def joint(primals: list[Any], tangents: list[Any]) -> list[Any]:
        with functionalized():
            f_primals = [to_fun(p) for p in primals]
            f_tangents = [to_fun(t) for t in tangents]
            fw_outs = _forward_outputs(flat_fn, f_primals, meta, clone_mutated=True)
            grads = _grads(fw_outs, differentiable, f_primals, wrt, f_tangents)
        return [from_fun(x) for x in [*fw_outs, *grads]]

    return _make_fx(joint, [list(primals), tangents], decompositions)


def trace_inference(
    flat_fn: FlatFn,
    args: Sequence[Any],
    meta: AotMeta,
    decompositions: Mapping[Any, Callable[..., Any]] | None,
    keep_input_mutations: bool,
) -> fx.GraphModule:
    """Trace the forward alone. With ``keep_input_mutations`` data mutations stay in the graph
    as ``copy_`` into the inputs instead of being returned."""

    def inference(primals: list[Any]) -> list[Any]:
        with functionalized():
            f_primals = [to_fun(p) for p in primals]
            fw_outs = _forward_outputs(flat_fn, f_primals, meta, clone_mutated=False)
        outs = [from_fun(x) for x in fw_outs]
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


def _forward_outputs(flat_fn: FlatFn, f_primals: list[Any], meta: AotMeta, *, clone_mutated: bool) -> list[Any]:
    # A mutated input that requires grad is cloned first, so grads are taken w.r.t. the value
    # before the mutation (the input the caller passed) rather than the mutated one.
    call_args = [
        p.clone() if clone_mutated and info.mutated and info.requires_grad else p
        for p, info in zip(f_primals, meta.inputs, strict=True)
    ]
    with torch.enable_grad() if clone_mutated else contextlib.nullcontext():
        outs, _ = flat_fn(*call_args)
    mutated = [call_args[i] for i in meta.mutated_inputs]
    user = [outs[i] for i in meta.graph_user_outputs()]
    bases = [o._base for o in _intermediate_base_owners(outs, meta)]
    return [*mutated, *user, *bases]


def _intermediate_base_owners(outs: list[Any], meta: AotMeta) -> list[torch.Tensor]:
    """For each intermediate base, the first user output viewing it (its ``_base`` is the base)."""
    owners: dict[int, torch.Tensor] = {}
    for out, info in zip(outs, meta.outputs, strict=True):
        if info.alias is Alias.OF_INTERMEDIATE and info.base not in owners:
            owners[info.base] = out  # type: ignore[index]
    return [owners[i] for i in range(len(meta.intermediate_bases_requires_grad))]


def _grads(fw_outs: list[Any], differentiable: list[bool], f_primals: list[Any], wrt: list[int],
           f_tangents: list[Any]) -> list[Any]:
    outs = [o for o, d in zip(fw_outs, differentiable, strict=True) if d]
    grads: list[Any] = [None] * len(f_primals)
    if wrt and outs:
        found = torch.autograd.grad(
            outs, [f_primals[i] for i in wrt], f_tangents, allow_unused=True
        )
        for i, g in zip(wrt, found, strict=True):
            grads[i] = g
    return grads


def _copy_mutations_in_graph(primals: list[Any], outs: list[Any], meta: AotMeta) -> list[Any]:
    kept = []
    for k, i in enumerate(meta.mutated_inputs):
        info = meta.inputs[i]
        if info.mutates_data and not info.mutates_metadata:
            primals[i].copy_(outs[k])
        else:
            kept.append(outs[k])
    return kept + outs[len(meta.mutated_inputs):]


def _tangent_like(out: Any) -> Any:
    if not isinstance(out, torch.Tensor):
        return None
    return torch.empty(out.shape, dtype=out.dtype, device=out.device)


def _make_fx(fn: Callable[..., Any], args: list[Any], decompositions: Mapping[Any, Any] | None) -> fx.GraphModule:
    gm = make_fx(fn, decomposition_table=dict(decompositions or {}), tracing_mode="real",
                 record_stack_traces=config.record_stack_traces)(*args)
    # Flat placeholders and a plain list output: every graph is ``forward(primals_1, ...)``.
    gm.graph._codegen = fx.graph.CodeGen()
    _drop_unused_tokens(gm.graph)
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)
    gm.recompile()
    if config.debug_graphs:
        gm.graph.lint()
    return gm
