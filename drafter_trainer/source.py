"""Where rollouts come from: a Redis consumer group (sidecar) or the server's in-process buffer (embedded).

Redis: new entries with XREADGROUP ">"; this consumer's own pending entries from before a restart first
(XREADGROUP "0"); entries a crashed consumer left pending are taken over with XAUTOCLAIM once idle for
`claim_idle_ms`. An entry whose processing failed stays pending and comes back the same way; its
`max_deliveries`-th failure (or a claim past that many deliveries: a consumer crashed on it each time)
copies it to the dead-letter stream and acks it, in one MULTI; an entry that cannot be a rollout (it failed to
decode, which no retry changes) is dead-lettered at once. Entries this consumer holds (read, not yet
acked) are re-claimed with JUSTID before every XAUTOCLAIM, which resets their idle time without counting a
delivery, so they are not taken over while being worked on (claim_idle_ms must exceed a training round).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from drafter_trainer.config import TrainerConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Entry:
    entry_id: str
    fields: Mapping[Any, Any]
    deliveries: int = 1


def _ignore(kind: str) -> None:
    return None


class Source(Protocol):
    dead_lettered: int
    claimed: int
    on_dead_letter: Callable[[str], None]  # called with the fault's kind (a metric label) for each dead letter

    def read(self, count: int, block_ms: int) -> list[Entry]: ...

    def ack(self, entry_ids: list[str]) -> None: ...

    def fail(self, entry: Entry, reason: str, kind: str = "error") -> None: ...

    def dead_letter(self, entry: Entry, reason: str, kind: str) -> None: ...

    def lag(self) -> tuple[int, int]: ...

    def rewards(self, rollout_ids: list[str]) -> dict[str, float]: ...


def _sid(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class RedisSource:
    def __init__(self, client: redis.Redis, cfg: TrainerConfig, start_id: str = "0") -> None:
        self.r, self.cfg = client, cfg
        self.stream, self.group, self.consumer = cfg.stream, cfg.group, cfg.consumer
        self.dead_lettered = self.claimed = self.trimmed = 0
        self.on_dead_letter: Callable[[str], None] = _ignore
        self._own_done = False
        self._own_cursor = "0"
        self._cursor = "0-0"
        self._next_claim = 0.0
        self._failures: dict[str, tuple[str, str]] = {}  # entry id -> (reason, kind) of its last failure
        self._inflight: set[str] = set()  # delivered to us, not yet acked or failed
        try:
            self.r.xgroup_create(self.stream, self.group, id=start_id, mkstream=True)
            logger.info("created consumer group %r on %r", self.group, self.stream)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, block_ms: int) -> list[Entry]:
        out: list[Entry] = []
        if not self._own_done:  # what this consumer name held when it last stopped, after a cursor
            resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: self._own_cursor}, count=count)
            out = self._entries(resp)
            if len(out) < count:
                self._own_done = True
            if out:
                self._own_cursor = out[-1].entry_id
                logger.info("resuming %d entries this consumer had pending", len(out))
                out = self._with_deliveries(out)
                self._inflight.update(e.entry_id for e in out)
                return out
        if time.monotonic() >= self._next_claim:
            out += self._claim(count)
        if len(out) < count:
            resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count - len(out),
                                     block=None if out else block_ms)
            out += self._entries(resp)
        self._inflight.update(e.entry_id for e in out)
        return out

    def _entries(self, resp: Any) -> list[Entry]:
        out, gone = [], []
        for _stream, items in resp or []:
            for entry_id, fields in items:
                if fields is None:  # trimmed away (MAXLEN) while pending
                    gone.append(_sid(entry_id))
                else:
                    out.append(Entry(_sid(entry_id), fields))
        if gone:
            self.trimmed += len(gone)
            self.r.xack(self.stream, self.group, *gone)
        return out

    def _claim(self, count: int) -> list[Entry]:
        self._next_claim = time.monotonic() + max(self.cfg.claim_idle_ms / 4000, 0.1)
        self._refresh(sorted(self._inflight, key=_key))
        resp = self.r.xautoclaim(self.stream, self.group, self.consumer, self.cfg.claim_idle_ms,
                                 start_id=self._cursor, count=count)
        self._cursor = _sid(resp[0])
        if len(resp) > 2 and resp[2]:
            self.trimmed += len(resp[2])  # XAUTOCLAIM already removed them from the PEL
        entries = [Entry(_sid(i), f) for i, f in resp[1] if f is not None]
        if not entries:
            return []
        self.claimed += len(entries)
        logger.info("took over %d pending entries idle for over %d ms", len(entries), self.cfg.claim_idle_ms)
        kept = []
        for e in self._with_deliveries(entries):
            if e.deliveries > self.cfg.max_deliveries:
                self.dead_letter(e, *self._failures.pop(e.entry_id, ("delivered too often", "deliveries")))
            else:
                kept.append(e)
        return kept

    def _with_deliveries(self, entries: list[Entry]) -> list[Entry]:
        ids = [e.entry_id for e in entries]
        rows = self.r.xpending_range(self.stream, self.group, min=min(ids, key=_key), max=max(ids, key=_key),
                                     count=len(ids) + 1000, consumername=self.consumer)
        counts = {_sid(r["message_id"]): int(r["times_delivered"]) for r in rows}
        for e in entries:
            e.deliveries = counts.get(e.entry_id, 1)
        return entries

    def dead_letter(self, e: Entry, reason: str, kind: str) -> None:
        """Copy the entry to the dead-letter stream with why (its fields as they were, bytes included) and ack it."""
        fields: dict[Any, Any] = dict(e.fields)
        fields.update({"dl_entry_id": e.entry_id, "dl_reason": reason[:500], "dl_kind": kind,
                       "dl_deliveries": str(e.deliveries), "dl_consumer": self.consumer, "dl_at": repr(time.time())})
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.cfg.dead_letter_stream, fields)
        pipe.xack(self.stream, self.group, e.entry_id)
        pipe.execute()
        self._inflight.discard(e.entry_id)
        self.dead_lettered += 1
        self.on_dead_letter(kind)
        logger.warning("entry %s dead-lettered to %r after %d deliveries (%s): %s", e.entry_id,
                       self.cfg.dead_letter_stream, e.deliveries, kind, reason)

    def fail(self, entry: Entry, reason: str, kind: str = "error") -> None:
        """The N-th failed delivery goes to the dead-letter stream; earlier ones stay pending and are claimed
        again after claim_idle_ms."""
        self._inflight.discard(entry.entry_id)
        if entry.deliveries >= self.cfg.max_deliveries:
            self._failures.pop(entry.entry_id, None)
            self.dead_letter(entry, reason, kind)
        else:
            self._failures[entry.entry_id] = (reason, kind)

    def ack(self, entry_ids: list[str]) -> None:
        for i in range(0, len(entry_ids), 1000):
            self.r.xack(self.stream, self.group, *entry_ids[i : i + 1000])
        self._inflight.difference_update(entry_ids)

    def _refresh(self, entry_ids: list[str]) -> None:
        """Reset the idle time of entries we hold (JUSTID: no delivery is counted)."""
        for i in range(0, len(entry_ids), 1000):
            self.r.xclaim(self.stream, self.group, self.consumer, 0, entry_ids[i : i + 1000], justid=True)

    def lag(self) -> tuple[int, int]:
        for g in self.r.xinfo_groups(self.stream):
            if _sid(g.get("name")) == self.group:
                return int(g.get("lag") or 0), int(g.get("pending") or 0)
        return 0, 0

    def rewards(self, rollout_ids: list[str]) -> dict[str, float]:
        if not rollout_ids:
            return {}
        values = self.r.mget([self.cfg.rewards_prefix + r for r in rollout_ids])
        return {r: float(v) for r, v in zip(rollout_ids, values, strict=True) if v is not None}


def _key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class MemorySource:
    """Reads the server's MemoryBuffer (embedded mode): same entries, no consumer group (one process)."""

    def __init__(self, buffer: Any, max_deliveries: int = 3) -> None:
        self.buffer = buffer
        self.max_deliveries = max_deliveries
        self.dead_lettered = self.claimed = 0
        self.on_dead_letter: Callable[[str], None] = _ignore
        self.dead: list[tuple[Entry, str]] = []
        self._last = 0
        self._retry: list[Entry] = []
        self._held = 0

    def read(self, count: int, block_ms: int) -> list[Entry]:
        out, self._retry = self._retry[:count], self._retry[count:]
        if len(out) < count:
            got = self.buffer.read_after(self._last, count - len(out), 0 if out else block_ms / 1000)
            if got:
                self._last = int(got[-1][0].split("-")[0])
            out += [Entry(i, f) for i, f in got]
        self._held += len(out)
        return out

    def dead_letter(self, entry: Entry, reason: str, kind: str) -> None:
        self._held = max(0, self._held - 1)
        self.dead.append((entry, reason))
        self.dead_lettered += 1
        self.on_dead_letter(kind)
        logger.warning("entry %s dropped after %d deliveries (%s): %s", entry.entry_id, entry.deliveries, kind, reason)

    def fail(self, entry: Entry, reason: str, kind: str = "error") -> None:
        if entry.deliveries >= self.max_deliveries:
            self.dead_letter(entry, reason, kind)
        else:
            self._held = max(0, self._held - 1)
            self._retry.append(Entry(entry.entry_id, entry.fields, entry.deliveries + 1))

    def ack(self, entry_ids: list[str]) -> None:
        self._held = max(0, self._held - len(entry_ids))

    def lag(self) -> tuple[int, int]:
        return self.buffer.backlog(self._last), self._held

    def rewards(self, rollout_ids: list[str]) -> dict[str, float]:
        return dict(self.buffer.rewards(rollout_ids))
