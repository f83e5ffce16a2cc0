"""Settings of the drafter trainer and the `specroll drafter-trainer` flags that set them."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, fields

GATES = ("always", "tail", "idle")


@dataclass(slots=True)
class TrainerConfig:
    # where things are
    server: str = "127.0.0.1:50051"
    admin_token: str | None = None
    redis_url: str | None = None
    stream: str = "specroll:rollouts"
    group: str = "drafter-trainer"
    consumer: str = ""  # default: <hostname>-<pid>
    dead_letter_stream: str = ""  # default: <stream>:dead
    drafter: str | None = None  # draft-model folder | eagle | eagle:DIR; default: the server's --drafter
    target_model: str | None = None  # target folder, may hold "{version}"; default: the server's model folder
    checkpoint_dir: str | None = None
    metrics_port: int | None = None
    # consuming
    read_count: int = 64
    block_ms: int = 500
    max_deliveries: int = 3
    claim_idle_ms: int = 30_000
    lease_ttl_ms: int = 10_000  # one trainer per consumer group (lease.py); 0: no lease
    dedupe_window: int = 100_000
    # training
    k: int = 4  # draft length the accepted-length measure assumes
    lr: float | None = None  # None: 1e-4 for a drafter loaded from weights, 1e-3 for a new head (measurement.py)
    batch_rollouts: int = 16
    steps_per_round: int = 8
    micro_tokens: int = 1024  # a step and a measure run in pieces of this many tokens; the gate is checked between
    max_seq_len: int = 512
    window_rollouts: int = 2048
    recency_versions: int = 2  # policy versions kept in the window (the current one and older ones)
    stale_weight: float = 0.25  # weight of rollouts from older policy versions
    reward_alpha: float = 0.5  # 0: ignore rewards; else weight 1 + alpha * z-scored reward (clipped)
    holdout_every: int = 5  # one rollout in this many (by id hash) is held out for measuring
    heldout_max: int = 256
    min_heldout: int = 16
    measure_versions: int = 4  # the held-out measure reaches back over this many policy versions for min_heldout
    min_new: int = 16  # new training rollouts that start a round ...
    max_wait_s: float = 10.0  # ... or any new ones after this long
    push_margin: float = 0.01  # push when accepted length improves by more than this
    # when to train
    gate: str = "tail"  # always | tail (idle, or few running and none waiting) | idle
    tail_max_running: int = 8
    backoff_s: float = 0.2  # look at a busy server again after this long
    max_defer_s: float = 0.0  # > 0: train anyway after waiting this long for the gate
    info_interval_s: float = 1.0
    # freshness alarm
    alarm_ratio: float = 0.5  # stale when (L - 1) < alarm_ratio * (L_before_push - 1)
    recover_ratio: float = 0.8  # recovered when (L - 1) >= recover_ratio * (L_before_push - 1)
    # misc
    version_prefix: str = "distill"
    device: str = "cpu"
    seed: int = 0
    max_rounds: int | None = None

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {self.gate!r}")
        if self.measure_versions < 1:
            raise ValueError("measure_versions must be >= 1")
        if self.k < 1 or self.holdout_every < 2 or self.batch_rollouts < 1 or self.steps_per_round < 1:
            raise ValueError("k >= 1, holdout_every >= 2, batch_rollouts >= 1 and steps_per_round >= 1 are required")
        if self.micro_tokens < 1:
            raise ValueError("micro_tokens must be >= 1")
        if self.max_deliveries < 1:
            raise ValueError("max_deliveries must be >= 1")
        if self.lease_ttl_ms != 0 and self.lease_ttl_ms < 100:
            raise ValueError(f"lease_ttl_ms must be 0 (no lease) or >= 100, got {self.lease_ttl_ms}")
        self.consumer = self.consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.dead_letter_stream = self.dead_letter_stream or f"{self.stream}:dead"

    @property
    def rewards_prefix(self) -> str:
        return f"{self.stream}:reward:"


_HELP = {
    "server": "gRPC address of the specroll server", "redis_url": "Redis holding the rollout stream",
    "drafter": "drafter to train (default: the server's)", "target_model": "target folder ({version} allowed)",
    "gate": "train always, in the long tail, or only when idle", "k": "draft length for the accepted-length measure",
}


_SHARED_ENV = ("admin_token", "redis_url")


def add_args(p: argparse.ArgumentParser) -> None:
    """One flag per TrainerConfig field (--field-name), defaulting to SPECROLL_TRAINER_<FIELD> (SPECROLL_<FIELD>
    for the admin token and Redis URL) or the default."""
    for f in fields(TrainerConfig):
        default = f.default
        env = os.environ.get(f"SPECROLL_TRAINER_{f.name.upper()}")
        if env is None and f.name in _SHARED_ENV:  # the same settings `specroll serve` reads
            env = os.environ.get(f"SPECROLL_{f.name.upper()}")
        kind = type(default) if default is not None else str
        if f.name in ("metrics_port", "max_rounds"):
            kind = int
        elif f.name == "lr":
            kind = float
        value = kind(env) if env is not None else default
        flag = "--" + f.name.replace("_", "-")
        if f.name == "gate":
            p.add_argument(flag, choices=GATES, default=value, help=_HELP[f.name])
        else:
            p.add_argument(flag, type=kind, default=value, help=_HELP.get(f.name, f"(default: {default})"))


def from_args(args: argparse.Namespace) -> TrainerConfig:
    return TrainerConfig(**{f.name: getattr(args, f.name) for f in fields(TrainerConfig)})
