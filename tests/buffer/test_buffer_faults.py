"""The buffer's disk and Redis failing under a running server: generation and final messages never stop,
what is lost is counted, the failure is visible (/ready, metrics) and the buffer recovers by itself.

Real parts: the server's gRPC and HTTP APIs, redis-server stopped and started, the spool on a 256 KiB
tmpfs that really runs out of space.
"""

from __future__ import annotations

import logging

import httpx
import pytest
import redis
from fs_utils import fill
from probes import metric, wait_for
from redis_utils import OwnRedis
from service_utils import ADMIN, start_server

from client import SpecrollClient
from service.buffer import BufferConfig, RedisBuffer
from service.buffer.codec import spool_rollout
from service.protogen import pb2


def test_full_spool_disk_with_redis_down_never_stops_generation(model_dir, tiny_fs, tmp_path):
    """Redis down and the spool's disk full: every request still gets all its final messages, the records
    that found no room are counted as lost (exactly those are missing later), /ready and the metrics say
    the disk is full. Redis back: the spool and the queue are replayed. Space freed: the buffer spools
    again as before. It used to leave a torn record that killed the buffer's writer: no final message was
    sent again, on any API, until a restart."""
    own = OwnRedis(tmp_path)
    own.start()
    stream = "test:diskfull"
    cfg = BufferConfig(redis_url=own.url, stream=stream, spool_dir=str(tiny_fs / "spool"), queue_max=16,
                       socket_timeout_s=0.3, spool_segment_bytes=16 << 10)
    srv = start_server(model_dir, buffer=cfg)
    buffer = srv.server.buffer
    assert isinstance(buffer, RedisBuffer)
    received: list[str] = []

    def ready() -> dict:
        r = httpx.get(f"{srv.http_url}/ready", timeout=10)
        assert r.status_code == 200, r.text  # the server keeps serving: it stays in rotation
        return r.json()

    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN, timeout_s=120, retries=0) as c:
            def batch(seed: int, n: int = 25) -> None:
                comps = c.generate([[5, 6, 7 + j] for j in range(n)], n=2, max_tokens=8, temperature=1.0,
                                   seed=seed)
                got = [s.rollout_id for comp in comps for s in comp.samples]
                assert len(got) == 2 * n  # every final message arrived
                received.extend(got)

            batch(0)
            wait_for(lambda: buffer.written["rollout"] == 50, 30, "first 50 written")
            filler = fill(tiny_fs, leave=12 << 10)
            own.stop()
            for i in range(1, 7):  # 300 rollouts with nowhere to go but a disk with room for a few dozen
                batch(i)
            wait_for(lambda: buffer.lost_count() > 0, 30, "records lost to the full disk")
            assert buffer.spool.disk_full and "spool_disk_full" in ready()["degraded"]
            text = srv.server.metrics.render().decode()
            assert metric(text, "specroll:buffer_spool_disk_full") == 1
            assert metric(text, 'specroll:buffer_dropped_total{reason="disk_full"}') == buffer.lost_count()
            assert buffer.spool.corrupt == 0

            own.start()
            batch(10)
            wait_for(lambda: buffer.queued == 0 and len(buffer.spool) == 0 and not buffer._spooling, 60,
                     "queue and spool replayed")
            filler.unlink()
            wait_for(lambda: not buffer.spool.disk_full, 10, "the disk has room again")
            assert ready()["degraded"] == []

            lost_before = buffer.lost_count()
            own.stop()
            batch(20)  # Redis down again, the disk has room: nothing more is lost
            wait_for(lambda: buffer.spool.spooled > 0 and buffer.queued + len(buffer.spool) >= 50, 30,
                     "spooled while Redis is down")
            own.start()
            batch(21)
            wait_for(lambda: buffer.queued == 0 and len(buffer.spool) == 0, 60, "replayed again")
            assert buffer.lost_count() == lost_before
        r = redis.Redis.from_url(own.url)
        ids = {f[b"rollout_id"].decode() for _, f in r.xrange(stream)}
        r.close()
        missing = set(received) - ids
        assert len(received) == 500 and len(set(received)) == 500
        assert 0 < len(missing) == lost_before  # lost = exactly what was counted
        assert buffer.writer_errors == 0 and buffer._thread.is_alive()
    finally:
        srv.stop()
        own.stop()


def rollout(i: int) -> bytes:
    return spool_rollout(pb2.RolloutPayload(rollout_id=f"r{i}", output_token_ids=[1, 2], logprobs=[-1.0, -1.0],
                                            finish_reason="length"))


@pytest.mark.parametrize("how", ["flushall", "restart_without_persistence"])
def test_a_redis_that_lost_its_data_is_reported(tmp_path, caplog, how):
    """The buffer keeps a marker key in Redis; a FLUSHALL or a restart that comes back empty removes it, and
    the next write says so: a counter (specroll:buffer_redis_data_lost_total) and an error in the log."""
    own = OwnRedis(tmp_path)
    own.start()
    cfg = BufferConfig(redis_url=own.url, stream="test:lost", spool_dir=str(tmp_path / "spool"),
                       socket_timeout_s=0.3)
    buffer = RedisBuffer(cfg)
    try:
        for i in range(10):
            buffer.submit(rollout(i))
        assert buffer.flush(30)
        for i in range(10, 20):
            buffer.submit(rollout(i))
        assert buffer.flush(30) and buffer.redis_data_lost == 0  # writes alone do not raise it
        if how == "flushall":
            redis.Redis.from_url(own.url).flushall()
        else:
            own.stop()
            for f in tmp_path.rglob("appendonly*"):  # the restart comes back with nothing
                if f.is_file():
                    f.unlink()
            own.start()
        with caplog.at_level(logging.ERROR, logger="service.buffer.redis_buffer"):
            buffer.submit(rollout(20))
            assert buffer.flush(30)
            wait_for(lambda: buffer.redis_data_lost == 1, 10, "data loss noticed")
        assert any("Redis lost its data" in rec.getMessage() for rec in caplog.records)
        buffer.submit(rollout(21))
        assert buffer.flush(30) and buffer.redis_data_lost == 1  # once per loss
    finally:
        buffer.close()
        own.stop()


def stream_ids(url: str, stream: str) -> list[str]:
    r = redis.Redis.from_url(url)
    try:
        return [f[b"rollout_id"].decode() for _, f in r.xrange(stream)]
    finally:
        r.close()


def test_an_undecodable_record_is_counted_and_skipped(redis_server, tmp_path):
    """A record that is not a spool record at all, queued between good ones: it is counted as lost and the
    rest reach Redis (a decode error used to kill the writer: no final message was sent again)."""
    stream = "test:undecodable"
    buffer = RedisBuffer(BufferConfig(redis_url=redis_server, stream=stream, spool_dir=str(tmp_path / "spool")))
    called = []
    try:
        buffer.submit(rollout(0), lambda: called.append(0))
        buffer.submit(b"\xff\xfe not a protobuf", lambda: called.append(1))
        buffer.submit(rollout(2), lambda: called.append(2))
        assert buffer.flush(30)
        buffer.submit(rollout(3), lambda: called.append(3))
        assert buffer.flush(30)
        assert stream_ids(redis_server, stream) == ["r0", "r2", "r3"]
        assert sorted(called) == [0, 1, 2, 3] and buffer.lost["undecodable"] == 1
        assert buffer.stats()["lost_undecodable"] == 1
    finally:
        buffer.close()


def spool_of_12(folder):
    from service.buffer.spool import Spool

    spool = Spool(folder, max_bytes=1 << 20, segment_bytes=150)
    for i in range(12):
        spool.append(rollout(i))
    spool.close()
    segments = sorted(folder.glob("seg-*"))
    assert len(segments) >= 3
    return segments, [s.count for s in Spool(folder, max_bytes=1 << 20, segment_bytes=150)._segments]


def test_an_unreadable_segment_is_set_aside_and_the_rest_replayed(redis_server, tmp_path):
    """A spool segment that cannot be read (a folder where the file was), found while the spool runs or at
    start: it is renamed *.bad and counted; the server starts and the other segments reach Redis."""
    from service.buffer.spool import Spool

    segments, counts = spool_of_12(tmp_path / "running")
    running = Spool(tmp_path / "running", max_bytes=1 << 20, segment_bytes=150)
    segments[1].unlink()
    segments[1].mkdir()  # open() now fails with IsADirectoryError
    out = []
    while got := running.peek(5):
        out += got
        running.commit(len(got))
    assert len(out) == 12 - counts[1] and running.lost["spool_error"] == counts[1]

    folder, stream = tmp_path / "start", "test:unreadable"
    segments, counts = spool_of_12(folder)
    segments[0].unlink()
    segments[0].mkdir()
    buffer = RedisBuffer(BufferConfig(redis_url=redis_server, stream=stream, spool_dir=str(folder),
                                      spool_segment_bytes=150, spool_max_bytes=1 << 20))
    try:
        assert buffer.spool.corrupt == 1
        wait_for(lambda: len(buffer.spool) == 0 and not buffer._spooling, 30, "spool replayed")
        assert stream_ids(redis_server, stream) == [f"r{i}" for i in range(counts[0], 12)]
        assert list(folder.glob("*.bad"))
    finally:
        buffer.close()


def test_the_writer_survives_any_exception(redis_server, tmp_path, monkeypatch):
    """Fault injection: reading the spool raises an unexpected error (not an OSError, not a Redis error) a
    few times. The writer counts it, backs off and carries on; every record reaches Redis."""
    stream = "test:writer"
    cfg = BufferConfig(redis_url=redis_server, stream=stream, spool_dir=str(tmp_path / "spool"), queue_max=1)
    buffer = RedisBuffer(cfg)
    peek, failures = buffer.spool.peek, [3]

    def failing_peek(n: int) -> list[bytes]:
        if failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("injected")
        return peek(n)

    monkeypatch.setattr(buffer.spool, "peek", failing_peek)
    called = []
    try:
        with buffer._cond:  # the next records go to the spool (as while Redis is behind)
            buffer._spooling = True
        for i in range(5):
            buffer.submit(rollout(i), lambda i=i: called.append(i))
        wait_for(lambda: len(called) == 5, 30, "every stored callback")
        assert buffer.flush(30)
        assert stream_ids(redis_server, stream) == [f"r{i}" for i in range(5)]
        assert buffer.writer_errors == 3 and buffer._thread.is_alive()
    finally:
        buffer.close()
