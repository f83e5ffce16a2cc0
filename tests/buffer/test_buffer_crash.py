"""kill -9 at every step of the spool's prepend and replay: nothing already in the spool is lost.

Each case runs the spool in a child process (tests/buffer/spool_child.py) that exits with 137, without any
clean-up, right after one file system call of the step under test (every one in turn), or at a named
fault-injection point (SPECROLL_SPOOL_FAULT). The spool is then reopened here: every record that was in
it is still there or was delivered before the crash (duplicates are allowed: at-least-once).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from redis_utils import OwnRedis

from service.buffer.spool import Spool

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("spool_child.py")
FAULT_ENV = "SPECROLL_SPOOL_FAULT"
sys.path.insert(0, str(CHILD.parent))
from spool_child import SEGMENT_BYTES, records  # noqa: E402


def child(mode: str, folder: Path, k: int = 0, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != FAULT_ENV}
    env["PYTHONPATH"] = str(ROOT)
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, str(CHILD), mode, str(folder), *([str(k)] if k else [])], env=env,
                          capture_output=True, text=True, timeout=120)


def drain(folder: Path) -> list[bytes]:
    spool = Spool(folder, max_bytes=1 << 20, segment_bytes=SEGMENT_BYTES)
    out = []
    while got := spool.peek(16):
        out += got
        spool.commit(len(got))
    spool.close()
    return out


def check_prepend(folder: Path, completed: bool) -> None:
    out = drain(folder)
    unread = records(20)[5:]  # in the spool before the prepend (the first 5 were read and committed)
    assert out[-15:] == unread, f"records already in the spool were lost: {len(set(unread) - set(out))}"
    if completed:  # prepend returned: its records are durable, and first
        assert out == records(3, start=100) + unread
    else:
        assert out in (unread, records(3, start=100) + unread)


def test_kill_after_each_file_system_step_of_prepend(tmp_path):
    """The head segment is half read when records are prepended; the process dies after the 1st, 2nd, ...
    file system call of the prepend. It used to delete the half-read head before its copy was committed."""
    for k in range(1, 12):
        folder = tmp_path / f"k{k}"
        out = child("prepend", folder, k)
        assert out.returncode in (0, 137), out.stderr
        check_prepend(folder, out.returncode == 0)
        if out.returncode == 0:
            assert k > 2  # the crash points were really reached
            return
    pytest.fail("prepend did not finish within 11 file system calls")


@pytest.mark.parametrize("point", ["prepend:half_written", "prepend:written", "prepend:committed"])
def test_kill_at_each_named_point_of_prepend(tmp_path, point):
    out = child("prepend", tmp_path, fault=point)
    assert out.returncode == 137, f"the fault point {point} was not reached: {out.stderr[-2000:]}"
    check_prepend(tmp_path, point == "prepend:committed")


def check_replay(folder: Path, out: subprocess.CompletedProcess[str]) -> None:
    delivered = [line.encode() for line in out.stdout.splitlines() if line != "done"]
    rest = drain(folder)
    assert set(records(20)) <= set(delivered) | set(rest), "a spooled record was neither delivered nor kept"
    assert len(set(rest)) == len(rest)


def fill_spool(folder: Path) -> None:
    spool = Spool(folder, max_bytes=1 << 20, segment_bytes=SEGMENT_BYTES)
    for r in records(20):
        spool.append(r)
    spool.close()


def test_kill_after_each_file_system_step_of_replay(tmp_path):
    """Records are read, delivered and committed in batches of 4 across 3 segments (HEAD saves, deletions of
    fully read segments); the process dies after each file system call of that in turn."""
    for k in range(1, 30):
        folder = tmp_path / f"k{k}"
        fill_spool(folder)
        out = child("replay", folder, k)
        assert out.returncode in (0, 137), out.stderr
        check_replay(folder, out)
        if out.returncode == 0:
            assert k > 5
            return
    pytest.fail("replay did not finish within 29 file system calls")


@pytest.mark.parametrize("point", ["commit:saved:2", "remove:unlinked:2"])
def test_kill_at_each_named_point_of_replay(tmp_path, point):
    fill_spool(tmp_path)
    out = child("replay", tmp_path, fault=point)
    assert out.returncode == 137, f"the fault point {point} was not reached: {out.stderr[-2000:]}"
    check_replay(tmp_path, out)


BUFFER_CHILD = Path(__file__).with_name("buffer_child.py")


def buffer_child(*args: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != FAULT_ENV}
    env["PYTHONPATH"] = str(ROOT)
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, str(BUFFER_CHILD), *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_kill9_at_each_step_of_a_real_replay_into_redis(tmp_path):
    """40 rollouts are acknowledged (stored called) with Redis down and the server is killed -9; the next
    start replays them into a real Redis and is killed -9 at each step of that replay in turn (after a read,
    after the Redis write, after saving the read position, after deleting a read segment); a third start
    finishes. Every acknowledged rollout is in the stream (duplicates allowed, consumers dedupe)."""
    own = OwnRedis(tmp_path)
    spooled = buffer_child("spool", own.url, "test:crash", str(tmp_path / "spool0"), "40")  # Redis not started
    assert spooled.returncode == 137, spooled.stderr[-3000:]
    acked = spooled.stdout.split()
    assert len(acked) == 40
    own.start()
    r = redis.Redis.from_url(own.url)
    try:
        for i, point in enumerate(["replay:peeked:2", "replay:written:2", "commit:saved:2", "remove:unlinked:1"]):
            folder, stream = tmp_path / f"spool{i + 1}", f"test:crash{i}"
            shutil.copytree(tmp_path / "spool0", folder)
            killed = buffer_child("replay", own.url, stream, str(folder), fault=point)
            assert killed.returncode == 137, f"{point} not reached: {killed.stderr[-3000:]}"
            finished = buffer_child("replay", own.url, stream, str(folder))
            assert finished.returncode == 0 and finished.stdout.strip() == "done", finished.stderr[-3000:]
            ids = [f[b"rollout_id"].decode() for _, f in r.xrange(stream)]
            assert set(acked) <= set(ids), f"{point}: {sorted(set(acked) - set(ids))} lost"
    finally:
        r.close()
        own.stop()
