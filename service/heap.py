"""Hand freed heap memory back to the OS after a weight push.

A push replaces each linear layer's packed weight with a new buffer, laid out on worker threads; glibc keeps what
those threads freed in their arenas, so a server's RSS grows by about a model's worth on its first pushes and
never shrinks. `malloc_trim` returns those free pages. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: libc is among them
    except OSError:
        return None


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS (glibc `malloc_trim(0)`); True where that was done."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
