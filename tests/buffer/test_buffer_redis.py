"""Rollouts through a running server into a real Redis stream; rewards joined; a Redis outage mid-run."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from probes import metric, wait_for
from redis_utils import OwnRedis
from service_utils import ADMIN, start_server

from client import SpecrollClient
from service.buffer import BufferConfig, decode_entry


def test_1000_rollouts_land_in_the_stream_with_rewards_joined(model_dir, redis_server, tmp_path):
    stream = f"test:{uuid.uuid4().hex[:8]}"
    cfg = BufferConfig(redis_url=redis_server, stream=stream, spool_dir=str(tmp_path / "spool"), maxlen=5000)
    srv = start_server(model_dir, buffer=cfg)
    r = redis.Redis.from_url(redis_server)
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            prompts = [[1 + i % 200, 2 + i % 7, 3] for i in range(250)]
            comps = c.generate(prompts, n=4, max_tokens=6, temperature=1.0, seed=3, top_logprobs=2,
                               group_ids=[f"g{i}" for i in range(250)], metadata={"task": "sum"})
            samples = {s.rollout_id: (comp, s) for comp in comps for s in comp.samples}
            assert len(samples) == 1000
            rewards = {rid: float(i % 5) for i, rid in enumerate(samples)}
            assert c.report_rewards(rewards) == 1000
            wait_for(lambda: r.xlen(stream) >= 1000 and r.exists(cfg.rewards_prefix + next(iter(rewards))),
                     60, "1000 stream entries")
            time.sleep(0.3)
        entries = r.xrange(stream)
        assert len(entries) == 1000
        seen = set()
        for entry_id, fields in entries:
            rollout = decode_entry(entry_id.decode(), fields)
            comp, s = samples[rollout.rollout_id]
            seen.add(rollout.rollout_id)
            assert fields[b"rollout_id"].decode() == rollout.rollout_id
            assert fields[b"group_id"].decode() == rollout.group_id == f"g{prompts.index(comp.prompt_token_ids)}"
            assert fields[b"policy_version"] == b"0" and fields[b"finish_reason"].decode() == s.finish_reason
            assert int(fields[b"num_output_tokens"]) == len(s.token_ids) == len(rollout.output_token_ids)
            assert int(fields[b"num_prompt_tokens"]) == 3 and rollout.prompt_token_ids == comp.prompt_token_ids
            assert rollout.output_token_ids == s.token_ids
            assert rollout.logprobs == pytest.approx(s.logprobs, abs=1e-6)
            assert rollout.metadata == {"task": "sum"} and rollout.policy_versions == ["0"]
        assert seen == set(samples)
        values = r.mget([cfg.rewards_prefix + rid for rid in samples])
        assert [float(v) for v in values] == [rewards[rid] for rid in samples]
        metrics = srv.server.metrics.render().decode()
        assert metric(metrics, 'specroll:buffer_written_total{kind="rollout"}') == 1000
        assert metric(metrics, 'specroll:buffer_written_total{kind="reward"}') == 1000
        assert metric(metrics, "specroll:buffer_spooled_total") == 0
    finally:
        srv.stop()
        r.close()


def test_redis_outage_spools_then_replays_in_order(model_dir, tmp_path):
    own = OwnRedis(tmp_path)
    own.start()
    stream = "test:outage"
    cfg = BufferConfig(redis_url=own.url, stream=stream, spool_dir=str(tmp_path / "spool"), queue_max=16,
                       socket_timeout_s=0.3)
    srv = start_server(model_dir, buffer=cfg)
    buffer = srv.server.buffer
    # The order the server handed rollouts to the buffer (the hooks thread calls this just before the buffer).
    # Not finished_at: wall-clock stamps a few hundred microseconds apart came out of order once in CI.
    handed: list[str] = []
    srv.server.hooks.on_rollout_finished.append(lambda record: handed.append(record.rollout_id))
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            def batch(i: int) -> float:
                start = time.perf_counter()
                comps = c.generate([[5, 6, 7 + j] for j in range(25)], n=2, max_tokens=8, temperature=1.0, seed=i)
                assert sum(len(comp.samples) for comp in comps) == 50
                return time.perf_counter() - start

            up = batch(0)
            wait_for(lambda: buffer.written["rollout"] == 50, 60, "first 50 written")
            own.stop()
            down = [batch(i) for i in range(1, 5)]  # 200 rollouts while Redis is down
            assert max(down) < max(10.0, 5 * up), f"generation slowed down without Redis: {down} vs {up}"
            wait_for(lambda: len(buffer.spool) + buffer.queued == 200, 30, "200 records kept aside")
            assert buffer.spool.spooled >= 200 - cfg.queue_max and not buffer.redis_up
            own.start()
            batch(5)
            wait_for(lambda: buffer.written["rollout"] == 300 and len(buffer.spool) == 0, 60, "spool replayed")
        r = redis.Redis.from_url(own.url)
        entries = r.xrange(stream)
        rollouts = [decode_entry(i.decode(), f) for i, f in entries]
        assert len(rollouts) == 300 and len({x.rollout_id for x in rollouts}) == 300  # 0 lost
        assert [x.rollout_id for x in rollouts] == handed  # queue, spool and replay kept the order
        assert buffer.spool.replayed == buffer.spool.spooled and buffer.spool.dropped == 0
        metrics = srv.server.metrics.render().decode()
        assert metric(metrics, "specroll:buffer_spooled_total") == buffer.spool.spooled
        assert metric(metrics, "specroll:buffer_replayed_total") == buffer.spool.replayed
        assert metric(metrics, 'specroll:buffer_dropped_total{reason="spool_full"}') == 0
        r.close()
    finally:
        srv.stop()
        own.stop()


def test_unwritten_rollouts_survive_a_server_restart_in_the_spool(model_dir, tmp_path):
    own = OwnRedis(tmp_path)
    cfg = BufferConfig(redis_url=own.url, stream="test:restart", spool_dir=str(tmp_path / "spool"),
                       socket_timeout_s=0.2, close_timeout_s=0.5)
    srv = start_server(model_dir, buffer=cfg)  # Redis is not even running
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            c.generate([[1, 2, 3]], n=8, max_tokens=4, temperature=1.0)
            c.report_rewards({"x:0": 1.5})
        wait_for(lambda: srv.server.buffer.spool.spooled + srv.server.buffer.queued == 9, 10, "9 records kept aside")
    finally:
        srv.stop()
    own.start()
    srv = start_server(model_dir, buffer=cfg)
    try:
        r = redis.Redis.from_url(own.url)
        wait_for(lambda: r.xlen("test:restart") == 8 and r.get(cfg.rewards_prefix + "x:0") == b"1.5", 30,
                 "spool from the previous run replayed")
        r.close()
    finally:
        srv.stop()
        own.stop()
