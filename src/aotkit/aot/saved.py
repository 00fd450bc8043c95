"""What a partitioned forward saves for its backward, as the runtime needs to know it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from aotkit.partition.graph import is_sym, view_root


@dataclass(frozen=True)
class Saved:
    """The tensors a forward graph saves (its outputs after the forward ones, before the
    SymInts), and the inputs among them the backward writes or reads."""

    tensors: int
    # Which saved tensors are inputs the backward writes (Note [Inputs the backward writes]),
    # by position among the saved, and by input position.
    written: tuple[int, ...]
    inputs_written: tuple[int, ...]
    # The inputs saved whole or as views: the backward reads them (Note [Overlapping mutated
    # inputs]).
    inputs_read: tuple[int, ...]


NOTHING_SAVED = Saved(0, (), (), ())


def saved_for_backward(fw_gm: fx.GraphModule, num_fw_outputs: int) -> Saved:
    """What ``fw_gm``, a partitioned forward with ``num_fw_outputs`` outputs of its own, saves.

    Example::

        >>> import torch, aotkit
        >>> graphs = []
        >>> def keep(gm, example_inputs):
        ...     graphs.append(gm)
        ...     return aotkit.compilers.nop(gm, example_inputs)
        >>> _ = aotkit.aot_function(torch.sin, keep)(torch.ones(2, requires_grad=True))
        >>> saved_for_backward(graphs[0], num_fw_outputs=1)
        Saved(tensors=1, written=(), inputs_written=(), inputs_read=(0,))
    """
    placeholders = fw_gm.graph.find_nodes(op="placeholder")
    position = {p: i for i, p in enumerate(placeholders)}
    saved = list(fw_gm.graph.output_node().args[0])[num_fw_outputs:]
    # As the partitioners split them: SymInts last, tensors before (a sparse constant's node
    # has no "val"; counted among the SymInts, it shifted every saved tensor in the backward).
    tensors = [n for n in saved if not is_sym(n)]
    return Saved(
        tensors=len(tensors),
        written=tuple(k for k, n in enumerate(tensors) if _written(n)),
        inputs_written=tuple(i for i, p in enumerate(placeholders) if _written(p)),
        inputs_read=tuple(sorted({position[root] for n in tensors
                                  if (root := view_root(n)) in position})),
    )


def _written(node: fx.Node) -> bool:
    return node.meta.get("written_by_backward", False)
