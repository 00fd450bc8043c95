"""What a partition did: saved tensors and bytes, saved symints, recomputed ops."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from aotkit.compat import size_hint
from aotkit.partition.graph import free_to_save, is_sym, view_root


@dataclass(frozen=True)
class PartitionReport:
    """Attached to the forward graph as ``fw_gm.meta["partition"]`` by every aotkit partitioner.

    ``saved_bytes`` is the activation memory the partition adds: the sizes (numel x element size,
    symbolic sizes through their hints; a size read from data, such as nonzero's count, at
    4096) of the values whose memory the saved tensors keep alive,
    each once (a saved view counts as the whole value it views). Inputs (counted in
    ``saved_inputs``) and views of them are free to save: the caller holds them. Inputs the
    function mutates are not, since the runtime saves a copy (Note [Saving inputs the function
    mutates]).
    ``recomputed`` names the ops the backward runs again instead of loading them.
    """

    partitioner: str
    saved_tensors: int
    saved_bytes: int
    saved_symints: int
    saved_inputs: int = 0
    recomputed: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = (f"{self.partitioner}: saved {self.saved_tensors} tensor(s) "
                f"({self.saved_inputs} of them inputs), {self.saved_bytes} activation bytes, "
                f"{self.saved_symints} symint(s)")
        if self.recomputed:
            counts = collections.Counter(self.recomputed)
            ops = ", ".join(op if n == 1 else f"{op} x{n}" for op, n in counts.items())
            text += f"; recomputed {len(self.recomputed)} op(s): {ops}"
        return text


def nbytes(node: fx.Node) -> int:
    """Bytes of the tensor (or tensors, for a tuple) ``node`` produces; 0 for non-tensors."""
    val = node.meta.get("val")
    values = val if isinstance(val, (list, tuple)) else [val]
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            numel = 1
            for s in v.shape:
                numel *= size_hint(s)
            total += numel * v.element_size()
    return total


def held_bytes(saved: Iterable[fx.Node]) -> int:
    """Bytes the saved tensors keep alive: each storage once, at the size of the value that owns
    it (a saved ``y[:, :32]`` keeps all of ``y``), nothing for the caller's inputs and their
    views (a saved ``weight.t()``)."""
    roots = {view_root(n) for n in saved if not is_sym(n)}
    return sum(nbytes(r) for r in roots if not free_to_save(r))


def report(partitioner: str, saved: Iterable[fx.Node], recomputed: Iterable[fx.Node] = ()) -> PartitionReport:
    """Describe a partition from the nodes it saves and the nodes its backward recomputes."""
    saved = list(saved)
    tensors = [n for n in saved if not is_sym(n)]
    inputs = [n for n in tensors if free_to_save(n)]
    return PartitionReport(
        partitioner=partitioner,
        saved_tensors=len(tensors),
        saved_bytes=held_bytes(tensors),
        saved_symints=len(saved) - len(tensors),
        saved_inputs=len(inputs),
        recomputed=tuple(_op_name(n) for n in recomputed),
    )


def _op_name(node: fx.Node) -> str:
    target = node.target
    return target.__name__ if callable(target) and not hasattr(target, "_schema") else str(target)
