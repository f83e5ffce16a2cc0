"""Without Redis the server keeps rollouts in memory and trains its own drafter in-process: a draft model
(swapped through engine.swap_drafter) and an EAGLE head (swapped through EagleDrafter.swap_weights). The trainer
reaches the engine through the backend interface only: a drafter copy, a lent teacher, the push path."""

from __future__ import annotations

import gc
import logging
import re
import time

import pytest
import torch
from helpers import make_checkpoint, trainer_target_checkpoint
from service_utils import ADMIN, checkpoint_tensors, perturbed, start_server, write_checkpoint
from trainer_utils import server_tokens_per_step

from client import SpecrollClient
from drafter_trainer.config import TrainerConfig
from service.backend.base import PushUnsupported, RolloutBackend
from service.buffer import BufferConfig

logger = logging.getLogger(__name__)


def pushes(drafter_version: str) -> int:
    found = re.search(r"distill-(\d+)", drafter_version)
    return int(found.group(1)) if found else 0


def embedded(tmp_path) -> BufferConfig:
    trainer = TrainerConfig(gate="tail", tail_max_running=64, min_new=16, max_wait_s=0.2, block_ms=50,
                            min_heldout=8, info_interval_s=0.1, lr=3e-3, consumer="in-process")
    return BufferConfig(embedded_trainer=True, trainer=trainer, trainer_dir=str(tmp_path / "ckpt"))


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_in_process_trainer_improves_the_served_drafter(kind, tmp_path):
    target = trainer_target_checkpoint()
    if kind == "draft":
        drafter = str(write_checkpoint(target, perturbed(checkpoint_tensors(target), seed=5, scale=1.0),
                                       tmp_path / "draft"))
    else:
        drafter = "eagle"  # a freshly initialised head: drafts are almost never accepted
    srv = start_server(target, buffer=embedded(tmp_path), engine_kw={"drafter": drafter, "spec": "fixed",
                                                                     "spec_k": 4})
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            before = server_tokens_per_step(c, seed=1)
            deadline = time.monotonic() + 90
            while pushes(c.server_info().drafter_version) < 3:
                assert time.monotonic() < deadline, "the in-process trainer pushed fewer than 3 drafters"
                server_tokens_per_step(c, seed=int(time.monotonic() * 1000) % 10_000)
                time.sleep(0.2)
            after = server_tokens_per_step(c, seed=2)
            info = c.server_info()
        trainer = srv.server.trainer.trainer
        logger.info("in-process %s drafter: server tokens/step on fresh rollouts %.2f -> %.2f (%s); sidecar "
                    "estimate %.2f -> %.2f", kind, before, after, info.drafter_version, trainer.history[0].before,
                    trainer.history[-1].after)
        assert after > before + 0.2
        assert info.drafter_version.startswith(f"{kind}@distill-")
        assert trainer.student.fresh == (kind == "eagle")  # a head the engine initialised: the higher default rate
        metrics = srv.server.metrics.render().decode()
        assert 'specroll:trainer_pushes_total{result="ok"}' in metrics
        assert "specroll:buffer_memory_entries" in metrics
        assert (tmp_path / "ckpt" / "served" / "model.safetensors").is_file()
    finally:
        srv.stop()


def test_the_backend_lends_a_teacher_no_push_overwrites_and_a_drafter_copy_of_its_own(tmp_path):
    target = make_checkpoint("qwen2", tied=True, seed=3)
    drafter = write_checkpoint(target, perturbed(checkpoint_tensors(target), seed=5), tmp_path / "draft")
    srv = start_server(target, engine_kw={"drafter": str(drafter)})
    backend = srv.server.backend
    try:
        snap = backend.teacher_snapshot().result(30)
        lent = {k: v.clone() for k, v in snap.module.state_dict().items()}
        copied = backend.drafter_copy().result(30)
        assert snap.version == "0" and copied.kind == "draft_model"
        with torch.no_grad():
            for p in copied.module.parameters():
                p.add_(1.0)  # the caller's to train: the serving drafter does not move
        again = backend.drafter_copy().result(30).module.state_dict()
        assert all(not torch.equal(again[k], v) for k, v in copied.module.state_dict().items())
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            for i in (1, 2, 3):  # the second push would load into the replaced (lent) weights if it reused them
                c.push_weights(perturbed(checkpoint_tensors(target), seed=10 + i), f"v{i}")
            assert all(torch.equal(snap.module.state_dict()[k], v) for k, v in lent.items())
            newest = backend.teacher_snapshot().result(30)
            assert newest.version == "v3" and newest.module is not snap.module
            del snap, newest
            gc.collect()
            c.push_weights(perturbed(checkpoint_tensors(target), seed=20), "v4")  # spares reused again
    finally:
        srv.stop()


def test_a_backend_lends_nothing_by_default():
    other = object()  # the defaults read nothing of the backend they are called on
    for name in ("teacher_snapshot", "drafter_copy"):
        with pytest.raises(PushUnsupported, match="lends no"):
            getattr(RolloutBackend, name)(other)
    assert RolloutBackend.must_exit_hard(other) is False
