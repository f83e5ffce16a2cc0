"""Hand freed heap memory back to the OS after a weight push.

A push replaces each linear layer's packed weight with a new buffer, laid out on worker threads; glibc keeps what
those threads freed in their arenas, so a server's RSS grows by about a model's worth on its first pushes and
never shrinks. `malloc_trim` returns those free pages. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

logger = logging.getLogger(__name__)


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS (glibc `malloc_trim(0)`); True where that was done."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
