"""Timing for the one-off kernel choices of `packed.py` and `attention.py`."""

from __future__ import annotations

import time
from collections.abc import Callable

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
