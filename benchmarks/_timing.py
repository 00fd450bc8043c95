"""Timing shared by the benchmark scripts: a variant against eager, interleaved in one run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def clock(device: str) -> Callable[[], float]:
    """``time.perf_counter`` that first waits for ``device``'s queued kernels, so a CUDA step
    is charged for its kernels and not only for launching them."""
    if torch.device(device).type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def describe_device(device: str) -> str:
    """``device`` for a report's first line; a GPU by its name."""
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (timed to the end of its kernels)"
    return device


def paired_medians(run: Callable[[], float], eager: Callable[[], float], warmup: int,
                   steps: int) -> tuple[float, float]:
    """Median seconds of ``run`` and of ``eager`` (each returns the seconds it took), taken in
    alternating order so neither side always runs on the warmer cache or the quieter moment."""
    for _ in range(warmup):
        run()
        eager()
    times, eager_times = [], []
    for i in range(steps):
        if i % 2:
            eager_times.append(eager())
            times.append(run())
        else:
            times.append(run())
            eager_times.append(eager())
    return statistics.median(times), statistics.median(eager_times)
