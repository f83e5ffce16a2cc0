"""The rollout buffer: every finished rollout (and every reported reward) leaves the server here.

With a Redis URL: `RedisBuffer` (stream + local spool). Without: `MemoryBuffer`, read by the drafter
trainer running in the server process (`specroll serve` does that by default). `attach_buffer` wires either
into a server's hooks and metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.buffer.codec import BufferedRollout, PayloadError, decode_entry, entry_fields, payload_of
from service.buffer.config import BufferConfig, add_buffer_args, buffer_config_from_args
from service.buffer.memory import MemoryBuffer
from service.buffer.redis_buffer import RedisBuffer
from service.buffer.spool import Spool

if TYPE_CHECKING:
    from service.app import SpecrollServer

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
        yield dropped
        for name, doc, key in (("buffer_spooled", "Records written to the local spool", "spooled"),
                               ("buffer_replayed", "Spooled records replayed into Redis", "replayed"),
                               ("buffer_write_errors", "Failed Redis writes (retried)", "write_errors"),
                               ("buffer_spool_corrupt", "Torn spool records found at start", "corrupt"),
                               ("buffer_spool_errors", "Failed spool writes or fsyncs (records may be lost)",
                                "spool_errors")):
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], s.get(key, 0))
            yield c
        pending = s.get("queued", 0) + s.get("spool_records", 0)
        for name, doc, value in (("buffer_pending", "Records not yet in Redis (queue + spool)", pending),
                                 ("buffer_spool_bytes", "Bytes in the local spool", s.get("spool_bytes", 0)),
                                 ("buffer_redis_up", "1 while the last Redis write succeeded", s.get("redis_up", 1)),
                                 ("buffer_memory_entries", "Entries in the in-process buffer",
                                  s.get("memory_entries", 0))):
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], value)
            yield g


class BufferAttachment:
    """The buffer of one server (None: rollouts are not kept) and, embedded, its in-process drafter trainer."""

    def __init__(self, buffer: RedisBuffer | MemoryBuffer | None, trainer: Any = None) -> None:
        self.buffer = buffer
        self.trainer = trainer

    def stop_trainer(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()
            self.trainer = None

    def close(self) -> None:
        self.stop_trainer()
        if self.buffer is not None:
            self.buffer.close()


def attach_buffer(server: SpecrollServer) -> BufferAttachment:
    """Create the buffer a server's config asks for and hook it to finished rollouts and rewards. Without Redis
    and without the in-process trainer no rollouts are kept (nothing would read them)."""
    sc = server.config
    cfg: BufferConfig = sc.buffer or BufferConfig(redis_url=sc.redis_url, embedded_trainer=False)
    if cfg.redis_url is None and sc.redis_url:
        cfg.redis_url = sc.redis_url
    if not cfg.redis_url and not cfg.embedded_trainer:
        return BufferAttachment(None)
    buffer: RedisBuffer | MemoryBuffer
    if cfg.redis_url:
        buffer = RedisBuffer(cfg)
        logger.info("rollouts go to Redis stream %r (spool %s)", cfg.stream, cfg.spool_path())
    else:
        buffer = MemoryBuffer(cfg.memory_maxlen, cfg.top_k)
    if isinstance(buffer, RedisBuffer):
        server.hooks.rollout_store = buffer.on_rollout  # a sample's final message waits until it is stored
    else:
        server.hooks.on_rollout_finished.append(buffer.on_rollout)
    server.hooks.on_reward.append(buffer.on_reward)
    server.metrics.registry.register(BufferCollector(buffer))
    trainer = None
    if isinstance(buffer, MemoryBuffer) and cfg.embedded_trainer:
        from drafter_trainer.config import TrainerConfig
        from drafter_trainer.embedded import EmbeddedTrainer

        trainer_cfg = cfg.trainer
        if trainer_cfg is None:
            gate = cfg.trainer_gate
            if gate == "auto":
                gate = "idle" if str(server.engine_config.device).startswith("cpu") else "tail"
            trainer_cfg = TrainerConfig(consumer="in-process", gate=gate)
        trainer = EmbeddedTrainer(server, buffer, cfg.trainer_dir, trainer_cfg)
        trainer.start()
    return BufferAttachment(buffer, trainer)


__all__ = [
    "BufferAttachment", "BufferCollector", "BufferConfig", "BufferedRollout", "MemoryBuffer", "PayloadError",
    "RedisBuffer", "Spool", "add_buffer_args", "attach_buffer", "buffer_config_from_args", "decode_entry",
    "entry_fields", "payload_of",
]
