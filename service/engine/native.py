"""The native PyTorch engine behind the RolloutBackend interface.

The engine thread (`EngineLoop`) owns the `LLMEngine`; everything here either queues work for it or reads what
it published (the stats snapshot, the info fixed at load): each call builds one typed message
(service/engine/inbox.py) and posts it. Pushed weights are staged by `WeightStager` on the caller's thread and
swapped in by the engine thread between two steps.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from service.backend.admission import Admission
from service.backend.base import (
    CAP_ADAPTIVE_SD,
    CAP_DELTA_PUSH,
    CAP_DRAFTER_PUSH,
    CAP_RAW_LOGPROBS,
    CAP_SEEDS,
    CAP_TOP_LOGPROBS,
    BackendInfo,
    Destinations,
    DrafterCopy,
    NotReady,
    PushUnsupported,
    RolloutBackend,
    SparseValues,
    Staged,
    StatsSnapshot,
    SwapResult,
    TeacherSnapshot,
    WeightSpec,
)
from service.backend.hooks import Hooks
from service.config import EngineConfig
from service.engine.inbox import CopyDrafter, LendTeacher
from service.engine.llm_engine import LLMEngine
from service.engine.loop import EngineLoop
from service.engine.weights import WeightStager

if TYPE_CHECKING:
    import torch

    from service.backend.events import GenRequest, RequestHandle
    from service.backend.metrics import Metrics
    from service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class NativeBackend(RolloutBackend):
    def __init__(self, config: EngineConfig, metrics: Metrics | None = None, hooks: Hooks | None = None,
                 admission: Admission | None = None) -> None:
        if not config.model:
            raise ValueError("EngineConfig.model must name a model folder (the CLI resolves the default model)")
        self.config = config
        self.hooks = hooks or Hooks()
        self.loop = EngineLoop(self._load, metrics, self.hooks, admission)
        self.admission = self.loop.admission
        self._stager: WeightStager | None = None
        self._info: BackendInfo | None = None
        self._roles: dict[str, WeightSpec] = {}
        self._lent: weakref.WeakSet[TeacherSnapshot] = weakref.WeakSet()  # teacher snapshots alive
        self._lent_lock = threading.Lock()
        self._invalid = ""  # why the serving weights are no version (an in-place push failed after writing)

    def _load(self) -> tuple[LLMEngine, WeightStager]:
        """Engine thread: build the engine, its weight stager and what never changes while it serves."""
        engine = LLMEngine(self.config)
        self._stager = WeightStager(engine, self.config.weight_spare not in ("free", "in-place"))
        self._stager.lent = self._is_lent
        if self.config.weight_spare == "start":
            t0 = time.perf_counter()
            nbytes = self._stager.allocate_spares()
            logger.info("weight spare allocated at start: %.1f MB in %.2f s (--weight-spare start)", nbytes / 1e6,
                        time.perf_counter() - t0)
        self._roles = self._stager.roles()  # architectures never change: a push must match them
        tok = engine.tokenizer
        caps = {CAP_RAW_LOGPROBS, CAP_TOP_LOGPROBS, CAP_SEEDS, CAP_DELTA_PUSH}
        if engine.drafters:
            caps.add(CAP_ADAPTIVE_SD)
        if "drafter" in self._roles:
            caps.add(CAP_DRAFTER_PUSH)
        self._info = BackendInfo(
            backend="native", model_path=engine.model_path, vocab_size=engine.model_config.vocab_size,
            max_model_len=engine.config.max_model_len, dtype=str(engine.config.dtype),
            eos_token_id=None if tok is None else tok.eos_token_id, drafter=str(engine.drafter_spec),
            num_slots=engine.scheduler.num_slots, capabilities=frozenset(caps))
        return engine, self._stager

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.loop.start()

    def stop(self, timeout: float = 30.0) -> None:
        self.loop.stop(timeout)

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self.loop.loaded_or_failed.wait(timeout)

    @property
    def load_error(self) -> BaseException | None:
        return self.loop.error

    @property
    def ready(self) -> bool:
        return self.loop.ready.is_set() and self.loop.alive and not self._invalid

    @property
    def alive(self) -> bool:
        return self.loop.error is None and (self.loop.alive or not self.loop.ready.is_set())

    def _loaded(self) -> LLMEngine:
        if self.loop.ready.is_set() and not self.loop.alive:
            raise NotReady("the engine loop has stopped")
        return self.loop.engine  # raises NotReady while loading or after a failed load

    # -- what it serves --------------------------------------------------------------------------------------
    def info(self) -> BackendInfo:
        self._loaded()
        assert self._info is not None  # set before the engine is published
        return self._info

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._loaded().tokenizer

    def stats(self) -> StatsSnapshot:
        self._loaded()
        return self.loop.snapshot or StatsSnapshot()

    # -- generation ------------------------------------------------------------------------------------------
    def submit_all(self, items: list[tuple[GenRequest, RequestHandle]]) -> None:
        self._loaded()
        if self._invalid:
            raise NotReady(f"the serving weights are no valid version: {self._invalid}; generation resumes once a "
                           "complete weight push succeeds")
        self.loop.submit_all(items)

    def abort(self, request_id: str, reason: str = "client") -> Future[bool]:
        return self.loop.abort(request_id, reason)

    def abort_all(self, reason: str = "admin") -> Future[list[str]]:
        self._loaded()
        return self.loop.abort_all(reason)

    def pause(self, mode: str) -> Future[list[str]]:
        self._loaded()
        return self.loop.pause(mode)

    def resume(self) -> Future[None]:
        self._loaded()
        return self.loop.resume()

    # -- weights ---------------------------------------------------------------------------------------------
    def weight_roles(self) -> dict[str, WeightSpec]:
        self._loaded()
        return dict(self._roles)

    def unsupported(self, role: str) -> str:
        self._loaded()
        assert self._stager is not None
        return self._stager.unsupported(role)

    @property
    def stager(self) -> WeightStager | None:
        """The engine's weight stager once loaded (its spares are read by tests and diagnostics)."""
        return self._stager

    def _stager_for(self, role: str) -> WeightStager:
        self._loaded()
        assert self._stager is not None
        if role not in self._roles:
            raise PushUnsupported(self._stager.unsupported(role) or f"no weights to push for role {role!r}")
        return self._stager

    def stage_checked(self, role: str, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]], *,
                      delta: bool = False) -> Staged:
        if self.weights_in_place:
            return self._stager_for(role).stage_in_place(role, tensors, delta)
        return self._stager_for(role).stage(role, tensors, delta)

    def stage_into(self, role: str, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]],
                   into: Destinations, *, delta: bool = False) -> Staged:
        if self.weights_in_place:
            return self._stager_for(role).stage_in_place(role, tensors, delta, into)
        return self._stager_for(role).stage(role, tensors, delta, into)

    @property
    def weights_in_place(self) -> bool:
        return self.config.weight_spare == "in-place"

    @property
    def weights_invalid(self) -> str:
        return self._invalid

    def set_weights_invalid(self, reason: str) -> None:
        if reason and not self._invalid:
            logger.error("the serving weights are no valid version: %s; generation is refused until a complete "
                         "push succeeds", reason)
        elif not reason and self._invalid:
            logger.info("serving weights valid again")
        self._invalid = reason

    def commit_weights(self, staged: Staged, version: str, mode: str,
                       drafter: tuple[Staged, str] | None = None) -> Future[SwapResult]:
        """The engine thread serves the staged weights between two steps (service/engine/holds.py); withdrawn
        or failed, the staged buffers are spared for the next push."""
        stager = self._stager_for(staged.role)
        if drafter is not None:
            self._stager_for(drafter[0].role)
        fut = self.loop.commit(staged, version, mode, drafter)

        def release_if_unused(f: Future[SwapResult]) -> None:
            if f.cancelled() or f.exception() is not None:
                for s in (staged, drafter[0] if drafter else None):
                    if s is not None and s.payload is not None:
                        stager.discard(s)

        fut.add_done_callback(release_if_unused)
        return fut

    def discard(self, staged: Staged) -> None:
        if self._stager is not None:
            self._stager.discard(staged)

    # -- the in-process drafter trainer ------------------------------------------------------------------------
    def teacher_snapshot(self) -> Future[TeacherSnapshot]:
        self._loaded()
        msg = LendTeacher()

        def keep_lent(f: Future[TeacherSnapshot]) -> None:  # on the engine thread, as it answers: before any swap
            if not f.cancelled() and f.exception() is None:
                with self._lent_lock:
                    self._lent.add(f.result())

        msg.future.add_done_callback(keep_lent)
        return self.loop.post(msg).future

    def _is_lent(self, module: object) -> bool:
        with self._lent_lock:
            return any(s.module is module for s in self._lent)

    def drafter_copy(self) -> Future[DrafterCopy | None]:
        self._loaded()
        if self.weights_in_place:  # the in-process trainer then stays off (drafter_trainer/embedded.py)
            raise PushUnsupported("with --weight-spare in-place a push overwrites the serving target a teacher "
                                  "would read; train the drafter with the sidecar (--redis-url) instead")
        return self.loop.post(CopyDrafter()).future

    def must_exit_hard(self) -> bool:
        from service.engine.background_compile import still_compiling

        if not still_compiling():
            return False
        logger.info("exiting with the background compile unfinished")  # see background_compile.py
        return True
