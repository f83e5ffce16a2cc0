"""The sidecar as a real process: kill -9 mid-batch, a restart under another consumer name (the lease the
killed one held expires; XAUTOCLAIM), duplicates and a poison entry (dead-letter). Every rollout is taken in
exactly once, none is lost."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import redis
from helpers import trainer_target_checkpoint
from probes import wait_for
from service_utils import ADMIN, checkpoint_tensors, perturbed, start_server, write_checkpoint

from client import SpecrollClient
from service.buffer import BufferConfig, decode_entry
from service.netutil import free_port

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger(__name__)


def sidecar(srv, redis_url: str, stream: str, ckpt: Path, consumer: str, log: Path,
            metrics_port: int | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "drafter_trainer", "--server", srv.grpc_target, "--admin-token", ADMIN,
           "--redis-url", redis_url, "--stream", stream, "--consumer", consumer, "--checkpoint-dir", str(ckpt),
           "--gate", "always", "--read-count", "16", "--min-new", "8", "--steps-per-round", "24",
           "--claim-idle-ms", "1500", "--block-ms", "100", "--max-wait-s", "0.3", "--max-deliveries", "2",
           "--info-interval-s", "0.2", "--min-heldout", "4", "--lease-ttl-ms", "1500"]
    if metrics_port:
        cmd += ["--metrics-port", str(metrics_port)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def state(ckpt: Path) -> dict:
    latest = ckpt / "LATEST"
    if not latest.is_file():
        return {}
    return json.loads((ckpt / latest.read_text().strip() / "state.json").read_text())


def pending_of(r: redis.Redis, stream: str, consumer: str | None = None) -> int:
    info = r.xpending(stream, "drafter-trainer")
    if consumer is None:
        return int(info["pending"])
    return sum(int(c["pending"]) for c in info["consumers"] if c["name"].decode() == consumer)


def mid_batch(proc: subprocess.Popen[bytes], ckpt: Path, r: redis.Redis, stream: str) -> bool:
    """Whether the sidecar is caught with a checkpoint written and entries in flight; it is left stopped
    (SIGSTOP) if so, else running. Checked while it runs, it could ack its batch between the check and a kill."""
    if not (state(ckpt).get("taken_total", 0) > 0 and pending_of(r, stream, "c1") > 0):
        return False
    proc.send_signal(signal.SIGSTOP)
    stat = Path(f"/proc/{proc.pid}/stat")
    for _ in range(200):  # until it is stopped ("T"), then let a write it sent before that reach Redis
        if stat.read_text().rsplit(") ", 1)[1].startswith("T"):
            break
        time.sleep(0.01)
    time.sleep(0.2)
    if state(ckpt).get("taken_total", 0) > 0 and pending_of(r, stream, "c1") > 0:
        return True
    proc.send_signal(signal.SIGCONT)
    return False


def test_kill9_mid_batch_restart_trains_every_rollout_exactly_once(redis_server, tmp_path):
    target = trainer_target_checkpoint()
    draft = write_checkpoint(target, perturbed(checkpoint_tensors(target), seed=5, scale=1.0), tmp_path / "draft")
    stream = f"recovery:{uuid.uuid4().hex[:8]}"
    srv = start_server(target, buffer=BufferConfig(redis_url=redis_server, stream=stream,
                                                   spool_dir=str(tmp_path / "spool")),
                       engine_kw={"drafter": str(draft), "spec": "fixed", "spec_k": 4})
    r = redis.Redis.from_url(redis_server)
    ckpt, log = tmp_path / "ckpt", tmp_path / "sidecar.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            c.generate([[3 + i, 5, 8] for i in range(40)], n=4, max_tokens=24, temperature=1.0, seed=1)
            wait_for(lambda: r.xlen(stream) == 160, 30, "160 rollouts in the stream")
            first = sidecar(srv, redis_server, stream, ckpt, "c1", log)
            procs.append(first)
            wait_for(lambda: mid_batch(first, ckpt, r, stream), 90, "a checkpoint and entries in flight")
            first.send_signal(signal.SIGKILL)  # stopped mid-batch (SIGSTOP), so nothing moved since the check
            first.wait(10)
            at_kill = state(ckpt).get("taken_total", 0)
            in_flight = pending_of(r, stream, "c1")
            assert 0 < at_kill < 160 and in_flight > 0, (at_kill, in_flight)
            c.generate([[9, 9 + i] for i in range(20)], n=2, max_tokens=24, temperature=1.0, seed=2)
        wait_for(lambda: r.xlen(stream) == 200, 30, "200 rollouts in the stream")
        entries = r.xrange(stream)
        rollout_ids = {decode_entry(i.decode(), f).rollout_id for i, f in entries}
        assert len(rollout_ids) == 200
        r.xadd(stream, dict(entries[5][1]))  # an at-least-once duplicate of a rollout
        r.xadd(stream, {"rollout_id": "poison", "payload": b"\x08\xff\xff not a protobuf"})
        port = free_port()
        second = sidecar(srv, redis_server, stream, ckpt, "c2", log, metrics_port=port)
        procs.append(second)

        def done() -> bool:
            return (state(ckpt).get("taken_total") == 200 and pending_of(r, stream) == 0
                    and r.exists(f"{stream}:dead") and r.xlen(f"{stream}:dead") == 1)

        wait_for(done, 120, "the restarted sidecar to take in everything")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
        final = state(ckpt)
        ledger = dict(final["ledger"])
        assert len(final["ledger"]) == len(ledger) == final["taken_total"] == 200  # each id once
        assert set(ledger) == rollout_ids  # none lost
        assert set(ledger.values()) <= {"train", "eval"} and "eval" in ledger.values()
        [(_, dead)] = r.xrange(f"{stream}:dead")
        assert dead[b"rollout_id"] == b"poison" and b"payload" in dead[b"dl_reason"]
        assert int(dead[b"dl_deliveries"]) == 1 and dead[b"dl_kind"] == b"protobuf"  # at once: no retry decodes it
        assert 'specroll:trainer_entries_dead_lettered_total{reason="protobuf"} 1.0' in metrics
        assert "specroll:trainer_lease_held 1.0" in metrics  # the killed one's lease expired; c2 took it
        assert "specroll:trainer_entries_duplicate_total" in metrics
        info = r.xinfo_groups(stream)[0]
        assert info["pending"] == 0 and info["lag"] == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        r.close()
        srv.stop()
        if log.is_file():
            logger.info("sidecar log:\n%s", log.read_text()[-3000:])  # shown by pytest when the test fails
