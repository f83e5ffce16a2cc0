"""Pieces of the drafter trainer: the acceptance measure, the loss with top-k payloads, reward weights,
Hugging Face names for pushes, and checkpoints with optimizer state."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import default_checkpoint, make_checkpoint
from safetensors.torch import load_file

from drafter_trainer.batch import build_batch, sampling_batch
from drafter_trainer.build import build_student
from drafter_trainer.checkpoint import CheckpointStore, load_optimizer
from drafter_trainer.config import TrainerConfig
from drafter_trainer.objective import acceptance, distill_loss, expected_lengths, mean_beta_length
from drafter_trainer.passes import GateClosed, Passes
from drafter_trainer.pool import RolloutPool
from drafter_trainer.servers import GrpcServer, ServerState
from drafter_trainer.students import EagleStudent
from drafter_trainer.teacher import Teacher, folder_resolver
from drafter_trainer.trainer import Part
from service.buffer.codec import decode_entry, entry_fields, payload_of
from service.engine.drafters.eagle import init_head
from service.models.loader import hf_state_dict, load_model
from service.params import SamplingParams, VersionSpan

CPU = torch.device("cpu")


def record(rid: str, prompt: list[int], out: list[int], logprobs: list[float], **kw) -> SimpleNamespace:
    fields = dict(rollout_id=rid, request_id=rid.split(":")[0], index=0, group_id=None, prompt_token_ids=prompt,
                  output_token_ids=out, logprobs=logprobs, raw_logprobs=None,
                  version_spans=[VersionSpan("0", "d@0", 0, len(out))], finish_reason="length",
                  num_prompt_tokens=len(prompt), num_output_tokens=len(out), metadata={}, policy_version="0",
                  drafter_version="d@0", created_at=0.0, finished_at=1.0)
    return SimpleNamespace(**{**fields, **kw})


def rollout(rec: SimpleNamespace, top_k: int = 0):
    return decode_entry("1-0", entry_fields(payload_of(rec, top_k)))


def test_acceptance_is_exact_with_the_target_and_unbiased_from_samples():
    gen = torch.Generator().manual_seed(0)
    V, N = 12, 4
    target_logits, draft_logits = torch.randn(N, V, generator=gen) * 2, torch.randn(N, V, generator=gen) * 2
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    exact = torch.minimum(p, q).sum(-1)
    draws = 20_000
    tokens = torch.multinomial(p, draws, replacement=True, generator=gen)  # [N, draws]
    M = N * draws
    batch = SimpleNamespace(sb=sampling_batch([1.0] * M, [1.0] * M, [0] * M, [0.0] * M, V, CPU),
                            targets=tokens.reshape(-1), target_logprob=p.log().gather(1, tokens).reshape(-1),
                            teacher_ok=torch.zeros(M, dtype=torch.bool))
    sampled = acceptance(draft_logits.repeat_interleave(draws, 0), batch, None).view(N, draws).mean(1)
    assert sampled == pytest.approx(exact, abs=0.01)
    batch.teacher_ok[:] = True
    full = acceptance(draft_logits.repeat_interleave(draws, 0), batch,
                      target_logits.log_softmax(-1).repeat_interleave(draws, 0)).view(N, draws)
    assert torch.allclose(full, exact[:, None].expand(N, draws), atol=1e-6)


def test_expected_lengths_match_the_definition():
    beta = torch.tensor([0.9, 0.5, 0.8, 0.2, 0.7, 0.6, 1.0])
    owner = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    got = expected_lengths(beta, owner, k=2)
    want = [1 + 0.9 + 0.9 * 0.5, 1 + 0.5 + 0.5 * 0.8, 1 + 0.8 + 0.8 * 0.2, 1 + 0.7 + 0.7 * 0.6, 1 + 0.6 + 0.6]
    assert got.tolist() == pytest.approx(want)
    assert mean_beta_length(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_payload_top_k_and_params_drive_the_loss():
    params = SamplingParams(temperature=0.5, top_k=3)
    tops = [{4: -0.1, 5: -2.5, 6: -3.0}, {7: -0.2, 4: -1.9, 1: -4.0}]
    rec = record("b:0", [2, 3], [4, 7], [-0.1, -0.2], params=params, top_logprobs=tops)
    r = rollout(rec, top_k=2)
    assert (r.temperature, r.top_k, r.top_count) == (0.5, 3, 2) and r.top_ids == [4, 5, 7, 4]
    batch = build_batch([r], [1.0], None, 16, 64, CPU)
    logits = torch.randn(2, 16, requires_grad=True)
    loss = distill_loss(logits, batch, None)
    lq = (logits / 0.5).log_softmax(-1)
    p = torch.tensor([[-0.1, -2.5], [-0.2, -1.9]]).softmax(-1)
    want = -(p * lq.gather(1, torch.tensor([[4, 5], [7, 4]]))).sum(-1).mean()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    loss.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_reward_and_recency_weights():
    pool = RolloutPool(TrainerConfig(reward_alpha=0.5, recency_versions=2, stale_weight=0.25))
    pool.note_version("0")
    pool.note_version("1")
    rs = [rollout(record(f"c:{i}", [1], [2], [-1.0], policy_version=v, version_spans=[VersionSpan(v, "d", 0, 1)]))
          for i, v in enumerate(["1", "1", "1", "0"])]
    rs[0].reward, rs[1].reward = 1.0, 0.0
    w = pool.weights(rs)
    assert w[0] > 1.0 > w[1] and w[2] == 1.0 and w[3] == 0.25
    pool.note_version("2")
    assert pool.recency_weight(rs[3]) == 0.0 and pool.recency_weight(rs[0]) == 0.25
    for r in rs:
        pool.add(r, "train")
    picked = pool.sample(4, random.Random(0))
    assert {r.rollout_id for r in picked} == {"c:0", "c:1", "c:2"}  # version 0 fell out of the window
    assert not pool.fresh and pool.sample(2, random.Random(0))  # then random recent ones


def held(pool: RolloutPool, version: str, n: int, spans: list[str] | None = None) -> None:
    for i in range(n):
        pool.add(rollout(record(f"h{version}{len(pool.heldout)}:{i}", [1], [2], [-1.0], policy_version=version,
                                version_spans=[VersionSpan(v, "d", 0, 1) for v in spans or [version]])), "eval")


def test_the_measure_reaches_back_to_older_versions_until_enough_are_held_out():
    """A trainer that pushes every GRPO step holds out about a fifth of a step's rollouts per version, and none of
    a version just pushed: the measure takes older versions the trainer trains on until min_heldout are in hand."""
    pool = RolloutPool(TrainerConfig(min_heldout=4, measure_versions=3))
    for v in "0123":
        pool.note_version(v)
    held(pool, "0", 5)
    held(pool, "1", 3)
    held(pool, "2", 2)
    held(pool, "3", 1, spans=["2", "3"])  # spans a push: on neither version alone
    assert [(v, len(rs)) for v, rs in pool.heldout_recent()] == [("2", 2), ("1", 3)]  # none of "3" yet; "0" not needed
    held(pool, "3", 4)
    assert [(v, len(rs)) for v, rs in pool.heldout_recent()] == [("3", 4)]  # the current version alone suffices
    pool.cfg.min_heldout = 100
    assert [v for v, _ in pool.heldout_recent()] == ["3", "2", "1"]  # no further back than measure_versions


def test_a_measure_over_versions_pushes_on_their_whole_and_the_alarm_reads_the_current_version():
    from drafter_trainer.freshness import FreshnessAlarm
    from drafter_trainer.metrics import TrainerMetrics
    from drafter_trainer.trainer import DrafterTrainer

    def trainer(current: str) -> SimpleNamespace:
        fake = SimpleNamespace(cfg=TrainerConfig(push_margin=0.01), metrics=TrainerMetrics(), round=3, history=[],
                               pool=SimpleNamespace(current=current), served_version=None, pushes=0, served=None,
                               alarm=FreshnessAlarm(0.5, 0.8), student=SimpleNamespace(module="trained",
                                                                                       frozen_copy=lambda: "copy"))
        fake._push = lambda module, version: True
        fake.restart_from_served = lambda: None
        fake.alarm.policy_changed(current)
        return fake

    # The newer version gets worse with the trained drafter, the older one better by more: 3 positions against 1.
    parts = [Part("5", 8, [2.0, 1.9], 10), Part("4", 8, [2.0, 2.2], 30)]
    fake = trainer("5")
    m = DrafterTrainer.evaluate(fake, 12, parts)  # type: ignore[arg-type]
    assert (m.before, m.after, m.policy_version, m.heldout, m.pushed) == (2.0, pytest.approx(2.125), "5", 12, True)
    assert fake.alarm.baseline == 1.9  # the pushed drafter on the current version alone
    fake.alarm.policy_changed("6")
    fake.pool.current = "6"
    DrafterTrainer.evaluate(fake, 16, [Part("5", 16, [1.2, 1.1], 40)])  # type: ignore[arg-type]
    assert fake.alarm.awaiting and not fake.alarm.stale  # no rollouts of "6" measured: the alarm does not judge it
    DrafterTrainer.evaluate(fake, 16, [Part("6", 7, [1.3, 1.2], 5), Part("5", 9, [1.9, 1.8], 40)])  # type: ignore[arg-type]
    assert fake.alarm.awaiting and not fake.alarm.stale  # 7 of "6": too few to judge by (min_heldout 16)
    DrafterTrainer.evaluate(fake, 16, [Part("6", 8, [1.3, 1.2], 5), Part("5", 8, [1.9, 1.8], 40)])  # type: ignore[arg-type]
    assert fake.alarm.stale and fake.alarm.events[-1].stale == 1.3  # "6" alone, not diluted by "5"
    assert [(h.pushed, h.restarted) for h in fake.history] == [(True, False)] + [(False, True)] * 3


def test_a_round_that_makes_the_drafter_worse_restarts_it_from_the_served_one_at_half_the_rate():
    """measurement.py: a trained drafter measured worse than the served one is not trained on from where it went."""
    from drafter_trainer.trainer import DrafterTrainer

    student = build_student(str(make_checkpoint("qwen2", tied=False, seed=5)), None, 512, 64, CPU)
    pushed: list[str] = []
    server = SimpleNamespace(push=lambda s, module, version: pushed.append(version))
    trainer = DrafterTrainer(TrainerConfig(lr=1e-3), None, server, student, None)  # type: ignore[arg-type]
    trainer.pool.note_version("0")

    def trained_worse() -> None:
        for p in student.module.parameters():
            p.grad = torch.ones_like(p)
        trainer.optim.step()
        assert trainer.optim.state and not all(
            torch.equal(a, b) for a, b in zip(student.module.parameters(), trainer.served.parameters(), strict=True))
        assert trainer.evaluate(16, [Part("0", 16, [3.0, 2.5], 100)]).restarted

    trained_worse()
    assert all(torch.equal(a, b) for a, b in zip(student.module.parameters(), trainer.served.parameters(), strict=True))
    assert not trainer.optim.state and trainer.optim.param_groups[0]["lr"] == 5e-4
    assert trainer.metrics.lr._value.get() == 5e-4
    for _ in range(8):
        trained_worse()
    assert trainer.optim.param_groups[0]["lr"] == 1e-3 / 32 and not pushed  # no lower than the floor
    for after in (3.0, 2.995, 3.005):  # within push_margin (0.01) either way: trained on as it is
        m = trainer.evaluate(16, [Part("0", 16, [3.0, after], 100)])
        assert not (m.pushed or m.restarted)
    m = trainer.evaluate(16, [Part("0", 16, [3.0, 3.5], 100)])
    assert m.pushed and not m.restarted and pushed == ["distill-1"] and trainer.served_version == "distill-1"


def test_the_default_rate_is_low_for_a_loaded_drafter_and_high_for_a_new_head():
    import argparse

    from drafter_trainer.config import add_args, from_args
    from drafter_trainer.trainer import DrafterTrainer

    model_dir = default_checkpoint()
    target_cfg = load_model(model_dir, torch.float32, CPU).config
    loaded = build_student(str(make_checkpoint("qwen2", tied=False, seed=5)), None, 512, 64, CPU)
    new_head = build_student("eagle", target_cfg, 512, 64, CPU)
    rate = {s.kind: DrafterTrainer(TrainerConfig(), None, None, s, None).optim.param_groups[0]["lr"]  # type: ignore
            for s in (loaded, new_head)}
    assert rate == {"draft": 1e-4, "eagle": 1e-3} and not loaded.fresh and new_head.fresh
    p = argparse.ArgumentParser()
    add_args(p)
    assert from_args(p.parse_args([])).lr is None and from_args(p.parse_args(["--lr", "3e-3"])).lr == 3e-3
    trainer = DrafterTrainer(TrainerConfig(lr=3e-3), None, None, new_head, None)  # type: ignore[arg-type]
    assert trainer.optim.param_groups[0]["lr"] == 3e-3


def test_hf_tensors_round_trip_and_checkpoint_with_optimizer(tmp_path):
    path = default_checkpoint(tied=False)
    model = load_model(path, torch.float32, CPU)
    original = load_file(str(path / "model.safetensors"))
    tensors = hf_state_dict(model)
    assert set(tensors) == set(original) and all(torch.equal(tensors[k], original[k]) for k in original)
    model.requires_grad_(True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.logits(model.embed_tokens.weight[:3]).sum().backward()
    optim.step()
    store = CheckpointStore(tmp_path)
    store.save(1, model.state_dict(), model.state_dict(), optim, {"round": 1, "ledger": [["a", "train"]]})
    store.save(2, model.state_dict(), model.state_dict(), optim, {"round": 2, "ledger": [["a", "train"]]})
    store.save(3, model.state_dict(), model.state_dict(), optim, {"round": 3, "ledger": [["a", "train"]]})
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-00000002", "ckpt-00000003"]
    candidate, _served, opt_tensors, state = store.load()
    assert state["round"] == 3 and torch.equal(candidate["embed_tokens.weight"], model.embed_tokens.weight)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_optimizer(fresh, opt_tensors, state["param_groups"])
    a, b = optim.state_dict()["state"][0], fresh.state_dict()["state"][0]
    assert torch.equal(a["exp_avg"], b["exp_avg"]) and float(a["step"]) == float(b["step"])


def test_eagle_heads_are_pushed_over_grpc_like_draft_models():
    """The sidecar's push of an EAGLE head takes the same drafter role as a draft model; a head that does not
    fit is refused and the served one stays."""
    from service_utils import ADMIN, start_server

    from client import SpecrollClient
    from client.errors import InvalidArgument

    model_dir = default_checkpoint()
    cfg = load_model(model_dir, torch.float32, CPU).config
    student = EagleStudent(init_head(cfg, seed=3), cfg.vocab_size, 64, CPU)
    srv = start_server(model_dir, engine_kw={"drafter": "eagle"})
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            def greedy() -> list[int]:
                return c.generate_one([5, 6, 7], max_tokens=12, temperature=0.0, ignore_eos=True).samples[0].token_ids

            before = greedy()
            GrpcServer(c).push(student, student.module, "e1")
            assert "eagle@e1" in c.server_info().drafter_version
            assert greedy() == before  # lossless
            bad = student.push_tensors(student.module)
            bad["fc.weight"] = bad["fc.weight"][:, :-1].contiguous()
            with pytest.raises(InvalidArgument, match=r"fc\.weight"):
                c.push_weights(bad, "e2", role="drafter")
            assert "eagle@e1" in c.server_info().drafter_version
    finally:
        srv.stop()


def test_gate_follows_the_running_batch():
    from drafter_trainer.metrics import TrainerMetrics
    from drafter_trainer.trainer import DrafterTrainer

    def gate(st: ServerState, **kw) -> bool:
        fake = SimpleNamespace(cfg=TrainerConfig(**kw), metrics=TrainerMetrics(), _last_round=time.monotonic())
        return DrafterTrainer.gate_open(fake, st)  # type: ignore[arg-type]

    busy, tail = ServerState("0", "d", 40, 12, False), ServerState("0", "d", 3, 0, False)
    idle, paused = ServerState("0", "d", 0, 0, False), ServerState("0", "d", 40, 0, True)
    assert not gate(busy) and gate(tail) and gate(idle) and gate(paused)
    assert not gate(tail, gate="idle") and gate(idle, gate="idle") and gate(busy, gate="always")
    assert not gate(ServerState("0", "d", 9, 0, False), tail_max_running=8)
    assert gate(busy, max_defer_s=1e-9)  # waited long enough: train anyway


def test_a_busy_server_is_looked_at_afresh_every_backoff():
    """In an RL loop the server is idle for a second or two while the policy trainer updates: the gate reads the
    server's state afresh, not the copy cached for `info_interval_s`, and the wait between looks does not grow."""
    from drafter_trainer.metrics import TrainerMetrics
    from drafter_trainer.trainer import DrafterTrainer

    busy, idle = ServerState("0", "d", 40, 12, False), ServerState("0", "d", 0, 0, False)
    answers = iter([busy, busy, busy, busy, idle])
    rounds: list[int] = []
    fake = SimpleNamespace(cfg=TrainerConfig(gate="idle", backoff_s=0.01, info_interval_s=3600.0),
                           metrics=TrainerMetrics(), server=SimpleNamespace(state=lambda: next(answers)),
                           _state=None, _state_at=0.0, _last_round=time.monotonic(), follow_policy=lambda st: None,
                           source=SimpleNamespace(read=lambda n, ms: [], lag=lambda: (0, 0)), take_in=lambda e: None,
                           lease=None, due=lambda: True, train_round=lambda: rounds.append(1))
    for name in ("server_state", "gate_open", "tick"):
        setattr(fake, name, getattr(DrafterTrainer, name).__get__(fake))
    for _ in range(3):
        fake.tick()
    assert not rounds and fake.metrics.backoff._value.get() == pytest.approx(0.03)  # 0.01 each time, not doubling
    fake.tick()
    assert rounds == [1] and fake._state is idle  # the cached state still said busy


def test_a_closing_gate_pauses_the_round_between_steps():
    from drafter_trainer.metrics import TrainerMetrics
    from drafter_trainer.trainer import DrafterTrainer

    opens = iter([False, True, True, False, True, True])
    closes_in_measure = iter([True, False])
    sampled: list[int] = []

    def measure(modules, held):
        if next(closes_in_measure):
            raise GateClosed
        return [1.5, 1.7], 10

    fake = SimpleNamespace(
        cfg=TrainerConfig(steps_per_round=3, gate="idle", min_heldout=2), _round_steps=0, round=0,
        rng=random.Random(0), metrics=TrainerMetrics(), _last_round=0.0, _still_open=lambda: next(opens),
        pool=SimpleNamespace(fresh=["r1"], sample=lambda n, rng: sampled.append(n) or [],
                             heldout_recent=lambda: [("0", ["h1", "h2"])]),
        served="served", student=SimpleNamespace(module="trained"), passes=SimpleNamespace(measure=measure),
        evaluate=lambda n, parts: ("measured", n, parts), commit=lambda: None)
    round_ = DrafterTrainer.train_round.__get__(fake)
    assert round_() is None  # one step, then the server got busy: paused, nothing measured
    assert (fake._round_steps, fake.round, fake.pool.fresh, len(sampled)) == (1, 0, ["r1"], 1)
    assert round_() is None  # steps 2 and 3, then busy again before the measure
    assert (fake._round_steps, fake.round, len(sampled)) == (3, 0, 3)
    assert round_() is None  # the gate closed during the measure (passes.py): measured again at the next opening
    assert (fake._round_steps, fake.round, len(sampled)) == (3, 0, 3)
    assert round_() == ("measured", 2, [Part("0", 2, [1.5, 1.7], 10)])  # no training left: measure; the round is done
    assert (fake._round_steps, fake.round, fake.pool.fresh, len(sampled)) == (0, 1, [], 3)


def test_pieces_of_a_step_add_up_to_the_whole_batch_and_a_closing_gate_drops_the_step():
    """passes.py: a step cut into micro-batches moves the student exactly as the whole batch does; the gate is
    asked between pieces, and a step it stops leaves the student and its gradients untouched."""
    target, draft = make_checkpoint("qwen2", tied=False, seed=3), make_checkpoint("qwen2", tied=False, seed=5)
    teacher = Teacher(folder_resolver(str(target), CPU), CPU, 64)
    teacher.sync("0")
    gen = random.Random(0)
    rs = []
    for i in range(6):
        prompt = [gen.randrange(1, 512) for _ in range(gen.randrange(2, 6))]
        out = [gen.randrange(1, 512) for _ in range(gen.randrange(3, 12))]
        rs.append(rollout(record(f"m:{i}", prompt, out, [-1.0] * len(out), params=SamplingParams(temperature=0.8))))
    rs[1] = rollout(record("m:1", [1, 2], [3, 4, 5], [-1.0] * 3))  # no teacher: sampled-token cross-entropy
    rs[1].policy_version, rs[1].policy_versions = "old", ["old"]
    weights = [1.0, 0.5, 1.0, 2.0, 1.0, 0.0]

    def run(micro_tokens: int, still_open=lambda: True):
        student = build_student(str(draft), None, 512, 64, CPU)
        passes = Passes(TrainerConfig(micro_tokens=micro_tokens), student, teacher, still_open)
        optim = torch.optim.SGD(student.module.parameters(), lr=0.1)  # AdamW would magnify rounding (sign of ~0)
        return passes, student, optim

    whole, s_whole, o_whole = run(10_000)
    pieces, s_pieces, o_pieces = run(20)
    assert len(whole.batches(rs, weights)) == 1 and len(pieces.batches(rs, weights)) >= 4
    loss_whole, loss_pieces = whole.step(o_whole, rs, weights), pieces.step(o_pieces, rs, weights)
    assert loss_pieces == pytest.approx(loss_whole, rel=1e-5)
    for a, b in zip(s_whole.module.parameters(), s_pieces.module.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    served = build_student(str(draft), None, 512, 64, CPU).module
    assert not all(torch.equal(a, b) for a, b in zip(served.parameters(), s_whole.module.parameters(), strict=True))
    (m_whole, n_whole), (m_pieces, n_pieces) = (p.measure([served, s.module], rs)
                                                for p, s in ((whole, s_whole), (pieces, s_pieces)))
    assert m_pieces == pytest.approx(m_whole, rel=1e-5) and n_pieces == n_whole > 0

    answers = iter([True, False])
    stopped, s_stopped, o_stopped = run(20, lambda: next(answers))
    before = [t.clone() for t in s_stopped.module.parameters()]
    with pytest.raises(GateClosed):
        stopped.step(o_stopped, rs, weights)  # the gate closed before the third piece
    assert all(torch.equal(a, b) for a, b in zip(before, s_stopped.module.parameters(), strict=True))
    assert all(t.grad is None for t in s_stopped.module.parameters())
    with pytest.raises(GateClosed):
        run(20, lambda: False)[0].measure([served], rs)
