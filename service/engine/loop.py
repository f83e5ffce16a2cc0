"""The engine loop: the only thread that touches the engine.

API layers submit requests and commands; commands run between two engine steps, in order. Multi-step
operations (a "wait" push, a "wait" pause) hold admission and finish once no sequence is running.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from service.backend.admission import Admission
from service.backend.events import Failed, GenRequest, RequestHandle
from service.backend.hooks import Hooks
from service.engine.dispatch import Dispatcher
from service.params import SamplingError

if TYPE_CHECKING:
    from service.backend.metrics import Metrics
    from service.engine.llm_engine import LLMEngine
    from service.models.llama import CausalLM

logger = logging.getLogger(__name__)

T = TypeVar("T")


def settle(fut: Future[Any], result: Any = None, exc: BaseException | None = None) -> bool:
    """Hand a result to a caller's future unless the caller already gave up (cancelled it): the engine thread
    never fails because of a caller's state. Returns whether the caller got it."""
    if fut.done():
        return False
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:  # cancelled between the check and the set
        return False
    return True


MODES = ("wait", "abort", "keep")
IDLE_WAIT_S = 0.5


class NotReady(RuntimeError):
    """The engine is not loaded (yet), failed to load, or the loop is stopping."""


@dataclass(slots=True)
class SwapResult:
    version: str
    swap_seconds: float
    wait_seconds: float
    aborted: list[str] = field(default_factory=list)
    replaced: Any = None  # the model that served before (the caller frees or reuses it)


@dataclass(slots=True)
class _PendingSwap:
    model: CausalLM
    version: str
    future: Future[SwapResult]
    since: float


def check_mode(mode: str) -> str:
    mode = (mode or "wait").lower()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    return mode


class EngineLoop:
    def __init__(self, engine_factory: Callable[[], LLMEngine], metrics: Metrics | None = None,
                 hooks: Hooks | None = None, admission: Admission | None = None) -> None:
        self._factory = engine_factory
        self.metrics = metrics
        self.hooks = hooks or Hooks()
        self.admission = admission or Admission()
        if metrics is not None and self.hooks.on_rollout_lost is None:
            self.hooks.on_rollout_lost = metrics.rollout_unrecorded
        self._engine: LLMEngine | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.loaded_or_failed = threading.Event()
        self._cond = threading.Condition()
        self._commands: deque[Callable[[LLMEngine], None]] = deque()
        self._disp = Dispatcher(metrics, self.hooks)
        self._swaps: list[_PendingSwap] = []
        self._pauses: list[Future[list[str]]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specroll-engine", daemon=True)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self.hooks.start()
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.hooks.stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def engine(self) -> LLMEngine:
        """For reading state from other threads (counters, versions); never call its methods there."""
        if self._engine is None:
            raise NotReady(f"model failed to load: {self.error}" if self.error else "model is still loading")
        return self._engine

    # -- API (any thread) ------------------------------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread between two steps."""
        fut: Future[T] = Future()

        def run(engine: LLMEngine) -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    settle(fut, fn(engine))
                except Exception as exc:  # handed to its caller only
                    settle(fut, exc=exc)

        self._post(run)
        return fut

    def submit(self, req: GenRequest, handle: RequestHandle) -> None:
        self.submit_all([(req, handle)])

    def submit_all(self, items: list[tuple[GenRequest, RequestHandle]]) -> None:
        """Admit every request or none (raises Overloaded), then queue them for the engine."""
        tickets = self.admission.admit([(r.params.n, len(r.prompt_token_ids) + r.params.max_tokens)
                                        for r, _ in items])
        for (_, handle), ticket in zip(items, tickets, strict=True):
            handle.ticket = ticket
        try:
            for req, handle in items:
                self._post(lambda engine, req=req, handle=handle: self._add(engine, req, handle))
        except NotReady:
            for ticket in tickets:
                ticket.release()
            raise

    def abort(self, request_id: str, reason: str = "client") -> Future[bool]:
        return self.call(lambda engine: self._abort(engine, request_id, reason))

    def abort_all(self, reason: str = "admin") -> Future[list[str]]:
        return self.call(lambda engine: self._abort_all(engine, reason))

    def pause(self, mode: str) -> Future[list[str]]:
        """Pause generation; the future resolves (with aborted request ids) once nothing runs."""
        mode = check_mode(mode)
        fut: Future[list[str]] = Future()

        def run(engine: LLMEngine) -> None:
            if fut.cancelled():
                logger.info("pause (%s) cancelled before it started: its caller left", mode)
                return
            if mode == "wait" and engine.num_running and not engine.paused:
                self._pauses.append(fut)
                self._update_hold(engine)
                return
            if not fut.set_running_or_notify_cancel():
                return
            aborted = self._abort_running(engine, "pause") if mode == "abort" else []
            engine.paused = True
            logger.info("generation paused (%s)", mode)
            settle(fut, aborted)

        self._post(run)
        self._drop_when_cancelled(fut)
        return fut

    def resume(self) -> Future[bool]:
        def run(engine: LLMEngine) -> bool:
            engine.paused = False
            for fut in self._pauses:
                settle(fut, [])
            self._pauses.clear()
            self._update_hold(engine)
            return False

        return self.call(run)

    def swap_target(self, model: CausalLM, version: str, mode: str) -> Future[SwapResult]:
        """Serve `model` as `version`: now (keep), after aborting (abort) or once running ones finish (wait)."""
        mode = check_mode(mode)
        fut: Future[SwapResult] = Future()

        def run(engine: LLMEngine) -> None:
            if fut.cancelled():
                logger.info("push of version %s cancelled before it was applied: its caller left", version)
                return
            if mode == "wait" and engine.num_running and not engine.paused:
                self._swaps.append(_PendingSwap(model, version, fut, time.monotonic()))
                self._update_hold(engine)
                return
            if not fut.set_running_or_notify_cancel():  # from here on the caller can no longer cancel it
                return
            start = time.perf_counter()
            try:
                aborted = self._abort_running(engine, "weight_push") if mode == "abort" else []
                old = self._swap(engine, model, version)
            except Exception as exc:
                settle(fut, exc=exc)
                return
            settle(fut, SwapResult(version, time.perf_counter() - start, 0.0, aborted, old))

        self._post(run)
        self._drop_when_cancelled(fut)
        return fut

    def _drop_when_cancelled(self, fut: Future[Any]) -> None:
        """A waiting push or pause whose caller leaves is withdrawn at once, releasing the admission hold."""

        def done(f: Future[Any]) -> None:
            if f.cancelled():
                with contextlib.suppress(NotReady):
                    self._post(self._drop_cancelled)

        fut.add_done_callback(done)

    def _drop_cancelled(self, engine: LLMEngine) -> None:
        for sw in [sw for sw in self._swaps if sw.future.cancelled()]:
            logger.warning("push of target weights %s withdrawn: its caller left before it was applied", sw.version)
        for _ in [f for f in self._pauses if f.cancelled()]:
            logger.warning("pause (wait) withdrawn: its caller left before generation was paused")
        self._swaps = [sw for sw in self._swaps if not sw.future.cancelled()]
        self._pauses = [f for f in self._pauses if not f.cancelled()]
        self._update_hold(engine)

    # -- engine thread ----------------------------------------------------------------------------
    def _post(self, fn: Callable[[LLMEngine], None]) -> None:
        with self._cond:
            if self._stopping:
                raise NotReady("the server is shutting down")
            self._commands.append(fn)
            self._cond.notify()

    def _run(self) -> None:
        try:
            self._engine = self._factory()
        except BaseException as exc:
            logger.exception("engine failed to load")
            self.error = exc
            self.loaded_or_failed.set()
            return
        self.admission.slots = self._engine.scheduler.num_slots
        self.ready.set()
        self.loaded_or_failed.set()
        if self.metrics is not None:
            self.metrics.bind_engine(self._engine)
        engine = self._engine
        while True:
            with self._cond:
                commands, self._commands = self._commands, deque()
                stopping = self._stopping
            for fn in commands:
                try:
                    fn(engine)
                except Exception:
                    logger.exception("engine command failed")
            if stopping:
                self._shutdown(engine)
                return
            try:
                self._progress(engine)
            except Exception:
                logger.exception("finishing waiting pushes and pauses failed")
            if engine.has_unfinished():
                produced = self._step(engine)
                if not produced and (engine.paused or engine.num_running == 0):
                    self._wait(0.02 if not engine.paused else IDLE_WAIT_S)
            else:
                self._wait(IDLE_WAIT_S)

    def _wait(self, timeout: float) -> None:
        with self._cond:
            if not self._commands and not self._stopping:
                self._cond.wait(timeout)

    def _step(self, engine: LLMEngine) -> bool:
        steps_before = engine.stats.num_steps
        try:
            outputs = engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all(engine, f"engine error: {exc}")
            return False
        for rid, message in engine.take_failures().items():
            self._disp.fail(rid, message)
        if self.metrics is not None and engine.stats.num_steps != steps_before and engine.stats.recent:
            self.metrics.observe_step(engine.stats.recent[-1])
        if outputs:
            try:
                self._disp.dispatch(engine, outputs)
            except Exception:  # a consumer's state must never stop the engine thread
                logger.exception("handing step outputs to their requests failed")
        return bool(outputs)

    def _add(self, engine: LLMEngine, req: GenRequest, handle: RequestHandle) -> None:
        try:
            rid = engine.add_request(req.prompt_token_ids, req.params, request_id=req.request_id,
                                     group_id=req.group_id)
        except (SamplingError, ValueError) as exc:
            handle.release()
            handle.put_many([Failed(str(exc), invalid=True)])
            return
        self._disp.track(handle, engine.requests[rid], req.metadata)

    def _abort(self, engine: LLMEngine, request_id: str, reason: str) -> bool:
        ok = engine.abort(request_id)
        if ok and self.metrics is not None:
            self.metrics.aborted(reason)
        return ok

    def _abort_all(self, engine: LLMEngine, reason: str) -> list[str]:
        ids = engine.abort_all()
        if ids and self.metrics is not None:
            self.metrics.aborted(reason, len(ids))
        return ids

    def _abort_running(self, engine: LLMEngine, reason: str) -> list[str]:
        """Mode abort: end the requests that are generating; waiting ones stay queued (after a swap they start
        on the new weights, after a pause once generation resumes)."""
        ids = list(dict.fromkeys(s.request_id for s in engine.scheduler.running))
        for rid in ids:
            engine.abort(rid)
        if ids and self.metrics is not None:
            self.metrics.aborted(reason, len(ids))
        return ids

    def _swap(self, engine: LLMEngine, model: CausalLM, version: str) -> Any:
        old = getattr(getattr(engine, "runner", None), "model", None)
        engine.swap_target(model, version)
        logger.info("now serving target weights version %s", version)
        return old

    def _update_hold(self, engine: LLMEngine) -> None:
        engine.hold_admission = bool(self._swaps or self._pauses)

    def _progress(self, engine: LLMEngine) -> None:
        """Finish wait-mode swaps and pauses once nothing runs (or generation is frozen anyway)."""
        if not (self._swaps or self._pauses) or (engine.num_running and not engine.paused):
            return
        swaps, self._swaps = self._swaps, []
        pauses, self._pauses = self._pauses, []
        self._update_hold(engine)
        for sw in swaps:
            # A caller that left is never applied; once running, the caller can no longer cancel it.
            if not sw.future.set_running_or_notify_cancel():
                logger.warning("push of target weights %s not applied: its caller left", sw.version)
                continue
            start = time.perf_counter()
            try:
                old = self._swap(engine, sw.model, sw.version)
            except Exception as exc:
                settle(sw.future, exc=exc)
                continue
            settle(sw.future, SwapResult(sw.version, time.perf_counter() - start, time.monotonic() - sw.since,
                                         [], old))
        live = [f for f in pauses if f.set_running_or_notify_cancel()]
        if live:
            engine.paused = True
            logger.info("generation paused (wait)")
            for fut in live:
                settle(fut, [])
        elif pauses:
            logger.warning("pause (wait) not applied: its caller left")

    def _fail_all(self, engine: LLMEngine, message: str) -> None:
        self._disp.fail_all(message)
        try:
            engine.abort_all()
            engine.step()
        except Exception:
            logger.exception("could not clear the engine after a failed step")

    def _shutdown(self, engine: LLMEngine) -> None:
        """Abort what is in flight so every stream gets its final record, then fail pending commands."""
        if self._disp.tracked:
            self._abort_all(engine, "shutdown")
            try:
                was_paused, engine.paused = engine.paused, True
                self._disp.dispatch(engine, engine.step())
                engine.paused = was_paused
            except Exception:
                logger.exception("could not drain aborted requests at shutdown")
        self._disp.fail_all("the server is shutting down")
        for sw in self._swaps:
            settle(sw.future, exc=NotReady("the server is shutting down"))
        for fut in self._pauses:
            settle(fut, exc=NotReady("the server is shutting down"))
