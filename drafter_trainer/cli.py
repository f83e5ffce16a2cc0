"""`specroll drafter-trainer`: the distillation sidecar.

    specroll drafter-trainer --server 127.0.0.1:50051 --redis-url redis://127.0.0.1:6379/0 \\
        --admin-token T --checkpoint-dir /shared/drafter-ckpt --metrics-port 9400

It trains only while it holds its consumer group's lease (lease.py) and stands by otherwise: a second sidecar
on the same group is a warm spare that takes over, from the shared checkpoint, when the first goes.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import torch

from drafter_trainer.config import TrainerConfig, add_args, from_args

logger = logging.getLogger(__name__)


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser("drafter-trainer", help="sidecar: distil the server's drafter from the rollout stream")
    add_args(p)
    p.set_defaults(func=run)


def build(cfg: TrainerConfig, metrics: Any = None, lease: Any = None) -> Any:
    """A DrafterTrainer for a running server and Redis, as the sidecar runs it (resumed from the checkpoint)."""
    import redis

    from client import SpecrollClient
    from drafter_trainer.build import build_student, target_config
    from drafter_trainer.checkpoint import CheckpointStore
    from drafter_trainer.metrics import TrainerMetrics
    from drafter_trainer.servers import GrpcServer
    from drafter_trainer.source import RedisSource
    from drafter_trainer.teacher import Teacher, folder_resolver
    from drafter_trainer.trainer import DrafterTrainer

    if not cfg.redis_url:
        raise ValueError("--redis-url is required (the sidecar reads the server's rollout stream)")
    client = SpecrollClient(cfg.server, admin_token=cfg.admin_token)
    info = client.wait_until_ready()
    local = info.model_path if (Path(info.model_path) / "config.json").is_file() else None
    spec = cfg.target_model or local
    device = torch.device(cfg.device)
    max_positions = cfg.max_seq_len + 1
    target_cfg = target_config(spec, info.policy_version, local)
    student = build_student(cfg.drafter or info.drafter, target_cfg, info.vocab_size, max_positions, device,
                            cfg.seed)
    resolver = None
    if spec is not None:
        by_version = folder_resolver(spec, device)
        initial = info.policy_version

        def resolver(version: str) -> Any:  # the starting version may live in the server's own folder
            model = by_version(version)
            if model is None and version == initial and local is not None and "{version}" in spec:
                model = folder_resolver(local, device)(version)
            return model
    else:
        logger.warning("no target model folder: training from payload logprobs / sampled tokens only")
    metrics = metrics or TrainerMetrics()
    source = RedisSource(redis.Redis.from_url(cfg.redis_url, socket_timeout=max(5.0, cfg.block_ms / 500)), cfg)
    store = CheckpointStore(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    logger.info("training the %s drafter of %s (policy %s) from %s, consumer %s/%s", student.kind, cfg.server,
                info.policy_version, cfg.stream, cfg.group, cfg.consumer)
    return DrafterTrainer(cfg, source, GrpcServer(client), student, Teacher(resolver, device, max_positions),
                          metrics, store, lease)


def serve(cfg: TrainerConfig, stop: threading.Event, metrics: Any = None) -> None:
    """Stand by until this sidecar holds its consumer group's lease, train until `stop` is set or the lease is
    lost (then stand by again, and resume from the checkpoint when it is ours once more)."""
    import redis

    from drafter_trainer.lease import Lease, lease_key
    from drafter_trainer.metrics import TrainerMetrics

    if not cfg.redis_url:
        raise ValueError("--redis-url is required (the sidecar reads the server's rollout stream)")
    metrics = metrics or TrainerMetrics()
    if cfg.metrics_port:
        from drafter_trainer.metrics_http import serve_metrics

        serve_metrics(cfg.metrics_port, metrics.registry)
        logger.info("metrics on :%d/metrics", cfg.metrics_port)
    lease = None
    if cfg.lease_ttl_ms:
        client = redis.Redis.from_url(cfg.redis_url, socket_timeout=max(2.0, cfg.lease_ttl_ms / 3000))
        lease = Lease(client, lease_key(cfg.stream, cfg.group), cfg.consumer, cfg.lease_ttl_ms, metrics)
    while not stop.is_set():
        if lease is not None and not lease.acquire(stop):
            return
        trainer = None
        try:
            trainer = build(cfg, metrics, lease)
            trainer.run(stop)
            logger.info("stopped after %d rounds, %d pushes, %d rollouts taken in", trainer.round, trainer.pushes,
                        trainer.ledger.taken_total)
        finally:
            if trainer is not None:
                trainer.server.client.close()
                trainer.source.r.close()
            if lease is not None:
                lease.release()
        if lease is None or (cfg.max_rounds is not None and trainer.round >= cfg.max_rounds):
            return


def run(args: argparse.Namespace) -> int:
    cfg = from_args(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve(cfg, stop)
    return 0
