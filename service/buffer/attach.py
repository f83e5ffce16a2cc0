"""Wiring a buffer to a server: its hooks (finished rollouts, rewards) and its metrics."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.backend.hooks import Hooks
from service.buffer.config import BufferConfig
from service.buffer.memory import MemoryBuffer
from service.buffer.redis_buffer import RedisBuffer

logger = logging.getLogger(__name__)

P = "specroll:"


class BufferCollector(Collector):
    """The buffer's counters in the server's registry, read at scrape time."""

    def __init__(self, buffer: RedisBuffer | MemoryBuffer) -> None:
        self.buffer = buffer

    def collect(self) -> Iterator[Metric]:
        s = self.buffer.stats()
        written = CounterMetricFamily(P + "buffer_written", "Records the buffer stored, by kind", labels=["kind"])
        written.add_metric(["rollout"], s["written_rollouts"])
        written.add_metric(["reward"], s["written_rewards"])
        yield written
        dropped = CounterMetricFamily(P + "buffer_dropped", "Records lost, by reason", labels=["reason"])
        dropped.add_metric(["spool_full"], s.get("dropped", 0))
        dropped.add_metric(["memory_evicted"], s.get("evicted", 0))
        dropped.add_metric(["spool_corrupt"], s.get("corrupt", 0))
        for key in sorted(k for k in s if k.startswith("lost_")):
            dropped.add_metric([key.removeprefix("lost_")], s[key])
        yield dropped
        for name, doc, key in (("buffer_spooled", "Records written to the local spool", "spooled"),
                               ("buffer_replayed", "Spooled records replayed into Redis", "replayed"),
                               ("buffer_write_errors", "Failed Redis writes (retried)", "write_errors"),
                               ("buffer_spool_corrupt", "Torn or corrupt stretches of the spool skipped (each lost a "
                                "record or more)", "corrupt"),
                               ("buffer_spool_errors", "Failed spool writes or fsyncs (records may be lost)",
                                "spool_errors"),
                               ("buffer_writer_errors", "Unexpected failures of the buffer's writer (retried)",
                                "writer_errors"),
                               ("buffer_redis_data_lost", "Times Redis was found to have lost its data (marker "
                                "key gone: FLUSHALL, a restart without persistence)", "redis_data_lost")):
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], s.get(key, 0))
            yield c
        pending = s.get("queued", 0) + s.get("spool_records", 0)
        for name, doc, value in (("buffer_pending", "Records not yet in Redis (queue + spool)", pending),
                                 ("buffer_spool_bytes", "Bytes in the local spool", s.get("spool_bytes", 0)),
                                 ("buffer_redis_up", "1 while the last Redis write succeeded", s.get("redis_up", 1)),
                                 ("buffer_spool_disk_full", "1 while the spool's file system has no room for "
                                  "the records it must keep", s.get("spool_disk_full", 0)),
                                 ("buffer_memory_entries", "Entries in the in-process buffer",
                                  s.get("memory_entries", 0))):
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], value)
            yield g


def attach_buffer(cfg: BufferConfig, hooks: Hooks, registry: CollectorRegistry) -> RedisBuffer | MemoryBuffer | None:
    """Create the buffer `cfg` asks for and hook it to finished rollouts and rewards. Without Redis and without
    the in-process trainer no rollouts are kept (nothing would read them)."""
    if not cfg.redis_url and not cfg.embedded_trainer:
        return None
    buffer: RedisBuffer | MemoryBuffer
    if cfg.redis_url:
        buffer = RedisBuffer(cfg)
        logger.info("rollouts go to Redis stream %r (spool %s)", cfg.stream, cfg.spool_path())
        hooks.rollout_store = buffer.on_rollout  # a sample's final message waits until it is stored
    else:
        buffer = MemoryBuffer(cfg.memory_maxlen, cfg.top_k)
        hooks.on_rollout_finished.append(buffer.on_rollout)
    hooks.on_reward.append(buffer.on_reward)
    registry.register(BufferCollector(buffer))
    return buffer
