"""Pauses and weight swaps that wait: mode "wait" holds new requests back and applies once nothing runs.

Runs on the engine thread (`EngineLoop` posts the commands). A caller that cancels its future before the
pause or swap applied withdraws it; once applying, it can no longer be cancelled.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.backend.base import NotReady, SwapResult, check_mode

if TYPE_CHECKING:
    from service.backend.metrics import Metrics
    from service.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

Post = Callable[[Callable[["LLMEngine"], None]], None]


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


@dataclass(slots=True)
class _PendingSwap:
    apply: Callable[[LLMEngine], None]
    version: str
    future: Future[SwapResult]
    since: float


class Holds:
    def __init__(self, post: Post, publish: Callable[[LLMEngine], None], metrics: Metrics | None) -> None:
        self._post, self._publish, self.metrics = post, publish, metrics
        self._swaps: list[_PendingSwap] = []
        self._pauses: list[Future[list[str]]] = []

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
            self._publish(engine)  # a caller that sees the pause done also sees it in the stats
            logger.info("generation paused (%s)", mode)
            settle(fut, aborted)

        self._post(run)
        self._drop_when_cancelled(fut)
        return fut

    def resume(self) -> Future[None]:
        def run(engine: LLMEngine) -> None:
            engine.paused = False
            self._publish(engine)
            for fut in self._pauses:
                settle(fut, [])
            self._pauses.clear()
            self._update_hold(engine)

        fut: Future[None] = Future()

        def command(engine: LLMEngine) -> None:
            if fut.set_running_or_notify_cancel():
                run(engine)
                settle(fut, None)

        self._post(command)
        return fut

    def swap(self, apply: Callable[[LLMEngine], None], version: str, mode: str) -> Future[SwapResult]:
        """Run `apply(engine)` (serve new weights as `version`) between two steps: now (keep), after aborting
        running requests (abort) or once they finish (wait). Cancelling the future before then withdraws it."""
        mode = check_mode(mode)
        fut: Future[SwapResult] = Future()

        def run(engine: LLMEngine) -> None:
            if fut.cancelled():
                logger.info("push of version %s cancelled before it was applied: its caller left", version)
                return
            if mode == "wait" and engine.num_running and not engine.paused:
                self._swaps.append(_PendingSwap(apply, version, fut, time.monotonic()))
                self._update_hold(engine)
                return
            if not fut.set_running_or_notify_cancel():  # from here on the caller can no longer cancel it
                return
            start = time.perf_counter()
            try:
                aborted = self._abort_running(engine, "weight_push") if mode == "abort" else []
                self._swap(engine, apply, version)
            except Exception as exc:
                settle(fut, exc=exc)
                return
            settle(fut, SwapResult(version, time.perf_counter() - start, 0.0, aborted))

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

    def _abort_running(self, engine: LLMEngine, reason: str) -> list[str]:
        """Mode abort: end the requests that are generating; waiting ones stay queued (after a swap they start
        on the new weights, after a pause once generation resumes)."""
        ids = list(dict.fromkeys(s.request_id for s in engine.scheduler.running))
        for rid in ids:
            engine.abort(rid)
        if ids and self.metrics is not None:
            self.metrics.aborted(reason, len(ids))
        return ids

    def _swap(self, engine: LLMEngine, apply: Callable[[LLMEngine], None], version: str) -> None:
        apply(engine)
        self._publish(engine)
        logger.info("now serving weights version %s", version)

    def _update_hold(self, engine: LLMEngine) -> None:
        engine.hold_admission = bool(self._swaps or self._pauses)

    def progress(self, engine: LLMEngine) -> None:
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
                self._swap(engine, sw.apply, sw.version)
            except Exception as exc:
                settle(sw.future, exc=exc)
                continue
            settle(sw.future, SwapResult(sw.version, time.perf_counter() - start, time.monotonic() - sw.since))
        live = [f for f in pauses if f.set_running_or_notify_cancel()]
        if live:
            engine.paused = True
            self._publish(engine)
            logger.info("generation paused (wait)")
            for fut in live:
                settle(fut, [])
        elif pauses:
            logger.warning("pause (wait) not applied: its caller left")

    def shutdown(self) -> None:
        for sw in self._swaps:
            settle(sw.future, exc=NotReady("the server is shutting down"))
        for fut in self._pauses:
            settle(fut, exc=NotReady("the server is shutting down"))
