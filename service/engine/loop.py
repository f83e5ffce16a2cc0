"""The engine loop: the only thread that touches the engine.

Other threads post typed messages (service/engine/inbox.py); between two steps the loop takes them, in order, and
dispatches each by its type. Pauses and weight commits that wait hold admission and finish once no sequence
is running (service/engine/holds.py).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from service.backend.admission import Admission
from service.backend.base import DrafterCopy, NotReady, Staged, StatsSnapshot, SwapResult, TeacherSnapshot
from service.backend.events import Failed, GenRequest, RequestHandle
from service.backend.hooks import Hooks
from service.engine.dispatch import Dispatcher
from service.engine.holds import Holds
from service.engine.inbox import (
    Abort,
    AbortAll,
    AddRequests,
    CommitWeights,
    CopyDrafter,
    LendTeacher,
    Message,
    Pause,
    Resume,
    Shutdown,
    settle,
)
from service.params import SamplingError

if TYPE_CHECKING:
    from service.backend.metrics import Metrics
    from service.engine.inbox import EngineCore
    from service.engine.weights import WeightStager

logger = logging.getLogger(__name__)

T = TypeVar("T")


IDLE_WAIT_S = 0.5


class EngineLoop:
    def __init__(self, engine_factory: Callable[[], tuple[EngineCore, WeightStager]], metrics: Metrics | None = None,
                 hooks: Hooks | None = None, admission: Admission | None = None) -> None:
        self._factory = engine_factory
        self.metrics = metrics
        self.hooks = hooks or Hooks()
        self.admission = admission or Admission()
        if metrics is not None and self.hooks.on_rollout_lost is None:
            self.hooks.on_rollout_lost = metrics.rollout_unrecorded
        self._engine: EngineCore | None = None
        self._stager: WeightStager | None = None
        self.snapshot: StatsSnapshot | None = None  # replaced (never mutated) by the engine thread
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.loaded_or_failed = threading.Event()
        self._cond = threading.Condition()
        self._inbox: deque[Message] = deque()
        self._disp = Dispatcher(metrics, self.hooks)
        self.holds = Holds(self._publish, metrics)
        self._closed = False  # Shutdown is posted: nothing more is taken
        self._thread = threading.Thread(target=self._run, name="specroll-engine", daemon=True)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self.hooks.start()
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            if not self._closed:
                self._closed = True
                self._inbox.append(Shutdown())
                self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.hooks.stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def engine(self) -> EngineCore:
        """For reading state from other threads (counters, versions); never call its methods there."""
        if self._engine is None:
            raise NotReady(f"model failed to load: {self.error}" if self.error else "model is still loading")
        return self._engine

    # -- API (any thread): build a message, post it --------------------------------------------------
    def submit_all(self, items: list[tuple[GenRequest, RequestHandle]]) -> None:
        """Admit every request or none (raises Overloaded), then queue them for the engine."""
        tickets = self.admission.admit([(r.params.n, len(r.prompt_token_ids) + r.params.max_tokens)
                                        for r, _ in items])
        for (_, handle), ticket in zip(items, tickets, strict=True):
            handle.ticket = ticket
        try:
            self.post(AddRequests(items))
        except NotReady:
            for ticket in tickets:
                ticket.release()
            raise

    def abort(self, request_id: str, reason: str = "client") -> Future[bool]:
        return self.post(Abort(request_id, reason)).future

    def abort_all(self, reason: str = "admin") -> Future[list[str]]:
        return self.post(AbortAll(reason)).future

    def pause(self, mode: str) -> Future[list[str]]:
        return self.post(Pause(mode)).future

    def resume(self) -> Future[None]:
        return self.post(Resume()).future

    def commit(self, staged: Staged, version: str, mode: str,
               drafter: tuple[Staged, str] | None = None) -> Future[SwapResult]:
        return self.post(CommitWeights(staged, version, mode, drafter)).future

    def post(self, msg: T) -> T:
        with self._cond:
            if self._closed:
                raise NotReady("the server is shutting down")
            self._inbox.append(msg)  # type: ignore[arg-type]
            self._cond.notify()
        return msg

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._engine, self._stager = self._factory()
        except BaseException as exc:
            logger.exception("engine failed to load")
            self.error = exc
            self.loaded_or_failed.set()
            return
        engine = self._engine
        self.admission.slots = engine.scheduler.num_slots
        self._publish(engine)
        self.ready.set()
        self.loaded_or_failed.set()
        while True:
            with self._cond:
                inbox, self._inbox = self._inbox, deque()
            for msg in inbox:
                if isinstance(msg, Shutdown):
                    self._shutdown(engine)
                    return
                try:
                    self._handle(engine, msg)
                except Exception:
                    logger.exception("engine message %s failed", type(msg).__name__)
            try:
                self.holds.progress(engine, self._stager)
            except Exception:
                logger.exception("finishing waiting pushes and pauses failed")
            paused = engine.scheduler.pause.paused
            if engine.has_unfinished():
                produced = self._step(engine)
                if not produced and (paused or engine.num_running == 0):
                    self._wait(0.02 if not paused else IDLE_WAIT_S)
            else:
                engine.take_compiled()  # an idle server switches too (its gauge would say compiling)
                self._publish(engine)
                self._wait(IDLE_WAIT_S)

    def _handle(self, engine: EngineCore, msg: Message) -> None:
        assert self._stager is not None  # set with the engine
        match msg:
            case AddRequests(items=items):
                for req, handle in items:
                    self._add(engine, req, handle)
            case Abort(request_id=rid, reason=reason, future=fut):
                _answer(fut, self._abort, engine, rid, reason)
            case AbortAll(reason=reason, future=fut):
                _answer(fut, self._abort_all, engine, reason)
            case Pause():
                self.holds.pause(engine, msg)
            case Resume():
                self.holds.resume(engine, msg)
            case CommitWeights():
                self.holds.commit(engine, self._stager, msg)
            case LendTeacher(future=fut):
                _answer(fut, _teacher, engine)
            case CopyDrafter(future=fut):
                _answer(fut, _drafter_copy, engine)

    def _publish(self, engine: EngineCore) -> None:
        """One consistent copy of the engine's state for other threads (metrics, server info, the trainer)."""
        try:
            self.snapshot = engine.snapshot()
        except Exception:
            logger.exception("taking the engine's stats snapshot failed")

    def _wait(self, timeout: float) -> None:
        with self._cond:
            if not self._inbox:
                self._cond.wait(timeout)

    def _step(self, engine: EngineCore) -> bool:
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
            last = engine.stats.recent[-1]
            self.metrics.observe_step(last.batch_size, last.strategy)
        self._publish(engine)  # before the outputs go out: a client that has its tokens sees them counted
        if outputs:
            try:
                self._disp.dispatch(engine, outputs)
            except Exception:  # a consumer's state must never stop the engine thread
                logger.exception("handing step outputs to their requests failed")
        return bool(outputs)

    def _add(self, engine: EngineCore, req: GenRequest, handle: RequestHandle) -> None:
        try:
            rid = engine.enqueue(list(req.prompt_token_ids), req.params, req.request_id, req.group_id)
        except Exception as exc:  # a request id still in use (the rest was validated by its API), or a bug: this
            handle.release()      # request fails alone
            handle.put_many([Failed(str(exc), invalid=isinstance(exc, SamplingError))])
            return
        self._disp.track(handle, engine.requests[rid], req.metadata, req.stream)

    def _abort(self, engine: EngineCore, request_id: str, reason: str) -> bool:
        ok = engine.abort(request_id)
        if ok and self.metrics is not None:
            self.metrics.aborted(reason)
        return ok

    def _abort_all(self, engine: EngineCore, reason: str) -> list[str]:
        ids = engine.abort_all()
        if ids and self.metrics is not None:
            self.metrics.aborted(reason, len(ids))
        return ids

    def _fail_all(self, engine: EngineCore, message: str) -> None:
        self._disp.fail_all(message)
        try:
            engine.abort_all()
            engine.step()
        except Exception:
            logger.exception("could not clear the engine after a failed step")

    def _shutdown(self, engine: EngineCore) -> None:
        """Abort what is in flight so every stream gets its final record, then fail what still waits."""
        if self._disp.tracked:
            self._abort_all(engine, "shutdown")
            try:
                self._disp.dispatch(engine, engine.finish_aborted())
            except Exception:
                logger.exception("could not drain aborted requests at shutdown")
        self._disp.fail_all("the server is shutting down")
        self.holds.shutdown()
        engine.close()


def _teacher(engine: EngineCore) -> TeacherSnapshot:
    return TeacherSnapshot(str(engine.policy_version), engine.runner.model)


def _drafter_copy(engine: EngineCore) -> DrafterCopy | None:
    found = engine.drafter_weights()
    if found is None:
        return None
    return DrafterCopy(found[0], copy.deepcopy(found[1]), str(engine.drafter_version))


def _answer(fut: Future[T], fn: Callable[..., T], *args: Any) -> None:
    """Run `fn(*args)` for a caller's future, unless the caller withdrew it; an error goes to the caller."""
    if fut.set_running_or_notify_cancel():
        try:
            settle(fut, fn(*args))
        except Exception as exc:  # handed to its caller only
            settle(fut, exc=exc)
