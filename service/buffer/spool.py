"""A bounded, append-only local spool: records survive a Redis outage (and a server restart) on disk.

Records are framed ``<u32 length><u32 crc32><bytes>`` in segment files ``seg-<seq>.spool``; the read
position (segment, offset) is kept in ``HEAD``, replaced atomically on every commit. Readers `peek` records
in order and `commit` them once delivered elsewhere, so a crash between the two replays them again
(at-least-once; consumers dedupe on rollout id). A fully read segment is deleted.

`append` writes to the OS; `sync` makes everything appended so far durable (fsync of the file written to
and, after a new segment, of the folder), so a caller can group many appends under one fsync. `prepend`
is durable when it returns.

When a record does not fit in `max_bytes`, the policy decides: ``drop_oldest`` deletes the oldest segment
(its unread records are dropped) until the record fits; ``drop_newest`` drops the incoming record. Both
count what they drop in `dropped`. A torn or corrupt record found when reopening ends its segment there and
is counted in `corrupt`.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
_FIRST_SEQ = 1_000_000_000  # room below for prepend()


@dataclass(slots=True)
class _Segment:
    seq: int
    size: int = 0
    count: int = 0


class Spool:
    def __init__(self, path: str | Path, max_bytes: int, segment_bytes: int = 8 << 20,
                 on_full: str = "drop_oldest") -> None:
        if on_full not in ("drop_oldest", "drop_newest"):
            raise ValueError(f"on_full must be drop_oldest or drop_newest, got {on_full!r}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.segment_bytes, self.on_full = max_bytes, segment_bytes, on_full
        self.spooled = self.replayed = self.dropped = self.corrupt = 0
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []
        self._head_offset = 0  # byte offset of the next unread record in the first segment
        self._head_read = 0  # records of the first segment already read
        self._peeked: list[tuple[int, int]] = []  # (seq, end offset) of each record the last peek returned
        self._tail: BinaryIO | None = None  # append handle on the last segment
        self._next_seq = _FIRST_SEQ  # segment numbers are never reused
        self._unsynced = False  # appended bytes not yet fsync'd
        self._dir_unsynced = False  # a segment file was created since the last folder fsync
        self._open()

    # -- state --------------------------------------------------------------------------------------
    def _file(self, seq: int) -> Path:
        return self.path / f"seg-{seq:012d}.spool"

    def __len__(self) -> int:
        with self._lock:
            return self._pending()

    def _pending(self) -> int:
        return sum(s.count for s in self._segments) - self._head_read

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._segments) - self._head_offset

    def _open(self) -> None:
        seqs = sorted(int(p.stem.split("-")[1]) for p in self.path.glob("seg-*.spool"))
        head_seq, head_off = None, 0
        head_file = self.path / "HEAD"
        if head_file.is_file():
            try:
                state = json.loads(head_file.read_text())
                head_seq, head_off = int(state["seq"]), int(state["offset"])
            except (ValueError, KeyError):
                logger.warning("spool HEAD at %s is unreadable; replaying every segment", head_file)
        for seq in seqs:
            if head_seq is not None and seq < head_seq:
                self._file(seq).unlink()
                continue
            seg = _Segment(seq)
            offsets = self._scan(seg)
            if seq == head_seq and self._segments == []:
                read = [o for o in offsets if o <= head_off]
                self._head_read = len(read) - 1
                self._head_offset = read[-1]
            self._segments.append(seg)
        self._next_seq = max([*seqs, _FIRST_SEQ - 1]) + 1
        pending = self._pending()
        if pending:
            logger.info("spool %s holds %d records from before; they will be replayed first", self.path, pending)

    def _scan(self, seg: _Segment) -> list[int]:
        """Count a segment's good records; cut a torn or corrupt tail. Returns record start offsets + end."""
        path = self._file(seg.seq)
        data = path.read_bytes()
        offsets, pos = [0], 0
        while pos + _HEADER.size <= len(data):
            length, crc = _HEADER.unpack_from(data, pos)
            end = pos + _HEADER.size + length
            if end > len(data) or zlib.crc32(data[pos + _HEADER.size : end]) != crc:
                break
            pos = end
            offsets.append(pos)
        if pos != len(data):
            self.corrupt += 1
            logger.warning("spool segment %s: torn or corrupt record at byte %d; the rest is cut", path, pos)
            with open(path, "r+b") as fh:
                fh.truncate(pos)
        seg.size, seg.count = pos, len(offsets) - 1
        return offsets

    def _save_head(self) -> None:
        tmp = self.path / "HEAD.tmp"
        seq = self._segments[0].seq if self._segments else 0
        tmp.write_text(json.dumps({"seq": seq, "offset": self._head_offset}))
        os.replace(tmp, self.path / "HEAD")

    # -- writing ------------------------------------------------------------------------------------
    def append(self, data: bytes) -> bool:
        """Add one record at the end; False when the full-spool policy dropped it."""
        size = _HEADER.size + len(data)
        with self._lock:
            if not self._make_room(size):
                self.dropped += 1
                return False
            tail = self._segments[-1] if self._segments else None
            if tail is None or self._tail is None or (tail.size and tail.size + size > self.segment_bytes):
                tail = self._new_tail()
            assert self._tail is not None
            self._tail.write(_HEADER.pack(len(data), zlib.crc32(data)) + data)
            self._unsynced = True
            tail.size += size
            tail.count += 1
            self.spooled += 1
            return True

    def prepend(self, records: list[bytes]) -> None:
        """Put records before everything spooled (used at shutdown for records older than the spool)."""
        if not records:
            return
        with self._lock:
            seq = (self._segments[0].seq if self._segments else _FIRST_SEQ) - 1
            blob = b"".join(_HEADER.pack(len(r), zlib.crc32(r)) + r for r in records)
            if self._segments and self._head_offset:  # rewrite the half-read head segment without its read part
                first = self._segments[0]
                rest = self._file(first.seq).read_bytes()[self._head_offset :]
                blob += rest
                self._close_tail_if(first.seq)
                self._file(first.seq).unlink()
                self._segments.pop(0)
                self._head_read = self._head_offset = 0
            tmp = self._file(seq).with_suffix(".tmp")
            with open(tmp, "wb") as fh:
                fh.write(blob)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self._file(seq))
            self._fsync_dir()
            seg = _Segment(seq)
            self._scan(seg)
            self._segments.insert(0, seg)
            self.spooled += len(records)
            self._save_head()

    def sync(self) -> None:
        """Make every record appended so far durable."""
        with self._lock:
            if self._unsynced and self._tail is not None:
                os.fsync(self._tail.fileno())
            self._unsynced = False
            if self._dir_unsynced:
                self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._dir_unsynced = False

    def _new_tail(self) -> _Segment:
        if self._tail is not None:
            if self._unsynced:
                os.fsync(self._tail.fileno())  # the next sync() only reaches the new tail
            self._tail.close()
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        seg = _Segment(seq)
        self._segments.append(seg)
        self._tail = open(self._file(seq), "ab", buffering=0)  # noqa: SIM115 - kept open for appends
        self._dir_unsynced = True
        return seg

    def _close_tail_if(self, seq: int) -> None:
        if self._tail is not None and self._segments and self._segments[-1].seq == seq:
            self._unsynced = False  # the segment is going away
            self._tail.close()
            self._tail = None

    def _make_room(self, size: int) -> bool:
        if size > self.max_bytes:
            return False
        while sum(s.size for s in self._segments) + size > self.max_bytes:
            if self.on_full == "drop_newest" or not self._segments:
                return False
            self._drop_first()
        return True

    def _drop_first(self) -> None:
        seg = self._segments[0]
        lost = seg.count - self._head_read
        self.dropped += lost
        logger.warning("spool %s is full: dropping its oldest segment (%d records)", self.path, lost)
        self._remove_first()

    def _remove_first(self) -> None:
        self._close_tail_if(self._segments[0].seq)
        seg = self._segments.pop(0)
        self._file(seg.seq).unlink(missing_ok=True)
        self._head_offset = self._head_read = 0
        self._save_head()

    # -- reading ------------------------------------------------------------------------------------
    def peek(self, n: int) -> list[bytes]:
        """Up to n unread records in order, without consuming them."""
        out: list[bytes] = []
        self._peeked = []
        with self._lock:
            offset = self._head_offset
            for i, seg in enumerate(self._segments):
                if len(out) >= n:
                    break
                start = offset if i == 0 else 0
                if start >= seg.size:
                    continue
                with open(self._file(seg.seq), "rb") as fh:
                    fh.seek(start)
                    data = fh.read(seg.size - start)
                pos = 0
                while pos < len(data) and len(out) < n:
                    length, _ = _HEADER.unpack_from(data, pos)
                    out.append(data[pos + _HEADER.size : pos + _HEADER.size + length])
                    pos += _HEADER.size + length
                    self._peeked.append((seg.seq, start + pos))
        return out

    def commit(self, n: int) -> None:
        """The first n records of the last peek were delivered: consume them."""
        with self._lock:
            done = self._peeked[:n]
            self._peeked = []
            for seq, end in done:
                if not self._segments or seq != self._segments[0].seq:
                    continue  # that segment was dropped meanwhile
                self._head_offset, self._head_read = end, self._head_read + 1
                self.replayed += 1
                if end >= self._segments[0].size:  # fully read: delete it
                    self._remove_first()
            if done:
                self._save_head()

    def close(self) -> None:
        self.sync()
        with self._lock:
            if self._tail is not None:
                self._tail.close()
                self._tail = None
