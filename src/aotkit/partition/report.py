"""What a partition did: saved tensors and bytes, saved symints, recomputed ops."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from aotkit.compat import size_hint
from aotkit.partition.graph import is_sym


@dataclass(frozen=True)
class PartitionReport:
    """Attached to the forward graph as ``fw_gm.meta["partition"]`` by every aotkit partitioner.

    ``saved_bytes`` counts each saved tensor's storage-independent size (numel x element size,
    symbolic sizes resolved through their hints); ``recomputed`` names the ATen ops the backward
    runs again instead of loading them from the forward.
    """

    partitioner: str
    saved_tensors: int
    saved_bytes: int
    saved_symints: int
    recomputed: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = (f"{self.partitioner}: saved {self.saved_tensors} tensor(s), "
                f"{self.saved_bytes} bytes, {self.saved_symints} symint(s)")
        if self.recomputed:
            text += f"; recomputed {len(self.recomputed)} op(s): {', '.join(self.recomputed)}"
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


def report(partitioner: str, saved: Iterable[fx.Node], recomputed: Iterable[fx.Node] = ()) -> PartitionReport:
    saved = list(saved)
    tensors = [n for n in saved if not is_sym(n)]
    return PartitionReport(
        partitioner=partitioner,
        saved_tensors=len(tensors),
        saved_bytes=sum(nbytes(n) for n in tensors),
        saved_symints=len(saved) - len(tensors),
        recomputed=tuple(str(n.target) for n in recomputed),
    )
