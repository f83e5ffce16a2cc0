"""Callbacks for finished rollouts and reported rewards, run on their own thread (never the engine's).

The rollout buffer plugs in here: ``hooks.on_rollout_finished.append(fn)`` gets every finished sample as a
:class:`RolloutRecord`, ``hooks.on_reward.append(fn)`` every reported ``(rollout_id, reward)``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from service.api.events import RolloutRecord

logger = logging.getLogger(__name__)

RolloutCallback = Callable[[RolloutRecord], None]
RewardCallback = Callable[[str, float], None]


class Hooks:
    def __init__(self, max_rewards: int = 100_000) -> None:
        self.on_rollout_finished: list[RolloutCallback] = []
        self.on_reward: list[RewardCallback] = []
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

    def rollout_finished(self, record: RolloutRecord) -> None:
        if self.on_rollout_finished:
            self._q.put(("rollout", record))

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
            callbacks: list[Any] = self.on_rollout_finished if kind == "rollout" else self.on_reward
            for fn in list(callbacks):
                try:
                    fn(payload) if kind == "rollout" else fn(*payload)
                except Exception:
                    logger.exception("%s callback %r failed", kind, fn)
                    if kind == "rollout" and self.on_rollout_lost is not None:
                        self.on_rollout_lost()
