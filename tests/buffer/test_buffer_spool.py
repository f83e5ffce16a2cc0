"""The local spool: order, persistence across reopen, torn records, both full-spool policies, prepend."""

from __future__ import annotations

import pytest

from service.buffer.config import BufferConfig
from service.buffer.spool import Spool


def records(n: int, start: int = 0, size: int = 40) -> list[bytes]:
    return [f"{i:08d}".encode() * (size // 8) for i in range(start, start + n)]


def drain(spool: Spool, batch: int = 7) -> list[bytes]:
    out = []
    while got := spool.peek(batch):
        out += got
        spool.commit(len(got))
    return out


def test_fifo_across_segments_and_reopen(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=400)
    data = records(50)
    for r in data:
        assert spool.append(r)
    assert len(spool) == 50 and len(list(tmp_path.glob("seg-*"))) > 3
    first = spool.peek(12)
    spool.commit(10)  # two of the twelve were not delivered: they come again
    spool.close()
    reopened = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=400)
    assert len(reopened) == 40
    assert first[:10] == data[:10]
    assert drain(reopened) == data[10:]
    assert len(reopened) == 0 and not list(tmp_path.glob("seg-*"))
    assert reopened.append(b"x") and reopened.peek(5) == [b"x"]


def test_torn_tail_is_cut_and_counted(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for r in records(5):
        spool.append(r)
    spool.close()
    seg = next(tmp_path.glob("seg-*"))
    seg.write_bytes(seg.read_bytes()[:-7])  # a crash in the middle of the last write
    reopened = Spool(tmp_path, max_bytes=1 << 20)
    assert reopened.corrupt == 1
    assert drain(reopened) == records(4)


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
def test_full_spool_policies_count_what_they_drop(tmp_path, policy):
    spool = Spool(tmp_path, max_bytes=1000, segment_bytes=200, on_full=policy)
    data = records(60)  # 48 bytes each framed: far more than 1000 bytes
    kept = [r for r in data if spool.append(r)]
    out = drain(spool)
    assert spool.dropped + len(out) == 60 and spool.dropped > 0
    assert spool.nbytes == 0
    if policy == "drop_newest":
        assert out == data[: len(out)] and kept == out  # the oldest survive
    else:
        assert out == data[-len(out) :]  # the newest survive, in order


def test_drop_oldest_while_a_peek_is_in_flight(tmp_path):
    spool = Spool(tmp_path, max_bytes=500, segment_bytes=100, on_full="drop_oldest")
    for r in records(8):
        spool.append(r)
    in_flight = spool.peek(3)
    for r in records(8, start=100):  # evicts the segments the peek came from
        spool.append(r)
    spool.commit(len(in_flight))  # must not advance the head of the surviving segments
    rest = drain(spool)
    everything = records(8) + records(8, start=100)
    assert rest == everything[-len(rest) :] and len(rest) + spool.dropped == 16


def test_prepend_goes_before_everything(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=100)
    for r in records(6, start=10):
        spool.append(r)
    spool.commit(len(spool.peek(2)))
    spool.prepend(records(3))
    spool.close()
    reopened = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=100)
    assert drain(reopened) == records(3) + records(4, start=12)


@pytest.mark.parametrize("env, expected", [("~/rollouts-cache", "home/rollouts-cache/spool/specroll_rollouts"),
                                           ("", "home/.cache/specroll/spool/specroll_rollouts"),
                                           (None, "home/.cache/specroll/spool/specroll_rollouts")])
def test_default_spool_folder_is_under_the_cache_root(tmp_path, monkeypatch, env, expected):
    """The spool's default folder follows $SPECROLL_CACHE as every other cache does: `~` expanded, empty = unset
    (it used to be the working directory)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if env is None:
        monkeypatch.delenv("SPECROLL_CACHE", raising=False)
    else:
        monkeypatch.setenv("SPECROLL_CACHE", env)
    assert BufferConfig(stream="specroll:rollouts").spool_path() == tmp_path / expected
