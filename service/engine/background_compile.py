"""Compiling the CPU forwards while the engine already serves (`EngineConfig.compile_background`; `specroll serve`
does it unless told `--compile-before-serving`).

Why: the compiled decode and verify forwards (service/engine/compiled.py) took 25 s to compile on a 2-core machine
with inductor's caches warm and 150 s cold (the demo model, target and draft model, 8 variants), and a server that
compiled them before it answered was not ready for that long: a restarted pod, or a trainer waiting on it, waited
minutes for forwards that only make steps ~1.4x faster. Now the engine serves at once, eagerly; a thread compiles;
at the first step boundary after it is done, the engine's forwards are the compiled ones.

How:
- The thread compiles what start-up would (`CachedModel.warm_up`: the same variants at the same sizes), on
  scratch caches of the serving caches' shapes (`KVCache.scratch_like`), so no sequence's cache is written.
  Same shapes and strides, so the same guards: the engine's first compiled step finds its variants compiled
  (tests/engine/test_compiled.py checks that serving compiles nothing after the switch).
- It keeps torch's thread count: inductor sizes each fused loop's parallelism by the compiling thread's count
  (`parallel_num_threads`), and code compiled on a one-thread thread (service/cpu_threads.py) would serve every
  loop on one thread. While it compiles, its OpenMP team and the C++ compiler slow the engine's steps.
- Dynamo and inductor are Python: the thread holds the GIL most of the time, and every torch op of an eager step
  lets the GIL go and waits to take it back, which CPython forces the holder to allow only after its switch
  interval (5 ms). A request of 8 x 64 tokens (demo model + draft model, 2 cores, inductor's cache warm) took
  7-26 s while compiling against 0.45-0.59 s alone. So while the thread runs the interval is 0.1 ms
  (`SWITCH_INTERVAL_S`; process-wide: put back when the last compile ends): 1.8-3.5 s a request, and the
  compile took 50-56 s instead of 44-46 s. Serving still shares two cores with the compile:
  `--compile-before-serving` serves more in the first minutes, where answering at once does not matter.
- Eager and compiled steps cost different seconds: at the switch the adaptive strategy forgets what steps cost
  (`AdaptiveStrategy.forget_costs`) and measures them again; what it learnt of acceptance stands.
- Steps run eagerly until every model's forwards are compiled (a target compiled and a draft model eager would
  be priced by a cost model that saw neither). A failure of the compiler stack is logged and the engine stays
  eager, as at start-up.
- At shutdown (`stop`) the thread ends after the variant it is compiling. Nothing waits for it: a variant can
  take half a minute to compile, and a server's shutdown flushes its rollouts first. A thread still inside
  inductor when the interpreter finalizes is killed in C++ ("terminate called without an active exception":
  the process aborts), so `specroll serve` exits without finalizing where one still runs (`still_compiling`),
  once everything else is closed (service/app.py).
- Tracing that would reach the serving thread: torch.fx's tracer patches `torch.nn.Module.__call__` for the whole
  process while it traces, and a plain `fx.Tracer` resolves every module called meanwhile against its own root, so
  an eager forward on the engine thread at that moment fails its step ("module is not installed as a submodule":
  every request in flight failed, one CI run). Inductor runs such a trace once per process (a placeholder graph for
  its loop-body interpreter); it is run before the thread starts (`_trace_once_up_front`), when nothing serves.
  The traces of each compile are make_fx's, whose tracer calls a module it does not know straight through.
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
