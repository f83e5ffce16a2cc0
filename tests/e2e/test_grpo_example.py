"""examples/grpo against a real server on free loopback ports: generate -> reward -> update -> push, 3 steps."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import examples.grpo.grpo as grpo
from examples.grpo.policy import Policy, Rollout, group_advantages
from service.app import BackgroundServer, ServerConfig
from service.config import EngineConfig
from service.demo.default_model import default_drafters
from service.netutil import free_port

ADMIN = "grpo-test-token"


@pytest.fixture(scope="module")
def tiny_model(tiny_demo_model: Path) -> Path:
    return tiny_demo_model


def test_group_advantages() -> None:
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert grpo.tail_seconds([1.0, 2.0, 3.0, 10.0], 0.75) == pytest.approx(7.0)


def test_an_update_counts_the_positions_its_forward_ran(tiny_model: Path) -> None:
    policy = Policy(tiny_model, lr=0.0)
    rows = [Rollout([1, 2], [3, 4, 5], [-1.0] * 3, 1.0), Rollout([1, 2], [6, 7, 8, 9, 10], [-1.0] * 5, -1.0),
            Rollout([1, 2, 3], [4] * 9, [-1.0] * 9, 0.0)]  # A = 0: not trained
    one = policy.update(rows, 1.0, 0.2, micro_tokens=1000)
    assert (one.trained_samples, one.forward_tokens) == (2, 2 * 7)  # both rows padded to the longer one
    split = policy.update(rows, 1.0, 0.2, micro_tokens=10)
    assert split.forward_tokens == 5 + 7  # a micro-batch each: no padding


def test_grpo_steps_push_weights_and_versions_advance(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny model never solves a problem; a random verifier gives the groups non-zero advantages.
    rng = random.Random(0)
    monkeypatch.setattr(grpo, "reward", lambda problem, text: float(rng.random() < 0.5))
    drafters = default_drafters(tiny_model)
    engine = EngineConfig(model=str(tiny_model), drafter=f"{drafters['suffix']},{drafters['draft']}",
                          max_model_len=256, max_num_seqs=32)
    config = ServerConfig(http_port=free_port(), grpc_port=free_port(), admin_token=ADMIN)
    with BackgroundServer(engine, config) as server:
        cfg = grpo.GRPOConfig(server=server.grpc_target, admin_token=ADMIN, steps=3, prompts_per_step=2,
                              group_size=8, max_tokens=48, min_terms=2, max_terms=4, lr=1e-2, seed=3,
                              push_delta=True)
        records = grpo.run(cfg)
        snapshot = server.server.backend.teacher_snapshot().result(30)
        served, served_version = snapshot.module, snapshot.version
    assert [r.policy_version for r in records] == ["0", "step-1", "step-2"]
    assert served_version == "step-3"
    assert all(r.samples == 16 and len(r.lengths) == 16 and r.trained_samples > 0 for r in records)
    assert all(r.rollout_s > 0 and r.step_s >= r.rollout_s + r.update_s for r in records)
    assert all(r.extra["forward_tokens"] > r.extra["trained_tokens"] > 0 for r in records)  # prompts too
    # Steps 2 and 3 sampled from pushed weights (the second and third push deltas): the server's logprobs are the
    # ones the trainer computes with its own copy, so the pushes delivered exactly the trainer's weights.
    assert records[0].extra["push_bytes"] == records[0].extra["full_push_bytes"]  # the first push goes in full
    assert max(r.logprob_max_abs_diff for r in records) < 1e-3
    initial = Policy(tiny_model, lr=0.0).hf_weights()
    assert not torch.equal(served.embed_tokens.weight.detach(), initial["model.embed_tokens.weight"])
