"""One trainer per consumer group: the lease in a real redis-server, and two sidecars (the sidecar's own loop, in
two threads) on one group against a real server: one trains, the other stands by and takes over; a trainer
whose lease was taken pushes, checkpoints and acks nothing."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

import pytest
import redis
from helpers import trainer_target_checkpoint
from probes import wait_for
from service_utils import ADMIN, checkpoint_tensors, perturbed, start_server, write_checkpoint

from client import SpecrollClient
from drafter_trainer.cli import build, serve
from drafter_trainer.config import TrainerConfig
from drafter_trainer.lease import Lease, lease_key
from drafter_trainer.metrics import TrainerMetrics
from service.buffer import BufferConfig


def value(metric) -> float:
    return metric._value.get()


def test_the_lease_is_exclusive_renewed_and_released_only_by_its_holder(redis_server):
    r = redis.Redis.from_url(redis_server)
    key = lease_key(f"lease:{uuid.uuid4().hex[:8]}", "g")
    ma, mb = TrainerMetrics(), TrainerMetrics()
    a, b = Lease(r, key, "a", 1500, ma), Lease(r, key, "b", 1500, mb)
    assert a.try_acquire() and not b.try_acquire()
    time.sleep(2.0)  # longer than the TTL: the holder's renewals keep it
    assert a.held and a.confirm() and r.get(key).startswith(b"a:") and value(ma.lease_held) == 1

    stop = threading.Event()
    got: list[bool] = []
    standby = threading.Thread(target=lambda: got.append(b.acquire(stop)))
    standby.start()
    try:
        time.sleep(0.5)
        assert not got and value(mb.lease_held) == 0  # stands by while "a" holds it
        a.release()  # "b" takes it at once
        standby.join(10)
        assert got == [True] and b.held and r.get(key).startswith(b"b:") and value(mb.lease_acquired) == 1
        assert not a.confirm() and not a.held
        a.release()  # no longer a's: b's lease stays
        assert r.get(key).startswith(b"b:")

        r.delete(key)  # what expiry does when "b" stalls past the TTL
        c = Lease(r, key, "c", 1500)
        assert c.try_acquire()
        assert not b.confirm() and not b.held  # fenced: "b" finds its token gone
        assert value(mb.lease_lost) == 1 and value(mb.lease_held) == 0
        b.release()
        assert r.get(key).startswith(b"c:")  # "b" could not delete c's lease
        c.release()
        assert r.get(key) is None
    finally:
        stop.set()
        standby.join(10)
        r.close()


def checkpoint_state(ckpt) -> dict:
    latest = ckpt / "LATEST"
    return json.loads((ckpt / latest.read_text().strip() / "state.json").read_text()) if latest.is_file() else {}


def test_two_sidecars_on_one_group_one_trains_and_a_lost_lease_stops_the_old_holder(redis_server, tmp_path,
                                                                                    caplog):
    target = trainer_target_checkpoint()
    draft = write_checkpoint(target, perturbed(checkpoint_tensors(target), seed=5, scale=1.0), tmp_path / "draft")
    stream = f"lease:{uuid.uuid4().hex[:8]}"
    srv = start_server(target, buffer=BufferConfig(redis_url=redis_server, stream=stream,
                                                   spool_dir=str(tmp_path / "spool")),
                       engine_kw={"drafter": str(draft), "spec": "fixed", "spec_k": 4})
    r = redis.Redis.from_url(redis_server)
    ckpt = tmp_path / "ckpt"  # shared, as two sidecars on one group would share it

    def config(name: str) -> TrainerConfig:
        return TrainerConfig(server=srv.grpc_target, admin_token=ADMIN, redis_url=redis_server, stream=stream,
                             consumer=name, version_prefix=name, checkpoint_dir=str(ckpt), gate="always",
                             min_new=8, steps_per_round=2, block_ms=20, max_wait_s=0.2, info_interval_s=0.0,
                             min_heldout=1000, lease_ttl_ms=1000, claim_idle_ms=1500)

    metrics = {name: TrainerMetrics() for name in "ab"}
    stops = {name: threading.Event() for name in "ab"}
    threads = {name: threading.Thread(target=serve, args=(config(name), stops[name], metrics[name]), daemon=True)
               for name in "ab"}

    def consumed(name: str) -> float:
        return value(metrics[name].consumed)

    def taken() -> int:
        return int(checkpoint_state(ckpt).get("taken_total", 0))

    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c, caplog.at_level(logging.INFO):
            def rollouts(n: int, seed: int) -> None:
                want = r.xlen(stream) + n
                c.generate([[3 + i, 5, 8] for i in range(n)], max_tokens=12, temperature=1.0, seed=seed)
                wait_for(lambda: r.xlen(stream) == want, 30, f"{want} entries in the stream")

            rollouts(16, seed=1)
            threads["a"].start()
            wait_for(lambda: taken() == 16, 60, "a to take in and checkpoint 16 rollouts")
            threads["b"].start()
            wait_for(lambda: "standby: the consumer group is trained by a" in caplog.text, 30, "b in standby")
            rollouts(8, seed=2)
            wait_for(lambda: taken() == 24 and r.xpending(stream, "drafter-trainer")["pending"] == 0, 60,
                     "a to take in 8 more")
            assert consumed("b") == 0 and value(metrics["b"].lease_held) == 0 and value(metrics["a"].lease_held) == 1

            stops["a"].set()  # "a" stops and releases: "b" takes over from the shared checkpoint at once
            threads["a"].join(30)
            rollouts(8, seed=3)
            wait_for(lambda: taken() == 32, 60, "b to take over")
            assert value(metrics["b"].lease_held) == 1 and consumed("b") == 8
            assert {rid for rid, _ in checkpoint_state(ckpt)["ledger"]} == {
                f[b"rollout_id"].decode() for _, f in r.xrange(stream)}  # each once, across the takeover

            key = lease_key(stream, "drafter-trainer")
            r.delete(key)  # "b" stalled past the TTL (its lease expired) and another trainer took the group
            other = Lease(r, key, "other", 1000)
            assert other.try_acquire()
            wait_for(lambda: value(metrics["b"].lease_lost) == 1, 30, "b to find its lease gone")
            round_before = checkpoint_state(ckpt)["round"]
            rollouts(8, seed=4)
            time.sleep(1.0)
            assert value(metrics["b"].lease_held) == 0 and consumed("b") == 8  # stopped: reads nothing more
            assert checkpoint_state(ckpt)["round"] == round_before and taken() == 32

            # A trainer holding the lease when it is taken: its push is fenced and its checkpoint skipped.
            stops["b"].set()
            threads["b"].join(30)
            other.release()
            lease = Lease(redis.Redis.from_url(redis_server), key, "c", 1000)
            assert lease.try_acquire()
            trainer = build(config("c"), lease=lease)
            try:
                # The 8 new ones. "b" may have read the first just as it found its lease gone: that one stays in
                # b's pending list and comes to "c" by XAUTOCLAIM once idle for claim_idle_ms.
                wait_for(lambda: trainer.take_in(trainer.source.read(64, 20)) or len(trainer.ledger.held) >= 8, 30,
                         "c to hold the 8 new entries")
                assert len(trainer.ledger.held) == 8
                r.delete(key)
                taker = Lease(r, key, "other", 1000)
                assert taker.try_acquire()
                assert not trainer._push(trainer.student.module, "c-1")
                assert value(trainer.metrics.pushes.labels("fenced")) == 1
                assert "c-1" not in c.server_info().drafter_version
                trainer.commit()
                assert taken() == 32 and r.xpending(stream, "drafter-trainer")["pending"] == 8  # no checkpoint, no ack
                taker.release()
            finally:
                trainer.server.client.close()
                lease.release()
    finally:
        for stop in stops.values():
            stop.set()
        for t in threads.values():
            if t.is_alive():
                t.join(30)
        r.close()
        srv.stop()


def test_a_lease_ttl_below_100_ms_is_refused():
    with pytest.raises(ValueError, match="lease_ttl_ms"):
        TrainerConfig(lease_ttl_ms=50)
    assert TrainerConfig(lease_ttl_ms=0).lease_ttl_ms == 0  # no lease
