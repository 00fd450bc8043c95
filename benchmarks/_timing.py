"""Timing shared by the benchmark scripts: a variant against eager, interleaved in one run."""

from __future__ import annotations

import statistics
from collections.abc import Callable


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
