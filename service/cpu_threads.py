"""Keep torch work on threads other than the engine's to one CPU thread each.

Every thread that runs a parallel torch op gets an OpenMP team of its own. Once GNU OpenMP manages more threads
than there are CPUs, idle team members sleep between parallel regions, and each of the engine's many small
parallel ops waits for its team to wake: the engine slows down by about 2x. So work off the engine thread (staging
pushed weights, the drafter trainer) calls `one_cpu_thread()` first.

`torch.set_num_threads` changes the count on other threads too, so this sets the calling thread's own counts in the
OpenMP runtime and the MKL that torch loaded. Where neither is found it logs once and changes nothing.

A push's own threads also run behind the engine's (`behind_generation`): where both want the CPUs, tokens first.
While they work, an eager engine's team leaves them their CPUs (`EngineTeam`): a team member that shares a CPU with
a push thread holds the whole team back at every op (a step beside one ran 3x slower on two threads than on one).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
_taken = [0]  # CPUs this process's push threads hold now (`behind_generation`): the CPUs are the process's
_taken_lock = threading.Lock()


def raise_nice() -> bool:
    """The calling thread's nice value raised by `BEHIND_NICE` (for good: an unprivileged thread cannot lower it
    again). True when it took effect."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BEHIND_NICE))
    except (OSError, AttributeError):  # not Linux, or refused
        return False
    return True


@contextmanager
def behind_generation(cpus: int = 1) -> Iterator[bool]:
    """Run the calling thread behind the engine's (`raise_nice`), so decoding takes the CPUs first, and count
    `cpus` CPUs as a push's until the block ends, which the engine's team leaves it (`EngineTeam`). For threads
    of their own only (a push's staging and layout threads): a shared pool's thread would stay slow. Yields
    whether the raise took effect."""
    raised = raise_nice()
    with _taken_lock:
        _taken[0] += cpus
    try:
        yield raised
    finally:
        with _taken_lock:
            _taken[0] -= cpus


def push_cpus() -> int:
    """CPUs this process's push threads hold now."""
    return _taken[0]


class EngineTeam:
    """The engine thread's OpenMP team, fitted before each step to the CPUs no push thread holds: its torch
    thread count at the first `fit` while no push runs, one fewer per CPU a push holds, never below one. Compiled
    forwards keep the whole team: inductor builds its loops for the thread count it compiled at, and dynamo
    guards that count, so a change would compile every variant again on the engine thread. Only the engine
    thread calls `fit` (the counts are the calling thread's)."""

    __slots__ = ("_cpus", "_full", "_now")

    def __init__(self) -> None:
        self._cpus = usable_cpus()
        self._full: int | None = None
        self._now = 0

    def fit(self, compiled: bool = False) -> int:
        """Size the calling thread's team for this step, whose forwards run `compiled` or eagerly; returns its
        thread count."""
        if self._full is None:
            self._full = self._now = torch.get_num_threads()  # also torch's per-thread set-up, done first
        want = self._full if compiled else max(1, min(self._full, self._cpus - _taken[0]))
        if want != self._now:
            omp, mkl = _setters()
            if omp is None:
                return self._now
            omp(want)
            if mkl is not None:
                mkl(want)
            self._now = want
        return self._now
