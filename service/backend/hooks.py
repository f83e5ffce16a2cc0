"""Callbacks for finished rollouts and reported rewards, run on their own thread (never the engine's).

The rollout buffer plugs in here: ``hooks.on_rollout_finished.append(fn)`` gets every finished sample as a
:class:`RolloutRecord`, ``hooks.on_reward.append(fn)`` every reported ``(rollout_id, reward)``.

A durable store (the Redis buffer) is set as ``hooks.rollout_store``: it gets each record with a `stored`
callback that it calls once the record is in Redis or fsync'd in its spool. The sample's final message goes
to the client only then, so a rollout a client received survives a kill -9 of the server.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from service.backend.events import RolloutRecord

logger = logging.getLogger(__name__)

RolloutCallback = Callable[[RolloutRecord], None]
RewardCallback = Callable[[str, float], None]
Stored = Callable[[], None]
RolloutStore = Callable[[RolloutRecord, Stored], None]


class Hooks:
    def __init__(self, max_rewards: int = 100_000) -> None:
        self.on_rollout_finished: list[RolloutCallback] = []
        self.on_reward: list[RewardCallback] = []
        self.rollout_store: RolloutStore | None = None
        self.max_rewards = max_rewards
        self.rewards: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._q: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.on_rollout_lost: Callable[[], None] | None = None  # a rollout callback failed (counted in metrics)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specroll-hooks", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout)
            self._thread = None

    def release(self, obj: Any) -> None:
        """Drop the last reference to `obj` (e.g. replaced weights) on the hooks thread."""
        self._q.put(("release", obj))

    @property
    def takes_rollouts(self) -> bool:
        return bool(self.on_rollout_finished) or self.rollout_store is not None

    def rollout_finished(self, record: RolloutRecord, stored: Stored) -> None:
        """Hand a finished sample to the callbacks and the store; `stored()` runs once the store holds it
        durably (after the callbacks when there is no store)."""
        self._q.put(("rollout", (record, stored)))

    def report_rewards(self, rewards: dict[str, float]) -> int:
        """Keep the rewards (bounded, oldest dropped first) and hand them to the callbacks."""
        with self._lock:
            for rid, value in rewards.items():
                self.rewards[rid] = float(value)
                self.rewards.move_to_end(rid)
            while len(self.rewards) > self.max_rewards:
                self.rewards.popitem(last=False)
        if self.on_reward:
            for rid, value in rewards.items():
                self._q.put(("reward", (rid, float(value))))
        return len(rewards)

    def reward(self, rollout_id: str) -> float | None:
        with self._lock:
            return self.rewards.get(rollout_id)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            kind, payload = item
            del item
            if kind == "release":
                del payload
                continue
            if kind == "rollout":
                self._rollout(*payload)
                continue
            for fn in list(self.on_reward):
                try:
                    fn(*payload)
                except Exception:
                    logger.exception("reward callback %r failed", fn)

    def _rollout(self, record: RolloutRecord, stored: Stored) -> None:
        for fn in list(self.on_rollout_finished):
            try:
                fn(record)
            except Exception:
                logger.exception("rollout callback %r failed", fn)
                self._lost()
        store = self.rollout_store
        if store is None:
            stored()
            return
        try:
            store(record, stored)
        except Exception:  # the client still gets its sample; the loss is counted
            logger.exception("rollout store %r failed for %s", store, record.rollout_id)
            self._lost()
            stored()

    def _lost(self) -> None:
        if self.on_rollout_lost is not None:
            self.on_rollout_lost()
