"""Drafter weight pushes on the vLLM backend (its draft model reloaded in place by specroll's worker extension):
acceptance follows the pushed drafter, greedy output never changes, a drafter paired with a target push is
published with it, refused pushes leave the engine serving."""

from __future__ import annotations

import uuid

import pytest
from helpers import make_checkpoint
from probes import metric, metric_lines
from service_utils import ADMIN, checkpoint_tensors, perturbed, running
from trainer_utils import pump
from vllm_utils import TINY, start_vllm

from client import SpecrollClient
from client.errors import InvalidArgument
from drafter_trainer.cli import build
from drafter_trainer.config import TrainerConfig
from service.buffer import BufferConfig

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 4, 5], [9, 9, 1]]


@pytest.fixture(scope="module")
def pair():
    """Target and draft of the same shape (one layer each), so the target's own weights are a valid drafter."""
    return (make_checkpoint("qwen2", seed=7, num_layers=1, **TINY),
            make_checkpoint("qwen2", seed=11, num_layers=1, **TINY))


@pytest.fixture(scope="module")
def stream() -> str:
    return f"vllm-drafter:{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(pair, redis_server, stream, tmp_path_factory):
    target, draft = pair
    buffer = BufferConfig(redis_url=redis_server, stream=stream, spool_dir=str(tmp_path_factory.mktemp("spool")))
    yield from running(start_vllm(target, drafter=str(draft), spec="fixed", k=3, buffer=buffer))


def run(srv, c: SpecrollClient, prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], float]:
    """Greedy outputs, and the fraction of drafted tokens accepted while producing them."""
    backend = srv.server.backend
    s0 = backend.stats()
    out = [d.samples[0].token_ids for d in c.generate(prompts, max_tokens=24, temperature=0.0, ignore_eos=True)]
    s1 = backend.stats()
    drafted = s1.spec_draft_tokens - s0.spec_draft_tokens
    assert drafted > 0
    return out, (s1.spec_accepted_tokens - s0.spec_accepted_tokens) / drafted


def test_drafter_push_changes_acceptance_never_outputs(server, pair):
    target, draft = pair
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        out0, rate0 = run(server, c)
        assert rate0 < 0.9
        res = c.push_weights(checkpoint_tensors(target), "d1", role="drafter")  # the drafter becomes the target
        assert res.role == "drafter" and c.server_info().drafter_version == "draft_model@d1"
        out1, rate1 = run(server, c)
        assert out1 == out0 and rate1 == 1.0
        spans = c.generate_one(PROMPTS[0], max_tokens=4, temperature=0.0).samples[0].version_spans
        assert [v.drafter_version for v in spans] == ["draft_model@d1"]
        c.load_weights(str(draft), "d2", role="drafter")  # the original drafter, from its folder
        out2, rate2 = run(server, c)
        assert out2 == out0 and rate2 == pytest.approx(rate0)


def test_drafter_paired_with_target_push(server, pair):
    target, draft = pair
    new_target = perturbed(checkpoint_tensors(target), seed=3)
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        out0, rate0 = run(server, c)
        c.push_weights(new_target, "p1", role="drafter", mode="with_target")
        info = c.server_info()
        assert info.drafter_version != "draft_model@p1" and info.policy_version != "p1"
        assert run(server, c) == (out0, pytest.approx(rate0))  # parked: nothing serves it yet
        c.push_weights(new_target, "p1")
        info = c.server_info()
        assert (info.policy_version, info.drafter_version) == ("p1", "draft_model@p1")
        out1, rate1 = run(server, c)
        assert out1 != out0 and rate1 == 1.0  # drafter == new target: every draft accepted
        c.push_weights(checkpoint_tensors(target), "p2")
        c.push_weights(checkpoint_tensors(draft), "p2", role="drafter")
        assert run(server, c)[0] == out0


def test_refused_drafter_pushes_leave_it_serving(server, pair):
    _, draft = pair
    tensors = checkpoint_tensors(draft)
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        out0, rate0 = run(server, c)
        version = c.server_info().drafter_version
        name = next(n for n in tensors if n.endswith("mlp.up_proj.weight"))
        with pytest.raises(InvalidArgument, match="wrong shapes"):
            c.push_weights({**tensors, name: tensors[name][:, :-1].contiguous()}, "bad1", role="drafter")
        with pytest.raises(InvalidArgument, match="missing tensors"):
            c.push_weights({k: v for k, v in tensors.items() if k != name}, "bad2", role="drafter")
        with pytest.raises(InvalidArgument, match="mode"):
            c.push_weights(tensors, "bad3", role="drafter", mode="later")
        assert c.server_info().drafter_version == version
        assert run(server, c) == (out0, pytest.approx(rate0))


def test_steps_show_in_the_shared_metric_names(server):
    with SpecrollClient(server.grpc_target) as c:
        run(server, c)
    text = server.server.metrics.render().decode()
    steps = {line.split("}")[0].split('"')[1]: float(line.split()[-1])
             for line in metric_lines(text, "specroll:spec_decode_strategy_steps_total")}
    assert steps.get("draft_model:k=3", 0) > 0
    count = metric(text, "specroll:batch_size_count")
    assert count >= sum(steps.values()) > 0


def test_sidecar_distils_the_vllm_drafter(server, pair, redis_server, stream, tmp_path):
    """The sidecar reads the server's rollouts from Redis, distils the draft model against its own teacher (the
    target folder the server reports) and pushes it back: acceptance on fresh prompts rises, outputs stay."""
    # One rollout in five (by a hash of its random id) is held out. The policy is p2 since the paired-push test,
    # so ~20-26 of this test's ~130 rollouts measure the drafter by the last round: with the default
    # min_heldout = 16, some runs never measured, so never pushed. Eight leave every run several measures.
    fresh = [[(3 * i + 1) % 16, (5 * i + 2) % 16, (i + 7) % 16] for i in range(24)]
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        out0, rate0 = run(server, c, fresh)
        cfg = TrainerConfig(server=server.grpc_target, admin_token=ADMIN, redis_url=redis_server, stream=stream,
                            checkpoint_dir=str(tmp_path / "ckpt"), gate="always", min_new=16, block_ms=20,
                            max_wait_s=0.2, info_interval_s=0.0, k=3, min_heldout=8, lr=1e-3)  # a random drafter
        trainer = build(cfg)
        # How many rounds reach a push depends on which rollouts the random hash holds out, and after the first
        # push (the big gain: accepted length 1.04-1.11 -> 1.49-1.86 in local runs) each further one is a gain of
        # 0.01-0.04 against a measure on 10-35 rollouts, so whether a later round pushes or restarts is the
        # measure's noise: 4 pushes came after 7-10 rounds locally, and one CI run had 3 after 24. The rise on
        # fresh prompts after 2 pushes was 0.09-0.12, after 4-6 0.21-0.30 in six local runs and 0.088 in one CI
        # run; in this form (up to 4 pushes) 0.16-0.18 in two local runs. So it trains up to 4 pushes, asks 2 (the
        # sidecar pushes again over its own served drafter) and a rise of 0.05; the messages say how the rounds went.
        for i in range(24):
            if trainer.pushes >= 4:
                break
            run(server, c, [[(7 * i + j) % 16, (j * j + i) % 16, j % 16] for j in range(16)])
            pump(trainer)
        out1, rate1 = run(server, c, fresh)
        rounds = [(m.round, round(m.before, 3), round(m.after, 3), m.pushed) for m in trainer.history]
        assert trainer.pushes >= 2 and "distill-" in c.server_info().drafter_version, rounds
        assert out1 == out0 and rate1 > rate0 + 0.05, (rate0, rate1, rounds)
