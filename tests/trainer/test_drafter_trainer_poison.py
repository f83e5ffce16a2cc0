"""Poison stream entries never stall the sidecar: each is dead-lettered at once with the kind of fault (a metric
label) while the good entries of the same batch are trained and acked."""

from __future__ import annotations

import math
import uuid

import pytest
import redis
from helpers import trainer_target_checkpoint
from probes import wait_for
from service_utils import ADMIN, checkpoint_tensors, perturbed, start_server, write_checkpoint
from trainer_utils import pump

from client import SpecrollClient
from drafter_trainer.cli import build
from drafter_trainer.config import TrainerConfig
from service.buffer import BufferConfig, PayloadError, decode_entry
from service.buffer.codec import PAYLOAD
from service.protogen import pb2

VOCAB = 512  # make_checkpoint's


def payload(**edits) -> bytes:
    msg = pb2.RolloutPayload(rollout_id="r:0", prompt_token_ids=[3, 4], output_token_ids=[5, 6, 7],
                             logprobs=[-0.5, -1.0, -2.0], policy_version="0")
    for name, value in edits.items():
        if isinstance(value, list):
            getattr(msg, name)[:] = value
        else:
            setattr(msg, name, value)
    return msg.SerializeToString()


def params(**kw) -> bytes:
    msg = pb2.RolloutPayload.FromString(payload())
    msg.params.CopyFrom(pb2.SamplingParams(**kw))
    return msg.SerializeToString()


@pytest.mark.parametrize(("fields", "reason"), [
    ({"rollout_id": b"\xff\xfe", PAYLOAD: payload()}, "encoding"),
    ({"rollout_id": "r:0"}, "missing"),
    ({PAYLOAD: payload(rollout_id="")}, "missing"),
    ({PAYLOAD: b"\x08\xff\xff not a protobuf"}, "protobuf"),
    ({PAYLOAD: b"\x0a\x02\xff\xfe"}, "protobuf"),  # rollout_id holds bytes that are not UTF-8
    ({PAYLOAD: payload(logprobs=[-0.5, -1.0])}, "shape"),
    ({PAYLOAD: payload(top_k=2, top_token_ids=[1, 2] * 3, top_logprobs=[-1.0] * 5)}, "shape"),
    ({PAYLOAD: payload(top_k=-1)}, "shape"),
    ({PAYLOAD: payload(output_token_ids=[5, VOCAB, 7])}, "token_range"),
    ({PAYLOAD: payload(prompt_token_ids=[-3, 4])}, "token_range"),
    ({PAYLOAD: payload(top_k=1, top_token_ids=[1, 2, VOCAB + 9], top_logprobs=[-1.0] * 3)}, "token_range"),
    ({PAYLOAD: payload(logprobs=[-0.5, math.nan, -2.0])}, "non_finite"),
    ({PAYLOAD: payload(logprobs=[-0.5, -math.inf, -2.0])}, "non_finite"),
    ({PAYLOAD: payload(top_k=1, top_token_ids=[1, 2, 3], top_logprobs=[-1.0, math.inf, -1.0])}, "non_finite"),
    ({PAYLOAD: params(temperature=-1.0)}, "params"),
    ({PAYLOAD: params(top_p=math.nan)}, "params"),
    ({PAYLOAD: params(min_p=2.0)}, "params"),
])
def test_each_malformed_entry_raises_a_payload_error_naming_its_fault(fields, reason):
    with pytest.raises(PayloadError) as err:
        decode_entry("1-0", fields, vocab_size=VOCAB)
    assert err.value.reason == reason


def test_well_formed_entries_decode():
    removed = payload(top_k=2, top_token_ids=[5, 1, 6, 2, 7, 3], top_logprobs=[-0.1, -math.inf] * 3)
    r = decode_entry("1-0", {"rollout_id": b"r:0", PAYLOAD: removed}, vocab_size=VOCAB)  # -inf: a removed token
    assert r.top_values[1] == -math.inf and r.output_token_ids == [5, 6, 7]
    assert decode_entry("1-0", {PAYLOAD: payload(output_token_ids=[5, VOCAB, 7])}).output_token_ids[1] == VOCAB
    assert decode_entry("1-0", {PAYLOAD: params(top_k=-1, temperature=0.0)}).top_k == 0  # -1 disables, like 0


def test_poison_entries_in_a_batch_are_dead_lettered_and_the_rest_trained_and_acked(redis_server, tmp_path):
    target = trainer_target_checkpoint()
    draft = write_checkpoint(target, perturbed(checkpoint_tensors(target), seed=5, scale=1.0), tmp_path / "draft")
    stream = f"poison:{uuid.uuid4().hex[:8]}"
    srv = start_server(target, buffer=BufferConfig(redis_url=redis_server, stream=stream,
                                                   spool_dir=str(tmp_path / "spool")),
                       engine_kw={"drafter": str(draft), "spec": "fixed", "spec_k": 4})
    r = redis.Redis.from_url(redis_server)
    trainer = None
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            def rollouts(n: int, seed: int) -> None:
                want = r.xlen(stream) + n
                c.generate([[3 + i, 5, 8] for i in range(n)], max_tokens=12, temperature=1.0, seed=seed)
                wait_for(lambda: r.xlen(stream) == want, 30, f"{want} entries in the stream")

            rollouts(12, seed=1)
            [(_, good)] = r.xrange(stream, count=1)
            template = pb2.RolloutPayload.FromString(good[b"payload"])

            def poison(name: str, **edits) -> bytes:
                msg = pb2.RolloutPayload()
                msg.CopyFrom(template)
                msg.rollout_id = f"poison-{name}"
                for field, value in edits.items():
                    getattr(msg, field)[:] = value
                return msg.SerializeToString()

            out = list(template.output_token_ids)
            poisoned = {  # rollout_id field (bytes) -> the fault's kind
                b"\xff\xfe-header": ({"rollout_id": b"\xff\xfe-header", "payload": poison("header")}, "encoding"),
                b"poison-pb": ({"rollout_id": "poison-pb", "payload": b"\x08\xff\xff not a protobuf",
                                b"\xfe-field": b"\x80"}, "protobuf"),
                b"poison-vocab": ({"rollout_id": "poison-vocab",
                                   "payload": poison("vocab", output_token_ids=[VOCAB + 1, *out[1:]])}, "token_range"),
                b"poison-negative": ({"rollout_id": "poison-negative",
                                      "payload": poison("negative", prompt_token_ids=[-1, 5])}, "token_range"),
                b"poison-lengths": ({"rollout_id": "poison-lengths",
                                     "payload": poison("lengths", logprobs=list(template.logprobs)[:-1])}, "shape"),
                b"poison-nan": ({"rollout_id": "poison-nan", "payload": poison(
                    "nan", logprobs=[math.nan, *list(template.logprobs)[1:]])}, "non_finite"),
            }
            for fields, _ in poisoned.values():
                r.xadd(stream, fields)
            rollouts(12, seed=2)  # good entries before and after the poison, all in one read
        good_ids = {decode_entry(i.decode(), f).rollout_id for i, f in r.xrange(stream)
                    if f[b"rollout_id"] not in poisoned}
        assert len(good_ids) == 24
        cfg = TrainerConfig(server=srv.grpc_target, admin_token=ADMIN, redis_url=redis_server, stream=stream,
                            checkpoint_dir=str(tmp_path / "ckpt"), gate="always", read_count=64, min_new=8,
                            steps_per_round=2, block_ms=20, max_wait_s=0.2, info_interval_s=0.0, min_heldout=1000)
        trainer = build(cfg)
        pump(trainer)

        assert set(trainer.ledger.ids) == good_ids and trainer.ledger.taken_total == 24  # each good one, once
        assert trainer.metrics.steps._value.get() > 0  # and trained on
        assert r.xpending(stream, cfg.group)["pending"] == 0  # acked, or dead-lettered (and acked)
        dead = {f[b"rollout_id"]: f for _, f in r.xrange(cfg.dead_letter_stream)}
        assert set(dead) == set(poisoned)
        for rid, (fields, kind) in poisoned.items():
            assert dead[rid][b"dl_kind"] == kind.encode() and int(dead[rid][b"dl_deliveries"]) == 1
            assert all(dead[rid][k if isinstance(k, bytes) else k.encode()] == (v if isinstance(v, bytes)
                       else v.encode()) for k, v in fields.items())  # the entry as it was, bytes included
        registry = trainer.metrics.registry
        counts = {kind: registry.get_sample_value("specroll:trainer_entries_dead_lettered_total", {"reason": kind})
                  for kind in ("encoding", "protobuf", "token_range", "shape", "non_finite")}
        assert counts == {"encoding": 1, "protobuf": 1, "token_range": 2, "shape": 1, "non_finite": 1}
    finally:
        if trainer is not None:
            trainer.server.client.close()
        r.close()
        srv.stop()
