"""The local spool: order, persistence across reopen, torn records, both full-spool policies, prepend."""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from pathlib import Path

import pytest
from fs_utils import fill

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


def test_sizes_answer_while_a_writer_is_stuck_in_fsync(tmp_path, monkeypatch):
    """The metrics endpoint reads the spool's size: a slow disk's fsync must not hold it up."""
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=400)
    for r in records(5):
        spool.append(r)
    expected = [len(spool), spool.nbytes]
    in_fsync, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        in_fsync.set()
        release.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    writer = threading.Thread(target=spool.sync)
    writer.start()
    try:
        assert in_fsync.wait(10)
        sizes: list[int] = []
        reader = threading.Thread(target=lambda: sizes.extend([len(spool), spool.nbytes]))
        reader.start()
        reader.join(5)
        assert sizes == expected and expected[0] == 5  # answered while the fsync is stuck
    finally:
        release.set()
        writer.join(30)
    assert not writer.is_alive()


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


def _segment(folder) -> Path:
    (seg,) = list(folder.glob("seg-*"))
    return seg


@pytest.mark.parametrize("where", ["body", "length", "magic", "header_crc"])
def test_a_flipped_byte_loses_only_its_record(tmp_path, where):
    """240 records in one segment, one byte flipped at 10% of it (in a body or in a record's header): the
    other 239 come out, in order, and one damaged record is counted (it used to cut the rest of the segment)."""
    data = records(240)
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for r in data:
        spool.append(r)
    spool.close()
    seg = _segment(tmp_path)
    raw = bytearray(seg.read_bytes())
    framed = len(raw) // 240
    start = 24 * framed  # record 24 (10% in)
    raw[start + {"body": 30, "length": 5, "magic": 1, "header_crc": 13}[where]] ^= 0x10
    seg.write_bytes(bytes(raw))
    reopened = Spool(tmp_path, max_bytes=1 << 20)
    assert len(reopened) == 239 and reopened.corrupt == 1
    assert drain(reopened) == data[:24] + data[25:]


def test_a_zeroed_page_loses_only_the_records_it_touches(tmp_path):
    """A 4 KiB stretch of zeros (a lost page) in the middle of a segment: the records it overlaps are lost,
    every other one is read."""
    data = records(400, size=64)
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for r in data:
        spool.append(r)
    spool.close()
    seg = _segment(tmp_path)
    raw = bytearray(seg.read_bytes())
    framed = len(raw) // 400
    raw[8192 : 8192 + 4096] = bytes(4096)
    seg.write_bytes(bytes(raw))
    out = drain(Spool(tmp_path, max_bytes=1 << 20))
    touched = {i for i in range(400) if i * framed < 8192 + 4096 and (i + 1) * framed > 8192}
    assert out == [r for i, r in enumerate(data) if i not in touched]


def test_a_segment_cut_short_keeps_every_whole_record_and_takes_appends(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for r in records(50):
        spool.append(r)
    spool.close()
    seg = _segment(tmp_path)
    framed = seg.stat().st_size // 50
    seg.write_bytes(seg.read_bytes()[: 30 * framed + framed // 2])  # half of record 30 is gone
    reopened = Spool(tmp_path, max_bytes=1 << 20)
    assert reopened.corrupt == 1 and len(reopened) == 30
    assert reopened.append(b"after")
    assert drain(reopened) == [*records(30), b"after"]


def test_old_format_segments_are_still_read(tmp_path):
    """A spool written before the record magic (``<u32 length><u32 crc32>`` frames in ``seg-*.spool``)."""
    old = records(5)
    blob = b"".join(struct.pack("<II", len(r), zlib.crc32(r)) + r for r in old)
    (tmp_path / "seg-001000000000.spool").write_bytes(blob)
    framed = len(blob) // 5
    (tmp_path / "HEAD").write_text(json.dumps({"seq": 1_000_000_000, "offset": framed}))  # one already read
    spool = Spool(tmp_path, max_bytes=1 << 20)
    assert len(spool) == 4
    spool.append(b"new")
    spool.prepend([b"older"])
    assert drain(spool) == [b"older", *old[1:], b"new"]
    assert not list(tmp_path.glob("seg-*"))


def test_a_write_on_a_full_disk_leaves_no_torn_record_and_the_spool_recovers(tiny_fs):
    """The file system fills up in the middle of a record: the record is cut back (never half in the
    file), counted as lost for lack of space, and the spool writes again as soon as space is back."""
    filler = fill(tiny_fs, leave=40 << 10)
    spool = Spool(tiny_fs / "spool", max_bytes=1 << 20, segment_bytes=1 << 20)
    data = records(2000, size=96)
    kept = [r for r in data if spool.append(r)]
    assert 0 < len(kept) < 2000 and spool.lost["disk_full"] == 2000 - len(kept)
    assert spool.disk_full and spool.failing == "disk_full"
    seg = _segment(tiny_fs / "spool")
    assert seg.stat().st_size == spool.nbytes  # nothing torn after the last whole record
    filler.unlink()
    assert not spool.disk_full  # the file system has room again
    assert spool.append(b"after") and spool.failing is None
    spool.close()
    reopened = Spool(tiny_fs / "spool", max_bytes=1 << 20)
    assert reopened.corrupt == 0
    assert drain(reopened) == [*kept, b"after"]


def test_prepend_on_a_full_disk_changes_nothing(tiny_fs):
    filler = fill(tiny_fs, leave=24 << 10)
    spool = Spool(tiny_fs / "spool", max_bytes=1 << 20, segment_bytes=4096)
    for r in records(8):
        assert spool.append(r)
    spool.commit(len(spool.peek(3)))
    with pytest.raises(OSError):
        spool.prepend(records(400, start=1000, size=96))  # far more than the room left
    assert spool.disk_full and len(spool) == 5
    filler.unlink()
    spool.prepend(records(2, start=1000))
    spool.close()
    assert drain(Spool(tiny_fs / "spool", max_bytes=1 << 20, segment_bytes=4096)) == \
        records(2, start=1000) + records(5, start=3)
