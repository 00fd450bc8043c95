"""Running compiled graphs: an ``autograd.Function`` around forward/backward, then an epilogue
that writes input mutations back and regenerates aliased outputs (Note [Aliased outputs])."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from aotkit import counters
from aotkit.aot.analysis import Alias, AotMeta, InputInfo, OutputInfo
from aotkit.aot.boxing import Compiler, compile_boxed
from aotkit.errors import ArgumentError, CompilerError, UnsupportedError

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
    bw_gm: fx.GraphModule | None = None
    bw_compiler: Compiler | None = None
    num_saved_tensors: int = 0
    differentiable: list[bool] = field(default_factory=list)
    _bw: Callable[[list[Any]], Any] | None = None
    _bw_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.num_fw_outputs = len(self.returned_mutations) + len(self.meta.graph_user_outputs()) + len(
            self.meta.intermediate_bases_requires_grad
        )
        self.data_mutated = [i for i in self.returned_mutations if self.meta.inputs[i].mutates_data]
        self.non_differentiable = [i for i, d in enumerate(self.differentiable) if not d]

    def backward_fn(self) -> Callable[[list[Any]], Any]:
        """The compiled backward, compiled on first use (the forward may never be differentiated)."""
        if self._bw is None:
            with self._bw_lock:
                if self._bw is None:
                    assert self.bw_gm is not None and self.bw_compiler is not None
                    inputs = [n.meta.get("val") for n in self.bw_gm.graph.find_nodes(op="placeholder")]
                    self._bw = compile_boxed(self.bw_compiler, self.bw_gm, inputs, "backward")
                    counters.bump("aot", "bw_compiles")
                    log.debug("compiled backward of %s", self.name)
        return self._bw


class CompiledFunction(torch.autograd.Function):
    """Runs the compiled forward; its backward runs the (lazily) compiled backward graph."""

    @staticmethod
    def forward(ctx: Any, graphs: CompiledGraphs, *args: Any) -> tuple[Any, ...]:  # type: ignore[override]
        outs = graphs.fw(list(args))
        n = graphs.num_fw_outputs
        saved = outs[n : n + graphs.num_saved_tensors]
        if graphs.data_mutated:
            saved = _unshare_with_mutated_inputs(saved, args, graphs.data_mutated)
        ctx.save_for_backward(*saved)
        ctx.saved_syms = outs[n + graphs.num_saved_tensors :]
        ctx.graphs = graphs
        fw_outs = outs[:n]
        ctx.mark_non_differentiable(
            *(fw_outs[i] for i in graphs.non_differentiable if isinstance(fw_outs[i], torch.Tensor))
        )
        return tuple(fw_outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:  # type: ignore[override]
        graphs: CompiledGraphs = ctx.graphs
        tangents = [
            g.contiguous() for g, d in zip(grads, graphs.differentiable, strict=True) if d
        ]
        args = [*ctx.saved_syms, *ctx.saved_tensors, *tangents]
        backward = graphs.backward_fn()
        if torch.is_grad_enabled():  # create_graph=True: we cannot differentiate our backward
            with torch.no_grad():
                input_grads = backward(args)
            return (None, *_refuse_double_backward(graphs.name, input_grads))
        return (None, *backward(args))


class _DoubleBackwardGuard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.name = name
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx: Any, *unused: Any) -> Any:  # type: ignore[override]
        raise UnsupportedError(
            f"double backward through {ctx.name} is not supported: aotkit's compiled backward "
            "is not itself differentiable.\nFix: compute higher-order gradients on the eager "
            "function (or with torch.func), or run the first backward without create_graph=True."
        )


def _refuse_double_backward(name: str, grads: Sequence[Any]) -> list[Any]:
    tensors = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    if not tensors:
        return list(grads)
    guarded = _DoubleBackwardGuard.apply(name, *(grads[i] for i in tensors))
    out = list(grads)
    for i, g in zip(tensors, guarded, strict=True):
        out[i] = g
    return out


def _unshare_with_mutated_inputs(saved: Sequence[Any], args: Sequence[Any], mutated: list[int]) -> list[Any]:
    """Saved tensors that alias an input the epilogue is about to overwrite are cloned first."""
    storages = {args[i].untyped_storage().data_ptr() for i in mutated}
    return [
        s.clone() if isinstance(s, torch.Tensor) and s.untyped_storage().data_ptr() in storages else s
        for s in saved
    ]


def run(graphs: CompiledGraphs, args: list[Any]) -> list[Any]:
    """Run one compiled signature on flat inputs; returns the flat user outputs."""
    if len(args) != graphs.num_inputs:
        raise ArgumentError(f"{graphs.name} expects {graphs.num_inputs} inputs, got {len(args)}.")
    if graphs.returned_mutations:
        check_no_aliased_mutation(graphs.name, graphs.meta, args)
    if graphs.training:
        fw_outs = CompiledFunction.apply(graphs, *args)
    else:
        with torch.no_grad():
            fw_outs = graphs.fw(list(args))
    return epilogue(graphs, args, fw_outs)


def epilogue(graphs: CompiledGraphs, args: Sequence[Any], fw_outs: Sequence[Any]) -> list[Any]:
    meta = graphs.meta
    for k, i in enumerate(graphs.returned_mutations):
        apply_mutation(args[i], fw_outs[k], meta.inputs[i])
    start = len(graphs.returned_mutations)
    graph_outs = fw_outs[start : start + len(meta.graph_user_outputs())]
    bases = fw_outs[start + len(graph_outs) :]
    position = {flat: pos for pos, flat in enumerate(meta.graph_user_outputs())}
    results = []
    for flat, info in enumerate(meta.outputs):
        if info.alias is Alias.CONSTANT:
            results.append(info.constant)
            continue
        out = graph_outs[position[flat]]
        if info.alias is Alias.NONE:
            results.append(out)
        elif info.alias is Alias.IS_INPUT:
            results.append(args[info.base])
        elif info.alias is Alias.OF_INPUT:
            results.append(regenerate_view(args[info.base], out, info, graphs.name))
        elif info.alias is Alias.OF_OUTPUT:
            results.append(regenerate_view(graph_outs[position[info.base]], out, info, graphs.name))
        else:
            results.append(regenerate_view(bases[info.base], out, info, graphs.name))
    return results


def apply_mutation(inp: torch.Tensor, new: torch.Tensor, info: InputInfo) -> None:
    """Make the caller's tensor show what the function did to it."""
    if info.mutates_metadata:
        offset = new.storage_offset() if _same_storage(inp, new) else inp.storage_offset()
        with torch.no_grad():
            inp.as_strided_(new.size(), new.stride(), offset)
    if info.mutates_data:
        if info.mutation_is_differentiable and torch.is_grad_enabled():
            inp.copy_(new)
        else:
            with torch.no_grad():
                inp.copy_(new)


def regenerate_view(base: torch.Tensor, out: torch.Tensor, info: OutputInfo, name: str) -> torch.Tensor:
    if _same_storage(base, out):
        return base.as_strided(out.size(), out.stride(), out.storage_offset())
    if info.static_view is not None:
        return base.as_strided(*info.static_view)
    raise CompilerError(
        f"{name}: an output that views another tensor came back from the compiled graph as a "
        "copy with symbolic sizes, so it cannot be made a view again.\nFix: use a compiler that "
        "preserves views of graph inputs (e.g. aotkit.compilers.nop), or clone the output "
        "in the function."
    )


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def check_no_aliased_mutation(name: str, meta: AotMeta, args: Sequence[Any]) -> None:
    """Refuse inputs that share memory when one of them is mutated (results would differ)."""
    seen: dict[int, int] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            ptr = a.untyped_storage().data_ptr()
            j = seen.setdefault(ptr, i)
            if j != i and ptr != 0 and (meta.inputs[i].mutated or meta.inputs[j].mutated):
                raise UnsupportedError(
                    f"{name}: inputs {j} and {i} share memory and one of them is mutated in "
                    "place; aotkit cannot yet replay such mutations exactly.\nFix: pass "
                    "separate tensors (e.g. .clone() one of them)."
                )
