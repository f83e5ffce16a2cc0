"""Timing for the one-off kernel choices of `packed.py` and `attention.py`."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

Timer = Callable[[Callable[[], object]], float]


def median_seconds(fn: Callable[[], object], reps: int = 3) -> float:
    """Median wall seconds of `reps` calls of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@functools.cache
def cpu_flags() -> str:
    """This CPU's feature flags line from /proc/cpuinfo ("" where there is none): what a timing or a
    -march=native build depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")
