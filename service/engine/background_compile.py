"""Compiling the CPU forwards while the engine already serves (`EngineConfig.compile_background`).

A server that compiled before answering was not ready for minutes; now it serves at once on eager forwards while a
thread compiles, and switches between two steps once every model's forwards are compiled.
- The thread compiles the same variants as start-up would, on scratch caches of the serving caches' shapes, so the
  engine's first compiled step finds them compiled.
- It keeps torch's thread count, and shortens the GIL's switch interval while it runs so eager steps are not
  starved by the compiler's Python.
- At the switch the adaptive strategy forgets step costs (not acceptance) and measures them again.
- A compiler failure is logged and the engine stays eager. At shutdown nothing waits for the thread; the backend
  says when the process must exit without finalizing.
- fx's one plain trace per process runs before the thread starts, since it patches module calls process-wide.

docs/design-notes.md gives the reasons in full.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

import torch

from service.engine.cached_model import CachedModel
from service.engine.compiled import compiles
from service.engine.kv_cache import KVCache

logger = logging.getLogger(__name__)

THREAD_NAME = "specroll-compile"
SWITCH_INTERVAL_S = 1e-4  # the GIL's switch interval while compiling (CPython's default: 5 ms)


def still_compiling() -> bool:
    """Whether a background compile of this process is still running."""
    return any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())


class _SwitchInterval:
    """CPython's switch interval is the process's: the first compile to start shortens it, the last to end puts
    back what it was."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = 0.0

    def shorten(self) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, SWITCH_INTERVAL_S))
            self._users += 1

    def restore(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._saved)


_SWITCH = _SwitchInterval()


def _trace_once_up_front() -> None:
    """Run inductor's one plain fx trace of a process now, on this thread (see the module docstring)."""
    try:
        from torch._inductor.loop_body import InterpreterShim

        InterpreterShim._dummy_gm()  # cached: later compiles reuse it
    except (ImportError, AttributeError):  # another torch: nothing known to trace up front
        logger.debug("no loop-body placeholder graph to trace up front in this torch")


class _Stopped(BaseException):
    """Raised in the compiling thread at its next variant after `stop` (a BaseException: `warm_up` logs and
    swallows Exceptions, as failures of the compiler stack)."""


class BackgroundCompile:
    """Compiles the given models' forwards of these query lengths in a thread; `take` switches them in."""

    def __init__(self, work: list[tuple[CachedModel, list[int]]]) -> None:
        # Each model's compiled forward, held back until all are compiled: until then they serve eagerly.
        self._forwards: list[tuple[CachedModel, Callable[..., torch.Tensor], list[int]]] = []
        for c, query_lens in work:
            if c.compiled is not None:
                self._forwards.append((c, c.compiled, query_lens))
                c.compiled = None
        self._done = threading.Event()
        self._stop = threading.Event()
        self._ok = False
        self._taken = False
        self.compiled = 0  # variants compiled, once done
        _SWITCH.shorten()  # until the thread ends
        _trace_once_up_front()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start, before = time.perf_counter(), compiles()
        try:
            # Made outside inference mode, as the serving caches were: an inference tensor has other dispatch
            # keys, which the guards check (every variant compiled again at the switch).
            scratch = [KVCache.scratch_like(c.cache) for c, _, _ in self._forwards]
            ok = True
            with torch.inference_mode():  # as the engine's steps run: grad mode is part of the guards
                for (c, forward, query_lens), cache in zip(self._forwards, scratch, strict=True):
                    ok = c.warm_up(query_lens, cache, self._stoppable(forward)) and ok
            self._ok = ok
            self.compiled = compiles() - before
            logger.info("compiled %d decode / verify forwards in the background in %.1f s%s", self.compiled,
                        time.perf_counter() - start, "; steps run them from now on" if ok else "")
        except _Stopped:
            logger.info("compiling in the background stopped (shutdown)")
        except Exception:  # anything else (a scratch cache that does not fit, say): stay eager
            logger.exception("compiling in the background failed; forwards stay eager")
        finally:
            _SWITCH.restore()
            self._done.set()

    def _stoppable(self, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: object) -> torch.Tensor:
            if self._stop.is_set():
                raise _Stopped
            return forward(*args)

        return run

    def stop(self) -> None:
        """End the compile after the variant in progress (nothing waits for it: see the module docstring)."""
        self._stop.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the compile to end (compiled or failed); True when it has."""
        return self._done.wait(timeout)

    def take(self) -> bool:
        """Call between steps: True once, at the first call after every forward compiled, which now serve."""
        if self._taken or not self._done.is_set():
            return False
        self._taken = True
        if self._ok:
            for c, forward, _ in self._forwards:
                c.compiled = forward
        return self._ok
