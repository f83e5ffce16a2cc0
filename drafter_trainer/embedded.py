"""The drafter trainer inside the server process (`specroll serve` without --redis-url).

It reads the server's in-process buffer and talks to the engine only through the backend interface: a copy of
the serving drafter to train, the serving target as its teacher (a read-only snapshot at the served policy
version), and improved drafters back through the push path. It reports its metrics on the server's /metrics.
Same loop and accounting as the sidecar; checkpoints only with --trainer-dir. A backend that lends neither
(vLLM) leaves it off.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from drafter_trainer.config import TrainerConfig
from service.backend.base import PushUnsupported, TeacherSnapshot
from service.cpu_threads import one_cpu_thread

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from service.backend.base import RolloutBackend
    from service.buffer.memory import MemoryBuffer

logger = logging.getLogger(__name__)

# The trainer trains while the server is idle, which in an RL loop is when the policy trainer updates. On a
# machine the two share, measured in bench/e2e.py: the update's wall time exceeded its CPU time by the time
# this thread trained (up to +80% on a step), so it runs below normal priority. At nice 10 alone the policy
# trainer's update still took 0.20 ms a trained token against 0.15-0.17 with the drafter trainer idle
# (bench.e2e --no-pin, 2 cores: its threads wait for each other, and a core shared even a tenth of the time
# holds them all back); in the SCHED_IDLE class, which runs only on cores nobody else wants, 0.16. The serving
# loop and a policy trainer on the same cores come first. Its torch ops release the GIL, so its Python between
# ops is all it can hold the serving threads up by.
NICENESS = 10


def lower_thread_priority(niceness: int) -> None:
    """Raise the calling thread's nice value and, where Linux has it, put it in the SCHED_IDLE class (per thread);
    never fails."""
    if niceness <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), niceness))
        if hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        logger.info("cannot lower the drafter trainer's priority: %s", exc)


class EmbeddedTrainer:
    def __init__(self, backend: RolloutBackend, buffer: MemoryBuffer, registry: CollectorRegistry,
                 checkpoint_dir: str | None = None, config: TrainerConfig | None = None) -> None:
        self.backend, self.buffer, self.registry = backend, buffer, registry
        config = config or TrainerConfig(consumer="in-process")
        self.config = replace(config, checkpoint_dir=checkpoint_dir or config.checkpoint_dir)
        self.trainer: Any = None
        self.timeout_s = 60.0  # for what the engine thread hands over between two steps
        self._teacher: TeacherSnapshot | None = None
        self.niceness = NICENESS
        self.one_thread: bool | None = None  # whether its torch ops run on its own thread alone (set once running)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specroll-drafter-trainer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _build(self) -> Any:
        from drafter_trainer.build import NothingToTrain, student_from_copy
        from drafter_trainer.checkpoint import CheckpointStore
        from drafter_trainer.metrics import TrainerMetrics
        from drafter_trainer.servers import LocalServer
        from drafter_trainer.source import MemorySource
        from drafter_trainer.teacher import Teacher
        from drafter_trainer.trainer import DrafterTrainer

        cfg = self.config
        backend = self.backend
        info = backend.info()
        max_positions = cfg.max_seq_len + 1
        try:
            found = backend.drafter_copy().result(self.timeout_s)
            if found is None:
                raise NothingToTrain(f"the server's drafter {info.drafter!r} has no weights to train")
            student = student_from_copy(found, info.drafter, info.vocab_size, max_positions)
        except (NothingToTrain, PushUnsupported) as exc:
            logger.info("in-process drafter trainer is off: %s", exc)
            return None

        def serving_model(version: str) -> Any:  # the teacher: the policy the engine serves, lent read-only
            snap = backend.teacher_snapshot().result(self.timeout_s)
            self._teacher = snap if snap.version == version else None  # held while the teacher reads it
            return None if self._teacher is None else self._teacher.module

        teacher = Teacher(serving_model, student.device, max_positions)
        store = CheckpointStore(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        metrics = TrainerMetrics(self.registry)
        logger.info("in-process drafter trainer: training the %s drafter on this server's rollouts", student.kind)
        return DrafterTrainer(cfg, MemorySource(self.buffer, cfg.max_deliveries), LocalServer(backend), student,
                              teacher, metrics, store)

    def _run(self) -> None:
        lower_thread_priority(self.niceness)
        self.one_thread = one_cpu_thread()  # else its OpenMP team slows every engine step (service/cpu_threads.py)
        while not self.backend.wait_loaded(0.5):
            if self._stop.is_set():
                return
        if self.backend.load_error is not None or self._stop.is_set():
            return
        try:
            with torch.inference_mode(False):
                self.trainer = self._build()
                if self.trainer is not None:
                    self.trainer.run(self._stop)
        except Exception:
            logger.exception("the in-process drafter trainer stopped")
