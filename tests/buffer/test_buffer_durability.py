"""A rollout a client received survives a kill -9 of the server: it was in Redis or fsync'd in the spool
before the client got its final message. Real processes: `specroll serve`, redis-server, gRPC and HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import redis
from helpers import stop_process
from probes import wait_for
from redis_utils import OwnRedis
from service_utils import ADMIN

from client import SpecrollClient
from service.buffer import decode_entry
from service.netutil import free_port

ROOT = Path(__file__).resolve().parents[2]
STREAM = "test:durable"


class Serve:
    """`python -m service.cli serve` with a Redis buffer and a spool folder, killed with SIGKILL."""

    def __init__(self, model: Path, redis_url: str, spool: Path, log: Path) -> None:
        self.http, self.grpc = free_port(), free_port()
        env = dict(os.environ, SPECROLL_ADMIN_TOKEN=ADMIN)
        cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--http-port", str(self.http),
               "--grpc-port", str(self.grpc), "--max-model-len", "128", "--max-num-seqs", "16",
               "--redis-url", redis_url, "--buffer-stream", STREAM, "--spool-dir", str(spool)]
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        wait_for(self._ready, 120, "server ready")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return httpx.get(f"http://127.0.0.1:{self.http}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        stop_process(self.proc, 30)


def stream_ids(url: str) -> list[str]:
    r = redis.Redis.from_url(url)
    try:
        return [decode_entry(i.decode(), f).rollout_id for i, f in r.xrange(STREAM)]
    finally:
        r.close()


def test_kill9_with_redis_down_loses_no_received_rollout(model_dir, tmp_path):
    """Redis goes down, clients keep receiving rollouts, the server is killed -9 at once: every received
    rollout is replayed into Redis by the next start, exactly once."""
    own = OwnRedis(tmp_path)
    own.start()
    spool = tmp_path / "spool"
    srv = Serve(model_dir, own.url, spool, tmp_path / "serve.log")
    received: list[str] = []
    try:
        with SpecrollClient(srv.target, admin_token=ADMIN) as c:
            comps = c.generate([[3, 4, 5 + j] for j in range(10)], n=2, max_tokens=6, temperature=1.0, seed=1)
            received += [s.rollout_id for comp in comps for s in comp.samples]
            wait_for(lambda: len(stream_ids(own.url)) == 20, 30, "first 20 rollouts in Redis")
            own.stop()
            for i in range(3):  # 90 rollouts while Redis is down: far fewer than the in-memory queue holds
                comps = c.generate([[6, 7, 8 + j] for j in range(15)], n=2, max_tokens=6, temperature=1.0,
                                   seed=10 + i)
                received += [s.rollout_id for comp in comps for s in comp.samples]
            r = httpx.post(f"http://127.0.0.1:{srv.http}/v1/completions",
                           json={"prompt": [9, 9, 9], "n": 3, "max_tokens": 5, "temperature": 1.0})
            assert r.status_code == 200, r.text
            received += [choice["rollout_id"] for choice in r.json()["choices"]]
        srv.kill()
    finally:
        srv.stop()
    assert len(received) == 113 and len(set(received)) == 113
    own.start()
    srv = Serve(model_dir, own.url, spool, tmp_path / "serve2.log")
    try:
        wait_for(lambda: len(stream_ids(own.url)) >= 113, 60, "spool replayed after the restart")
        ids = stream_ids(own.url)
        assert sorted(ids) == sorted(received)  # none lost, none twice
    finally:
        srv.stop()
        own.stop()


def test_kill9_under_streaming_load_loses_no_received_rollout(model_dir, tmp_path):
    """Clients stream rollouts continuously (Redis up) and the server is killed -9 in the middle: every
    rollout a client received a final message for is in Redis."""
    own = OwnRedis(tmp_path)
    own.start()
    srv = Serve(model_dir, own.url, tmp_path / "spool", tmp_path / "serve.log")
    received: list[str] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        try:
            with SpecrollClient(srv.target, admin_token=ADMIN, retries=0) as c:
                for i in range(1000):
                    for comp in c.generate([[seed, i % 50 + 1, 2]], n=4, max_tokens=8, temperature=1.0):
                        with lock:
                            received.extend(s.rollout_id for s in comp.samples)
        except Exception:  # the server is gone
            return

    threads = [threading.Thread(target=client, args=(s,)) for s in range(1, 5)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(received) >= 120, 120, "rollouts under load")
        srv.kill()
        for t in threads:
            t.join(60)
        with lock:
            got = list(received)
        ids = stream_ids(own.url)
        assert set(got) <= set(ids), f"{len(set(got) - set(ids))} received rollouts missing from Redis"
        assert len(ids) == len(set(ids))
    finally:
        srv.stop()
        own.stop()
