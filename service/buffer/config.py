"""Settings of the rollout buffer, and the `specroll serve` flags that set them."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config import default_cache_root

SPOOL_FULL_POLICIES = ("drop_oldest", "drop_newest")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SPECROLL_{name.upper()}", default)


@dataclass(slots=True)
class BufferConfig:
    """Where finished rollouts go.

    With `redis_url` they are appended to the Redis stream `stream` (XADD MAXLEN ~ `maxlen`); while Redis is
    down or slow they are spooled to files under `spool_dir`, at most `spool_max_bytes`, and replayed in order
    when it is back. When the spool is full, `spool_full` decides: ``drop_oldest`` (default) deletes the
    oldest spool segment, ``drop_newest`` refuses the new record; either way the dropped records are counted
    in ``specroll:buffer_dropped_total{reason="spool_full"}`` (records a failing disk loses: reason
    ``disk_full`` or ``spool_error``; docs/buffer.md). Without `redis_url` rollouts are kept in a
    bounded in-process buffer (`memory_maxlen`) that the in-process drafter trainer reads.
    """

    redis_url: str | None = None
    stream: str = "specroll:rollouts"
    maxlen: int = 100_000
    top_k: int = 0  # 0: no top-k logprobs in payloads; else keep up to this many per token when recorded
    reward_ttl_s: int = 7 * 24 * 3600
    spool_dir: str | None = None  # default: $SPECROLL_CACHE/spool/<stream>
    spool_max_bytes: int = 1 << 30
    spool_segment_bytes: int = 8 << 20
    spool_full: str = "drop_oldest"
    queue_max: int = 1024  # records held in memory for the Redis writer before spilling to the spool
    batch_size: int = 256  # records per XADD pipeline
    socket_timeout_s: float = 2.0
    close_timeout_s: float = 5.0
    memory_maxlen: int = 20_000
    embedded_trainer: bool = True  # without redis_url: run the drafter trainer in the server process
    trainer_dir: str | None = None  # embedded trainer checkpoints (None: no checkpoints)
    trainer: Any = None  # a drafter_trainer.TrainerConfig for the embedded trainer (None: defaults)
    trainer_gate: str = "auto"  # the embedded trainer's gate when `trainer` is None (auto: by device)

    def __post_init__(self) -> None:
        if self.trainer_gate not in ("auto", "always", "tail", "idle"):
            raise ValueError(f"trainer_gate must be auto, always, tail or idle, got {self.trainer_gate!r}")
        if self.spool_full not in SPOOL_FULL_POLICIES:
            raise ValueError(f"spool_full must be one of {SPOOL_FULL_POLICIES}, got {self.spool_full!r}")
        if self.maxlen < 1 or self.queue_max < 1 or self.batch_size < 1:
            raise ValueError("buffer maxlen, queue_max and batch_size must be >= 1")
        if self.spool_max_bytes < self.spool_segment_bytes:
            raise ValueError("spool_max_bytes must be at least one segment (spool_segment_bytes)")

    @property
    def rewards_prefix(self) -> str:
        return f"{self.stream}:reward:"

    @property
    def marker_key(self) -> str:
        """A key the buffer keeps in Redis: when it disappears, Redis lost its data (FLUSHALL, a restart
        without persistence), counted in ``specroll:buffer_redis_data_lost_total``."""
        return f"{self.stream}:marker"

    def spool_path(self) -> Path:
        if self.spool_dir:
            return Path(self.spool_dir)
        return default_cache_root() / "spool" / self.stream.replace(":", "_").replace("/", "_")


def add_buffer_args(p: argparse.ArgumentParser) -> None:
    """The buffer flags of `specroll serve` (--redis-url is defined by the serve command itself)."""
    g = p.add_argument_group("rollout buffer")
    g.add_argument("--buffer-stream", default=_env("buffer_stream", "specroll:rollouts"), help="Redis stream key")
    g.add_argument("--buffer-maxlen", type=int, default=int(_env("buffer_maxlen", "100000")),
                   help="approximate MAXLEN of the stream")
    g.add_argument("--buffer-top-k", type=int, default=int(_env("buffer_top_k", "0")),
                   help="keep up to K top logprobs per token in payloads, when the request recorded them (large)")
    g.add_argument("--spool-dir", default=_env("spool_dir"), help="local spool while Redis is down")
    g.add_argument("--spool-max-mb", type=int, default=int(_env("spool_max_mb", "1024")))
    g.add_argument("--spool-full", choices=SPOOL_FULL_POLICIES, default=_env("spool_full", "drop_oldest"),
                   help="what a full spool drops (counted in specroll:buffer_dropped_total)")
    g.add_argument("--no-drafter-trainer", action="store_true",
                   help="without --redis-url, do not run the drafter trainer in-process")
    g.add_argument("--trainer-dir", default=_env("trainer_dir"), help="checkpoints of the in-process trainer")
    g.add_argument("--drafter-trainer-gate", choices=("auto", "always", "tail", "idle"),
                   default=_env("drafter_trainer_gate", "auto"),
                   help="when the in-process trainer may train: in the long tail (few sequences running), only "
                        "when the engine is idle, or always; auto = tail on CUDA, idle on CPU (where training "
                        "would take cores from decoding)")


def buffer_config_from_args(args: argparse.Namespace) -> BufferConfig:
    return BufferConfig(
        redis_url=args.redis_url or None, stream=args.buffer_stream, maxlen=args.buffer_maxlen,
        top_k=args.buffer_top_k, spool_dir=args.spool_dir, spool_max_bytes=args.spool_max_mb << 20,
        spool_segment_bytes=min(8 << 20, args.spool_max_mb << 20), spool_full=args.spool_full,
        embedded_trainer=not args.no_drafter_trainer, trainer_dir=args.trainer_dir,
        trainer_gate=getattr(args, "drafter_trainer_gate", "auto"),
    )
