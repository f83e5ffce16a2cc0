"""Pauses and weight commits on the engine thread; mode "wait" holds new requests back and applies once nothing
runs.

`EngineLoop` hands this module its `Pause`, `Resume` and `CommitWeights` messages. It keeps the waiting ones
and sets the scheduler's `PauseState` from them: the scheduler follows that one state. A caller that cancels its
future before the pause or commit applied withdraws it; once applying, it can no longer be cancelled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.backend.base import NotReady, SwapResult
from service.engine.inbox import CommitWeights, Pause, Resume, settle

if TYPE_CHECKING:
    from service.backend.metrics import Metrics
    from service.engine.inbox import AppliesWeights, EngineCore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _WaitingCommit:
    message: CommitWeights
    since: float


class Holds:
    def __init__(self, publish: Callable[[EngineCore], None], metrics: Metrics | None) -> None:
        self._publish, self.metrics = publish, metrics
        self._commits: list[_WaitingCommit] = []
        self._pauses: list[Pause] = []

    # -- messages ------------------------------------------------------------------------------------------
    def pause(self, engine: EngineCore, msg: Pause) -> None:
        """Pause generation; the future resolves (with aborted request ids) once nothing runs."""
        if msg.future.cancelled():
            logger.info("pause (%s) cancelled before it started: its caller left", msg.mode)
            return
        if msg.mode == "wait" and self._drains(engine):
            self._pauses.append(msg)
            self._update_hold(engine)
            return
        if not msg.future.set_running_or_notify_cancel():
            return
        aborted = self._abort_running(engine, "pause") if msg.mode == "abort" else []
        engine.scheduler.pause.paused = True
        self._publish(engine)  # a caller that sees the pause done also sees it in the stats
        logger.info("generation paused (%s)", msg.mode)
        settle(msg.future, aborted)

    def resume(self, engine: EngineCore, msg: Resume) -> None:
        if not msg.future.set_running_or_notify_cancel():
            return
        engine.scheduler.pause.paused = False
        self._publish(engine)
        for pause in self._pauses:
            settle(pause.future, [])
        self._pauses.clear()
        self._update_hold(engine)
        settle(msg.future, None)

    def commit(self, engine: EngineCore, stager: AppliesWeights, msg: CommitWeights) -> None:
        """Serve the staged weights between two steps: now (keep), after aborting running requests (abort) or
        once they finish (wait)."""
        if msg.future.cancelled():
            logger.info("push of version %s cancelled before it was applied: its caller left", msg.version)
            return
        if msg.mode == "wait" and self._drains(engine):
            self._commits.append(_WaitingCommit(msg, time.monotonic()))
            self._update_hold(engine)
            return
        if not msg.future.set_running_or_notify_cancel():  # from here on the caller can no longer cancel it
            return
        start = time.perf_counter()
        try:
            aborted = self._abort_running(engine, "weight_push") if msg.mode == "abort" else []
            self._serve(engine, stager, msg)
        except Exception as exc:
            settle(msg.future, exc=exc)
            return
        settle(msg.future, SwapResult(msg.version, time.perf_counter() - start, 0.0, aborted))

    # -- between two steps ---------------------------------------------------------------------------------
    def progress(self, engine: EngineCore, stager: AppliesWeights) -> None:
        """Withdraw what its caller left; finish wait-mode commits and pauses once nothing runs (or generation
        is frozen anyway)."""
        self._drop_cancelled(engine)
        if not (self._commits or self._pauses) or self._drains(engine):
            return
        commits, self._commits = self._commits, []
        pauses, self._pauses = self._pauses, []
        self._update_hold(engine)
        for waiting in commits:
            msg = waiting.message
            # A caller that left is never applied; once running, the caller can no longer cancel it.
            if not msg.future.set_running_or_notify_cancel():
                logger.warning("push of target weights %s not applied: its caller left", msg.version)
                continue
            start = time.perf_counter()
            try:
                self._serve(engine, stager, msg)
            except Exception as exc:
                settle(msg.future, exc=exc)
                continue
            settle(msg.future, SwapResult(msg.version, time.perf_counter() - start, time.monotonic() - waiting.since))
        live = [p for p in pauses if p.future.set_running_or_notify_cancel()]
        if live:
            engine.scheduler.pause.paused = True
            self._publish(engine)
            logger.info("generation paused (wait)")
            for pause in live:
                settle(pause.future, [])
        elif pauses:
            logger.warning("pause (wait) not applied: its caller left")

    def shutdown(self) -> None:
        for waiting in self._commits:
            settle(waiting.message.future, exc=NotReady("the server is shutting down"))
        for pause in self._pauses:
            settle(pause.future, exc=NotReady("the server is shutting down"))

    # -- helpers -------------------------------------------------------------------------------------------
    @staticmethod
    def _drains(engine: EngineCore) -> bool:
        """Sequences run and generation is not frozen: a wait-mode pause or commit has to wait for them."""
        return bool(engine.scheduler.running) and not engine.scheduler.pause.paused

    def _drop_cancelled(self, engine: EngineCore) -> None:
        """A waiting commit or pause whose caller left is withdrawn at once, releasing the admission hold."""
        if not any(w.message.future.cancelled() for w in self._commits) and \
                not any(p.future.cancelled() for p in self._pauses):
            return
        for w in [w for w in self._commits if w.message.future.cancelled()]:
            logger.warning("push of target weights %s withdrawn: its caller left before it was applied",
                           w.message.version)
        for _ in [p for p in self._pauses if p.future.cancelled()]:
            logger.warning("pause (wait) withdrawn: its caller left before generation was paused")
        self._commits = [w for w in self._commits if not w.message.future.cancelled()]
        self._pauses = [p for p in self._pauses if not p.future.cancelled()]
        self._update_hold(engine)

    def _abort_running(self, engine: EngineCore, reason: str) -> list[str]:
        """Mode abort: end the requests that are generating; waiting ones stay queued (after a commit they start
        on the new weights, after a pause once generation resumes)."""
        ids = list(dict.fromkeys(s.request_id for s in engine.scheduler.running))
        for rid in ids:
            engine.abort(rid)
        if ids and self.metrics is not None:
            self.metrics.aborted(reason, len(ids))
        return ids

    def _serve(self, engine: EngineCore, stager: AppliesWeights, msg: CommitWeights) -> None:
        stager.apply(msg.staged, msg.version)
        if msg.drafter is not None:
            stager.apply(*msg.drafter)
        self._publish(engine)
        logger.info("now serving weights version %s", msg.version)

    def _update_hold(self, engine: EngineCore) -> None:
        engine.scheduler.pause.held = bool(self._commits or self._pauses)
