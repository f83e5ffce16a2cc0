"""Finished rollouts into a Redis stream, without ever making generation wait for Redis.

The hooks thread hands records to `submit`, which only appends to an in-memory queue (or the spool file)
and returns. A writer thread sends the queue to Redis in pipelined batches and removes records only once
Redis took them. While Redis is down or slow, records go to the spool until the writer has replayed all
of it, so records reach Redis in the order they were submitted. Delivery is at-least-once: consumers
dedupe on rollout id. At shutdown whatever could not be written is kept in the spool for the next start.

Durability: a record's `stored` callback runs once the record is in Redis or fsync'd in the spool, and the
server sends a sample's final message only then, so a rollout a client received survives a kill -9. No
failure stops that: a record neither Redis nor the spool can take is counted as lost by reason and its
callback still runs; the writer survives any exception. A marker key in Redis shows when Redis lost its
data. docs/buffer.md tells the whole story.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

from service.buffer.codec import entry_fields, payload_of, spool_reward, spool_rollout
from service.buffer.config import BufferConfig
from service.buffer.spool import Spool, loss_reason
from service.protogen import pb2

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 2.0


Stored = Callable[[], None]


def _noop() -> None:
    return None


class RedisBuffer:
    def __init__(self, config: BufferConfig, client: redis.Redis | None = None) -> None:
        if not config.redis_url and client is None:
            raise ValueError("RedisBuffer needs a redis_url")
        self.config = config
        self.redis = client or redis.Redis.from_url(
            config.redis_url or "", socket_timeout=config.socket_timeout_s,
            socket_connect_timeout=config.socket_timeout_s)
        self.spool = Spool(config.spool_path(), config.spool_max_bytes, config.spool_segment_bytes,
                           config.spool_full)
        self.written = {"rollout": 0, "reward": 0}
        self.write_errors = 0
        self.spool_errors = 0
        self.writer_errors = 0  # unexpected failures of the writer thread (it carries on)
        self.lost: dict[str, int] = {"undecodable": 0}  # records lost outside the spool's own count, by reason
        self.redis_data_lost = 0  # times the marker key showed that Redis lost its data
        self._epoch = uuid.uuid4().hex.encode()  # this buffer's marker value, set when none is there
        self._marker: bytes | None = None  # the marker value Redis showed last
        self._writes = 0
        self._spill_failing = False  # the queue could not move to the spool last time (logged once)
        self.redis_up = True
        self._q: deque[tuple[bytes, Stored]] = deque()
        self._unsynced: list[Stored] = []  # spooled, waiting for the next fsync
        self._cond = threading.Condition()
        self._spooling = len(self.spool) > 0  # records from a previous run go out first
        self._retry_at = 0.0  # no Redis write before this (monotonic) after a failure
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specroll-buffer", daemon=True)
        self._thread.start()

    # -- producer side (hooks thread) -------------------------------------------------------------
    def on_rollout(self, record: Any, stored: Stored = _noop) -> None:
        self.submit(spool_rollout(payload_of(record, self.config.top_k)), stored)

    def on_reward(self, rollout_id: str, reward: float) -> None:
        self.submit(spool_reward(rollout_id, reward))

    def submit(self, data: bytes, stored: Stored = _noop) -> None:
        """Never blocks on Redis: queue the record, or spool it while Redis is behind. `stored` is called
        (on the writer thread) once the record is in Redis or fsync'd in the spool, or once it is counted as
        lost: it is always called, so a sample's final message never waits on a failing disk."""
        with self._cond:
            if not self._thread.is_alive():  # closed (the writer catches everything else): never block
                self._lost("closed" if self._stopping else "writer_dead", 1)
                stored()
                return
            if not self._spooling and len(self._q) < self.config.queue_max and not self._stopping:
                self._q.append((data, stored))
                self._cond.notify()
                return
            if not self._spooling:
                logger.warning("Redis is behind (%d records queued): spooling rollouts to %s", len(self._q),
                               self.spool.path)
                self._spooling = True
            try:
                self.spool.append(data)  # a drop or a failed write is counted by the spool
            except Exception:
                self._lost("spool_error", 1)
                logger.exception("cannot write to the spool %s: a record is lost", self.spool.path)
            self._unsynced.append(stored)
            self._cond.notify()

    @property
    def queued(self) -> int:
        return len(self._q)

    def lost_count(self) -> int:
        """Records lost to a failing spool or an undecodable record (not the full-spool policy's drops)."""
        return sum(self.spool.lost.values()) + sum(self.lost.values())

    def _lost(self, reason: str, n: int) -> None:
        self.lost[reason] = self.lost.get(reason, 0) + n

    # -- writer thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        """Never ends but at close: any failure is counted, logged and retried after a back-off."""
        backoff = 0.05
        while True:
            try:
                done, backoff = self._step(backoff)
                if done:
                    return
            except Exception:
                self.writer_errors += 1
                logger.exception("rollout buffer writer failed; retrying in %.2f s", backoff)
                self._release_queue()
                self._retry_at = time.monotonic() + backoff
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                if self._stopping:
                    return

    def _step(self, backoff: float) -> tuple[bool, float]:
        """One round of the writer: (stop now, next back-off)."""
        with self._cond:
            while not self._unsynced and not self._stopping and (
                    (not self._q and not self._spooling) or time.monotonic() < self._retry_at):
                self._cond.wait(max(0.001, min(0.5, self._retry_at - time.monotonic())))
            stored, self._unsynced = self._unsynced, []
            if self._stopping and not self._q and not len(self.spool):
                self._sync(stored)
                return True, backoff
            from_queue = bool(self._q)
            batch = list(itertools.islice(self._q, self.config.batch_size)) if from_queue else []
        self._sync(stored)
        if time.monotonic() < self._retry_at:
            return self._stopping, backoff
        records = [data for data, _ in batch] if from_queue else self.spool.peek(self.config.batch_size)
        if not from_queue and records:
            self.spool.fault("replay:peeked")
        if records and not self._write(records):
            if self._stopping:
                return True, backoff
            self._spill_queue()
            self._retry_at = time.monotonic() + backoff
            return False, min(backoff * 2, MAX_BACKOFF_S)
        if not from_queue and records:
            self.spool.fault("replay:written")
        with self._cond:
            if from_queue:
                for _ in batch:
                    self._q.popleft()
            else:
                self.spool.commit(len(records))
            if self._spooling and not self._q and not len(self.spool):
                logger.info("spool replayed: writing to Redis directly again")
                self._spooling = False
        for _, done in batch:
            self._call(done)
        return False, 0.05

    def _sync(self, stored: list[Stored]) -> None:
        if not stored:
            return
        try:
            self.spool.sync()
        except Exception:
            self.spool_errors += 1
            logger.exception("cannot fsync the spool %s", self.spool.path)
        for done in stored:
            self._call(done)

    def _release_queue(self) -> None:
        """Records stay queued, but their clients get their final messages now (they are not durable)."""
        with self._cond:
            waiting = [done for _, done in self._q if done is not _noop]
            if waiting:
                self._q = deque((data, _noop) for data, _ in self._q)
        for done in waiting:
            self._call(done)

    def _spill_queue(self) -> None:
        """Redis failed: move the queue, in order, in front of everything spooled, durably. When the spool
        cannot take it (a full disk), the queue stays in memory and is retried; its clients are not held."""
        with self._cond:
            left = list(self._q)
            if left:
                self._spooling = True
        if not left:
            return
        try:
            self.spool.prepend([data for data, _ in left])
        except Exception as exc:
            self.spool_errors += 1
            if not self._spill_failing:
                logger.warning("cannot spool %d queued records (%s): they stay in memory until Redis is back",
                               len(left), exc)
            self._spill_failing = True
            self._release_queue()
            return
        self._spill_failing = False
        with self._cond:
            for _ in left:
                self._q.popleft()
        for _, done in left:
            self._call(done)

    @staticmethod
    def _call(done: Stored) -> None:
        try:
            done()
        except Exception:
            logger.exception("stored-callback failed")

    def _write(self, batch: list[bytes]) -> bool:
        cfg = self.config
        try:
            pipe = self.redis.pipeline(transaction=False)
            kinds = []
            for data in batch:
                try:
                    rec = pb2.SpoolRecord.FromString(data)
                    kind = rec.WhichOneof("kind")
                    if kind == "rollout":
                        pipe.xadd(cfg.stream, entry_fields(rec.rollout), maxlen=cfg.maxlen, approximate=True)
                    elif kind == "reward":
                        pipe.set(cfg.rewards_prefix + rec.reward.rollout_id, repr(rec.reward.reward),
                                 ex=cfg.reward_ttl_s)
                    else:
                        raise ValueError(f"no record kind ({kind!r})")
                    kinds.append(kind)
                except Exception as exc:  # a record nothing can write: counted, skipped
                    self._lost("undecodable", 1)
                    logger.error("dropping an undecodable buffer record (%d bytes): %s", len(data), exc)
            self._writes += 1  # a value never set before: a marker set afresh always differs from the last
            pipe.set(cfg.marker_key, b"%s:%d" % (self._epoch, self._writes), nx=True)
            pipe.get(cfg.marker_key)
            results = pipe.execute()
        except Exception as exc:
            self.write_errors += 1
            if self.redis_up:
                logger.warning("cannot write to Redis (%s); keeping rollouts until it is back", exc,
                               exc_info=not isinstance(exc, redis.RedisError))
            self.redis_up = False
            return False
        if not self.redis_up:
            logger.info("Redis is reachable again")
        self.redis_up = True
        self._check_marker(results[-1])
        for kind in kinds:
            if kind in self.written:
                self.written[kind] += 1
        return True

    def _check_marker(self, seen: bytes | None) -> None:
        """Redis keeps a marker key the buffer set; when it is gone or replaced, Redis lost its data."""
        if self._marker is not None and seen != self._marker:
            self.redis_data_lost += 1
            logger.error("Redis lost its data: the marker key %r is %s (a FLUSHALL, or a restart without "
                         "persistence); rollouts written to %r before may be gone", self.config.marker_key,
                         "gone" if seen is None else "replaced", self.config.stream)
        self._marker = seen

    # -- shutdown -----------------------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far reached Redis; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cond:
                if not self._q and not self._spooling and not self._unsynced:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Write what Redis takes within close_timeout_s; spool the rest for the next start."""
        self.flush(self.config.close_timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(self.config.close_timeout_s + 2 * self.config.socket_timeout_s)
        with self._cond:
            left = list(self._q)
            self._q.clear()
            stored, self._unsynced = self._unsynced, []
        try:
            if left:
                logger.warning("Redis unreachable at shutdown: %d records kept in the spool %s", len(left),
                               self.spool.path)
                self.spool.prepend([data for data, _ in left])
        except Exception as exc:
            self._lost(loss_reason(exc), len(left))
            logger.error("cannot spool %d records at shutdown (%s): they are lost", len(left), exc)
        try:
            self.spool.close()
        except Exception:
            self.spool_errors += 1
            logger.exception("cannot close the spool %s", self.spool.path)
        for done in [*stored, *(done for _, done in left)]:
            self._call(done)
        self.redis.close()

    def degraded(self) -> list[str]:
        """Why the buffer is not keeping rollouts as it should right now (empty when all is well)."""
        reasons = []
        if not self.redis_up:
            reasons.append("redis_down")
        if self.spool.disk_full:
            reasons.append("spool_disk_full")
        elif self.spool.failing:
            reasons.append("spool_failing")
        return reasons

    def stats(self) -> dict[str, float]:
        return {"written_rollouts": self.written["rollout"], "written_rewards": self.written["reward"],
                "spooled": self.spool.spooled, "replayed": self.spool.replayed, "dropped": self.spool.dropped,
                "spool_records": len(self.spool), "spool_bytes": self.spool.nbytes, "queued": len(self._q),
                "write_errors": self.write_errors, "redis_up": 1.0 if self.redis_up else 0.0,
                "corrupt": self.spool.corrupt, "spool_errors": self.spool_errors,
                "spool_disk_full": 1.0 if self.spool.disk_full else 0.0, "writer_errors": self.writer_errors,
                "redis_data_lost": self.redis_data_lost,
                **{f"lost_{k}": v for k, v in self.spool.lost.items()},
                **{f"lost_{k}": self.spool.lost.get(k, 0) + v for k, v in self.lost.items()}}
