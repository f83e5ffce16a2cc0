"""Which rollouts the trainer has taken in, and which stream entries it may ack.

A rollout is taken in when first read: its id is *pending* with its role (train, eval = held out,
skip = nothing to learn from) and its entry is *held*. `settle` (called right before a checkpoint) moves the
pending ids into the persisted ledger and hands back the held entries, to be acked once that checkpoint is
on disk. Ids already in the ledger or pending are duplicates (redeliveries, at-least-once writes). The
ledger keeps the newest `window` ids; `taken_total` counts every id ever settled.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class Ledger:
    def __init__(self, window: int) -> None:
        self.window = window
        self.ids: OrderedDict[str, str] = OrderedDict()
        self.pending: dict[str, str] = {}
        self.held: list[str] = []
        self.taken_total = 0

    def seen(self, rollout_id: str) -> str | None:
        """"settled", "pending" or None."""
        if rollout_id in self.ids:
            return "settled"
        return "pending" if rollout_id in self.pending else None

    def take(self, rollout_id: str, role: str, entry_id: str) -> None:
        self.pending[rollout_id] = role
        self.held.append(entry_id)

    def hold(self, entry_id: str) -> None:
        self.held.append(entry_id)

    def settle(self) -> list[str]:
        self.ids.update(self.pending)
        self.taken_total += len(self.pending)
        self.pending.clear()
        while len(self.ids) > self.window:
            self.ids.popitem(last=False)
        held, self.held = self.held, []
        return held

    def state(self) -> dict[str, Any]:
        return {"taken_total": self.taken_total, "ledger": list(self.ids.items())}

    def load(self, state: dict[str, Any]) -> None:
        self.taken_total = int(state["taken_total"])
        self.ids = OrderedDict((rid, role) for rid, role in state["ledger"])
