"""Keep torch work on threads other than the engine's to one CPU thread each.

Every thread that runs a parallel torch op gets an OpenMP team of its own (torch gives each new thread the
process's thread count), and the team lives as long as the thread. GNU OpenMP, once it manages more threads
than there are CPUs, stops letting idle team members spin between parallel regions: they sleep, and each of
the engine's hundreds of small parallel ops per step waits for its team to wake. Measured on a 2-core machine:
one dtype-converting copy on another thread left a small linear + SiLU 2.2-2.5x slower on the first; a
float32 server that loaded a bf16 folder (converted where it is staged, on a pooled thread) decoded 32
sequences in 1.41-1.47 s instead of 0.84-0.94 s from then on; the in-process drafter trainer's thread halved
the engine's tokens/s in every batch bucket of bench/e2e.py's GRPO run, training or not. So work off the
engine thread (staging pushed weights, the drafter trainer) calls `one_cpu_thread()` first: its ops run on
the calling thread alone, and the process keeps the engine's team only.

torch.set_num_threads cannot do it: called on one thread, it changed the count on the others too. This sets
the calling thread's own counts in the OpenMP runtime and the MKL that torch loaded (found in
/proc/self/maps), after torch's per-thread set-up, which would overwrite them. Where neither can be found
(another platform or build) it logs once and changes nothing.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_OPENMP = re.compile(r"/lib(gomp|iomp5|omp)[-.][^/]*$")
_MKL = re.compile(r"/lib(torch_cpu|mkl_rt)[-.][^/]*$")
_done = threading.local()


def _loaded(pattern: re.Pattern[str]) -> list[str]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = {parts[5] for parts in (line.split(maxsplit=5) for line in maps.splitlines()) if len(parts) == 6}
    return sorted(p for p in paths if pattern.search(p))


@cache
def _setters() -> tuple[ctypes._CFuncPtr | None, ctypes._CFuncPtr | None]:
    """(omp_set_num_threads, MKL_Set_Num_Threads_Local) of the libraries this process loaded, or None each."""
    found = []
    for pattern, name, returns in ((_OPENMP, "omp_set_num_threads", None),
                                   (_MKL, "MKL_Set_Num_Threads_Local", ctypes.c_int)):
        fn = None
        for path in _loaded(pattern):
            try:
                fn = getattr(ctypes.CDLL(path), name)
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], returns
            break
        found.append(fn)
    if found[0] is None:
        logger.info("no OpenMP runtime found: threads other than the engine's keep torch's thread count")
    return found[0], found[1]


def one_cpu_thread() -> bool:
    """Run the calling thread's torch CPU ops on that thread alone (idempotent). True when it took effect."""
    if getattr(_done, "value", None) is not None:
        return _done.value
    torch.get_num_threads()  # torch's per-thread set-up first: it would reset the counts set below
    omp, mkl = _setters()
    if omp is not None:
        omp(1)
    if mkl is not None:
        mkl(1)
    _done.value = torch.get_num_threads() == 1
    return _done.value
