"""Keep torch work on threads other than the engine's to one CPU thread each.

Every thread that runs a parallel torch op gets an OpenMP team of its own. Once GNU OpenMP manages more threads
than there are CPUs, idle team members sleep between parallel regions, and each of the engine's many small
parallel ops waits for its team to wake: the engine slows down by about 2x. So work off the engine thread (staging
pushed weights, the drafter trainer) calls `one_cpu_thread()` first.

`torch.set_num_threads` changes the count on other threads too, so this sets the calling thread's own counts in the
OpenMP runtime and the MKL that torch loaded. Where neither is found it logs once and changes nothing.

A push's own threads also run behind the engine's (`behind_generation`): where both want the CPUs, tokens first.
"""

from __future__ import annotations

import ctypes
import logging
import os
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


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container's cpuset narrows)."""
    return len(os.sched_getaffinity(0))


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


BEHIND_NICE = 4  # how far behind the engine's threads a push's own threads run (a nice value, added)


def behind_generation() -> bool:
    """Run the calling thread behind the engine's: its nice value raised by `BEHIND_NICE`, so decoding takes the
    CPUs first and this thread the rest. For threads of their own only (a push's staging and layout threads):
    an unprivileged thread cannot lower its nice value again, so a shared pool's thread would stay slow. True
    when it took effect."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BEHIND_NICE))
    except (OSError, AttributeError):  # not Linux, or refused
        return False
    return True
