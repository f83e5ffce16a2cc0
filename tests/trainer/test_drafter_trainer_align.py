"""Distillation against a real server and Redis: a poorly aligned draft model gets better on fresh rollouts of
a fixed target; after a push of new target weights the freshness alarm fires and acceptance recovers.

Numbers are logged (pytest --log-cli-level=INFO): the sidecar's held-out estimate and the server's own
tokens per verify step on fresh rollouts, before and after.
"""

from __future__ import annotations

import logging
import uuid

import pytest
from helpers import trainer_target_checkpoint
from service_utils import ADMIN, checkpoint_tensors, perturbed, start_server, write_checkpoint
from trainer_utils import pump, server_tokens_per_step

from client import SpecrollClient
from drafter_trainer.cli import build
from drafter_trainer.config import TrainerConfig
from service.buffer import BufferConfig

logger = logging.getLogger(__name__)
K = 4


@pytest.fixture(scope="module")
def target():
    return trainer_target_checkpoint()


def setup(target, drafter, redis_server, tmp_path, **trainer_kw):
    stream = f"align:{uuid.uuid4().hex[:8]}"
    srv = start_server(target, buffer=BufferConfig(redis_url=redis_server, stream=stream,
                                                   spool_dir=str(tmp_path / "spool")),
                       engine_kw={"drafter": str(drafter), "spec": "fixed", "spec_k": K})
    cfg = TrainerConfig(server=srv.grpc_target, admin_token=ADMIN, redis_url=redis_server, stream=stream,
                        checkpoint_dir=str(tmp_path / "ckpt"), gate="always", min_new=32, block_ms=20,
                        max_wait_s=0.2, info_interval_s=0.0, k=K, **{"lr": 1e-3, **trainer_kw})  # a far-off drafter
    return srv, build(cfg)


def test_distillation_raises_acceptance_on_fresh_rollouts(target, redis_server, tmp_path):
    draft = write_checkpoint(target, perturbed(checkpoint_tensors(target), seed=5, scale=1.0), tmp_path / "draft")
    srv, trainer = setup(target, draft, redis_server, tmp_path)
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            served_before = server_tokens_per_step(c, seed=1)
            for i in range(6):
                server_tokens_per_step(c, seed=100 + i)
                pump(trainer)
            first, last = trainer.history[0], trainer.history[-1]
            served_after = server_tokens_per_step(c, seed=2)
            logger.info("fixed target: sidecar held-out estimate %.2f -> %.2f tokens/step (k=%d, %d pushes); "
                        "server on fresh rollouts %.2f -> %.2f", first.before, last.after, K, trainer.pushes,
                        served_before, served_after)
            assert last.after > first.before + 0.4 and trainer.pushes >= 2
            assert served_after > served_before + 0.3
            assert f"distill-{trainer.pushes}" in c.server_info().drafter_version
            assert (tmp_path / "ckpt" / "served" / "model.safetensors").is_file()
    finally:
        trainer.server.client.close()
        srv.stop()


def test_freshness_alarm_after_a_policy_push_then_recovery(target, redis_server, tmp_path):
    base = checkpoint_tensors(target)
    draft = write_checkpoint(target, perturbed(base, seed=5, scale=0.2), tmp_path / "draft")
    new_policy = write_checkpoint(target, perturbed(base, seed=9, scale=0.5), tmp_path / "policy" / "v1")
    srv, trainer = setup(target, draft, redis_server, tmp_path, target_model=str(tmp_path / "policy" / "{version}"),
                         lr=5e-3, steps_per_round=32, stale_weight=0.1, alarm_ratio=0.6, recover_ratio=0.7)
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            # A baseline before the push: the first measurement needs min_heldout held-out rollouts, one in
            # holdout_every by a hash of the (random) rollout id; three rounds (120 rollouts) fell short in ~2% of runs.
            for i in range(10):
                server_tokens_per_step(c, seed=100 + i)
                pump(trainer)
                if i >= 2 and trainer.alarm.baseline is not None:
                    break
            served_before_push = server_tokens_per_step(c, seed=1)
            c.load_weights(str(new_policy), "v1")  # the RL trainer pushes a new policy
            stale_served = server_tokens_per_step(c, seed=2)
            for i in range(8):  # the alarm needs a measurement on rollouts of the new version: a few rounds
                server_tokens_per_step(c, seed=200 + i)
                pump(trainer)
                if trainer.alarm.events and trainer.alarm.events[-1].stale is not None:
                    break
            assert trainer.alarm.events, "no freshness alarm after the policy push"
            event = trainer.alarm.events[-1]
            assert event.version == "v1" and event.stale is not None and trainer.teacher.version == "v1"
            assert event.stale - 1 < cfg_ratio(trainer, "alarm") * (event.before - 1)
            assert trainer.metrics.registry.get_sample_value("specroll:trainer_drafter_stale") in (0, 1)
            for i in range(10):
                if event.recovered is not None:
                    break
                server_tokens_per_step(c, seed=300 + i)
                pump(trainer)
            recovered_served = server_tokens_per_step(c, seed=3)
            logger.info("policy push v1: sidecar %.2f before -> %.2f stale -> %.2f recovered in %.1f s; server on "
                        "fresh rollouts %.2f before the push, %.2f right after, %.2f after recovery", event.before,
                        event.stale, event.recovered or 0.0, event.seconds or -1.0, served_before_push,
                        stale_served, recovered_served)
            assert event.recovered is not None and event.seconds is not None and event.seconds > 0
            assert stale_served < served_before_push - 0.5 and recovered_served > stale_served + 0.3
            metrics = trainer.metrics.registry
            assert metrics.get_sample_value("specroll:trainer_stale_alarms_total") == 1
            assert metrics.get_sample_value("specroll:trainer_drafter_stale") == 0
            assert metrics.get_sample_value("specroll:trainer_stale_recovery_seconds_count") == 1
            assert metrics.get_sample_value("specroll:trainer_pushes_total", {"result": "ok"}) == trainer.pushes
    finally:
        trainer.server.client.close()
        srv.stop()


def cfg_ratio(trainer, which: str) -> float:
    return float(getattr(trainer.cfg, f"{which}_ratio"))
