"""Partitioners: split a joint graph into forward and backward graphs."""

from aotkit.partition.default import default_partition
from aotkit.partition.draw import draw_graph
from aotkit.partition.min_cut import min_cut_rematerialization_partition
from aotkit.partition.report import PartitionReport

__all__ = [
    "PartitionReport",
    "default_partition",
    "draw_graph",
    "min_cut_rematerialization_partition",
]
