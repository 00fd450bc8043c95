"""Partitioners: split a joint graph into forward and backward graphs."""

from aotkit.partition.default import default_partition

__all__ = ["default_partition"]
