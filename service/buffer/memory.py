"""The embedded buffer (no --redis-url): the same entries as the Redis stream, kept in process memory.

Entries carry the same fields and payload as stream entries and ids of the same shape ("<n>-0"), so the
in-process drafter trainer runs the code it runs against Redis. Bounded: the oldest entries are evicted
(counted in `evicted`) like an XADD MAXLEN trim.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from service.buffer.codec import entry_fields, payload_of


class MemoryBuffer:
    def __init__(self, maxlen: int = 20_000, top_k: int = 0, max_rewards: int = 100_000) -> None:
        self.maxlen, self.top_k, self.max_rewards = maxlen, top_k, max_rewards
        self._entries: deque[tuple[int, dict[str, Any]]] = deque()
        self._rewards: OrderedDict[str, float] = OrderedDict()
        self._cond = threading.Condition()
        self._next = 1
        self.written = {"rollout": 0, "reward": 0}
        self.evicted = 0

    def on_rollout(self, record: Any) -> None:
        self.add_fields(entry_fields(payload_of(record, self.top_k)))

    def add_fields(self, fields: dict[str, Any]) -> str:
        with self._cond:
            entry_id = self._next
            self._next += 1
            self._entries.append((entry_id, fields))
            while len(self._entries) > self.maxlen:
                self._entries.popleft()
                self.evicted += 1
            self.written["rollout"] += 1
            self._cond.notify_all()
        return f"{entry_id}-0"

    def on_reward(self, rollout_id: str, reward: float) -> None:
        with self._cond:
            self._rewards[rollout_id] = float(reward)
            self._rewards.move_to_end(rollout_id)
            while len(self._rewards) > self.max_rewards:
                self._rewards.popitem(last=False)
            self.written["reward"] += 1

    def read_after(self, last: int, count: int, timeout_s: float = 0.0) -> list[tuple[str, dict[str, Any]]]:
        """Up to `count` entries with ids above `last`, waiting up to timeout_s for one."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not (self._entries and self._entries[-1][0] > last):
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            start = max(0, last - self._entries[0][0] + 1)  # ids are consecutive
            return [(f"{i}-0", f) for i, f in itertools.islice(self._entries, start, start + count)]

    def backlog(self, last: int) -> int:
        with self._cond:
            return max(0, self._next - 1 - max(last, self._entries[0][0] - 1)) if self._entries else 0

    def rewards(self, rollout_ids: list[str]) -> dict[str, float]:
        with self._cond:
            return {r: self._rewards[r] for r in rollout_ids if r in self._rewards}

    def close(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def stats(self) -> dict[str, float]:
        with self._cond:
            return {"written_rollouts": self.written["rollout"], "written_rewards": self.written["reward"],
                    "memory_entries": len(self._entries), "evicted": self.evicted}
