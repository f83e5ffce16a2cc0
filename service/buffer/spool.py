"""A bounded, append-only local spool: records survive a Redis outage (and a server restart) on disk.

Each record is framed ``<magic><u32 length><u32 crc32 of the body><u32 crc32 of the first 12 bytes><body>``
in segment files ``seg-<seq>.spool2``. A record whose header or body does not check out is skipped and
reading resynchronises at the next valid magic, so a torn write or a flipped byte loses that record only
(counted in `corrupt`). Segments of the older format (``seg-<seq>.spool``, no magic) are still read.
The read position of every segment is kept in ``HEAD``, replaced atomically on every commit. Readers
`peek` records in order and `commit` them once delivered elsewhere; a crash in between replays them
(at-least-once; consumers dedupe on rollout id). A fully read segment is deleted.

`append` writes to the OS; `sync` makes everything appended so far durable. A write that fails (a full
disk, an I/O error) is cut back, so no torn record stays behind, and is counted in `lost` by reason.
`prepend` writes a new first segment and commits it through ``HEAD``: it is durable when it returns, and a
crash at any step loses nothing that was already in the spool. `fault` is a test hook: with
``SPECROLL_SPOOL_FAULT=<point>[:<n>]`` the process exits (as if killed) the n-th time it reaches `point`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

FAULT_ENV = "SPECROLL_SPOOL_FAULT"
MAGIC = b"\xd5SR\xf2"  # as a little-endian length it exceeds 4 GB: never the start of an old-format record
_HEADER = struct.Struct("<4sIII")  # magic, body length, crc32(body), crc32(magic + length + body crc)
_LEGACY = struct.Struct("<II")  # length, crc32(body)
_FIRST_SEQ = 1_000_000_000  # room below for prepend()
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
LOSS_REASONS = ("disk_full", "spool_error")


def frame(data: bytes) -> bytes:
    """One record as it is stored."""
    head = MAGIC + struct.pack("<II", len(data), zlib.crc32(data))
    return head + struct.pack("<I", zlib.crc32(head)) + data


def _frame_end(data: bytes, pos: int) -> int:
    """End of the valid record at `pos`, or -1."""
    if pos + _HEADER.size > len(data) or data[pos : pos + 4] != MAGIC:
        return -1
    _, length, body_crc, head_crc = _HEADER.unpack_from(data, pos)
    end = pos + _HEADER.size + length
    if zlib.crc32(data[pos : pos + 12]) != head_crc or end > len(data):
        return -1
    return end if zlib.crc32(data[pos + _HEADER.size : end]) == body_crc else -1


def records(data: bytes, legacy: bool = False) -> Iterator[tuple[int, int, int, bool]]:
    """(start, body start, end, valid) of each record and each damaged stretch of `data`, in order."""
    pos = 0
    while pos < len(data):
        if legacy:
            end = -1
            if pos + _LEGACY.size <= len(data):
                length, crc = _LEGACY.unpack_from(data, pos)
                end = pos + _LEGACY.size + length
                if end > len(data) or zlib.crc32(data[pos + _LEGACY.size : end]) != crc:
                    end = -1
            if end < 0:  # the old format cannot resynchronise: the rest is lost
                yield pos, pos, len(data), False
                return
            yield pos, pos + _LEGACY.size, end, True
            pos = end
            continue
        end = _frame_end(data, pos)
        if end >= 0:
            yield pos, pos + _HEADER.size, end, True
            pos = end
            continue
        nxt = data.find(MAGIC, pos + 1)
        while nxt >= 0 and _frame_end(data, nxt) < 0:
            nxt = data.find(MAGIC, nxt + 1)
        nxt = len(data) if nxt < 0 else nxt
        yield pos, pos, nxt, False
        pos = nxt


def loss_reason(exc: BaseException) -> str:
    return "disk_full" if isinstance(exc, OSError) and exc.errno in _DISK_FULL else "spool_error"


@dataclass(slots=True)
class _Segment:
    seq: int
    legacy: bool = False
    start: int = 0  # byte offset of the first unread record
    size: int = 0  # bytes holding records (anything after is cut or ignored)
    count: int = 0  # unread records


class Spool:
    def __init__(self, path: str | Path, max_bytes: int, segment_bytes: int = 8 << 20,
                 on_full: str = "drop_oldest", fault: str | None = None) -> None:
        if on_full not in ("drop_oldest", "drop_newest"):
            raise ValueError(f"on_full must be drop_oldest or drop_newest, got {on_full!r}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.segment_bytes, self.on_full = max_bytes, segment_bytes, on_full
        self.spooled = self.replayed = self.dropped = self.corrupt = 0
        self.lost = dict.fromkeys(LOSS_REASONS, 0)  # records a failed write or read lost, by reason
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []
        self._peeked: list[tuple[int, int]] = []  # (seq, end offset) of each record the last peek returned
        self._tail: BinaryIO | None = None  # append handle on the last segment
        self._next_seq = _FIRST_SEQ  # segment numbers are never reused
        self._unsynced = False  # appended bytes not yet fsync'd
        self._dir_unsynced = False  # a segment file was created since the last folder fsync
        self._full_need = 0  # bytes a write lacked room for (0: the last write had room)
        self._failing: str | None = None  # reason of the failing streak of writes, for logging once
        self._totals = (0, 0)  # (unread records, their bytes) as of the last change: read without the lock
        spec = os.environ.get(FAULT_ENV, "") if fault is None else fault
        name, _, times = spec.rpartition(":")
        self._fault_point, self._fault_left = (name, int(times)) if times.isdigit() else (spec, 1)
        with self._changing():
            self._open()

    # -- state --------------------------------------------------------------------------------------
    def _file(self, seg: _Segment | int, legacy: bool = False) -> Path:
        if isinstance(seg, _Segment):
            seg, legacy = seg.seq, seg.legacy
        return self.path / f"seg-{seg:012d}.{'spool' if legacy else 'spool2'}"

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """The lock, and the totals refreshed before it is released: `len` and `nbytes` never wait on it (the
        metrics endpoint asks them while a writer may be in a slow fsync)."""
        with self._lock:
            try:
                yield
            finally:
                self._recount()

    def _recount(self) -> None:
        self._totals = (sum(s.count for s in self._segments), sum(s.size - s.start for s in self._segments))

    def __len__(self) -> int:
        return self._totals[0]

    @property
    def nbytes(self) -> int:
        return self._totals[1]

    @property
    def disk_full(self) -> bool:
        """True while the last write found no room and the file system still lacks it. Takes no lock (an
        event loop asks it; a slow fsync must not hold it up)."""
        need = self._full_need
        if need:
            with contextlib.suppress(OSError):
                st = os.statvfs(self.path)
                if st.f_bavail * st.f_frsize >= need + 8192:
                    if self._failing == "disk_full":
                        logger.info("spool %s: the file system has room again", self.path)
                        self._failing = None
                    self._full_need = 0
                    return False
        return bool(need)

    @property
    def failing(self) -> str | None:
        """The reason the last spool write failed, None when it succeeded."""
        return self._failing

    def fault(self, point: str) -> None:
        """Test hook: exit at once (no cleanup, like kill -9) the configured time `point` is reached."""
        if point == self._fault_point:
            self._fault_left -= 1
            if self._fault_left <= 0:
                logger.warning("spool fault injection: exiting at %s", point)
                os._exit(137)

    def _open(self) -> None:
        found: dict[int, bool] = {}
        for p in [*self.path.glob("seg-*.spool"), *self.path.glob("seg-*.spool2")]:
            found[int(p.stem.split("-")[1])] = p.suffix == ".spool"
        for p in self.path.glob("*.tmp"):
            p.unlink(missing_ok=True)
        head_seq, head_off, starts = None, 0, {}
        head_file = self.path / "HEAD"
        if head_file.is_file():
            try:
                state = json.loads(head_file.read_text())
                head_seq, head_off = int(state["seq"]), int(state["offset"])
                starts = {int(k): int(v) for k, v in state.get("starts", {}).items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                logger.warning("spool HEAD at %s is unreadable; replaying every segment", head_file)
        for seq in sorted(found):
            seg = _Segment(seq, legacy=found[seq])
            if head_seq is not None and seq < head_seq:  # fully read before
                self._file(seg).unlink()
                continue
            try:
                self._scan(seg, head_off if seq == head_seq else starts.get(seq, 0))
            except OSError as exc:  # its records cannot be counted: one damaged stretch
                self.corrupt += 1
                logger.error("cannot read spool segment %s (%s): set aside as *.bad", self._file(seg), exc)
                with contextlib.suppress(OSError):
                    os.replace(self._file(seg), self._file(seg).with_suffix(".bad"))
                continue
            if seg.count == 0:
                self._file(seg).unlink()
                continue
            self._segments.append(seg)
        self._next_seq = max([*found, _FIRST_SEQ - 1]) + 1
        pending = sum(s.count for s in self._segments)
        if pending:
            logger.info("spool %s holds %d records from before; they will be replayed first", self.path, pending)

    def _scan(self, seg: _Segment, start: int) -> None:
        """Count a segment's unread good records from `start`; count damaged stretches; cut a torn tail."""
        path = self._file(seg)
        data = path.read_bytes()
        seg.start, seg.size, seg.count = -1, 0, 0
        for rec_start, _, end, ok in records(data, seg.legacy):
            if ok:
                seg.size = end
                if rec_start >= start:
                    seg.count += 1
                    if seg.start < 0:
                        seg.start = rec_start
            elif end > start:
                self.corrupt += 1
                logger.warning("spool segment %s: bytes %d-%d are torn or corrupt; the records there are lost",
                               path, rec_start, end)
        seg.start = seg.size if seg.start < 0 else seg.start
        if seg.size < len(data):
            try:
                with open(path, "r+b") as fh:
                    fh.truncate(seg.size)
            except OSError:
                logger.exception("cannot cut the torn tail of %s", path)

    def _save_head(self, durable: bool = False) -> None:
        first = self._segments[0] if self._segments else None
        state = {"seq": first.seq if first else 0, "offset": first.start if first else 0,
                 "starts": {str(s.seq): s.start for s in self._segments[1:] if s.start}}
        tmp = self.path / "HEAD.tmp"
        with open(tmp, "w") as fh:
            fh.write(json.dumps(state))
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, self.path / "HEAD")
        if durable:
            self._fsync_dir()

    def _try_save_head(self) -> None:
        try:
            self._save_head()
        except OSError as exc:  # the next save catches up; a crash before it only replays records again
            self._note_failure(exc, 0)
            logger.warning("cannot save the spool's read position in %s: %s", self.path, exc)

    # -- writing ------------------------------------------------------------------------------------
    def append(self, data: bytes) -> bool:
        """Add one record at the end; False when the full-spool policy dropped it or the write failed (the
        disk is full or failing: counted in `lost`, and nothing of the record stays in the file)."""
        framed = frame(data)
        with self._changing():
            if not self._make_room(len(framed)):
                self.dropped += 1
                return False
            try:
                tail = self._segments[-1] if self._segments else None
                if (tail is None or self._tail is None or
                        (tail.size and tail.size + len(framed) > self.segment_bytes)):
                    tail = self._new_tail()
                self._write_tail(tail, framed)
            except OSError as exc:
                self._note_failure(exc, len(framed))
                self.lost[loss_reason(exc)] += 1
                return False
            self._note_success()
            self.spooled += 1
            return True

    def _write_tail(self, tail: _Segment, framed: bytes) -> None:
        assert self._tail is not None
        done = 0
        try:
            while done < len(framed):
                n = self._tail.write(framed[done:])
                if not n:
                    raise OSError(errno.ENOSPC, "short write")
                done += n
        except OSError:
            if done:
                self._cut_tail(tail)
            raise
        self._unsynced = True
        tail.size += len(framed)
        tail.count += 1

    def _cut_tail(self, tail: _Segment) -> None:
        """A write stopped half-way: truncate the file back to its last whole record."""
        assert self._tail is not None
        try:
            os.ftruncate(self._tail.fileno(), tail.size)
        except OSError:  # the torn bytes stay after `size`; readers never go past it, so start a new file
            logger.exception("cannot cut a torn record from %s; continuing in a new segment", self._file(tail))
            self._tail.close()
            self._tail = None

    def _note_failure(self, exc: OSError, need: int) -> None:
        reason = loss_reason(exc)
        if reason == "disk_full":
            self._full_need = max(self._full_need, need, 1)
        if self._failing != reason:
            logger.error("cannot write to the spool %s (%s): records that cannot be kept are counted as lost",
                         self.path, exc)
        self._failing = reason

    def _note_success(self) -> None:
        if self._failing is not None:
            logger.info("spool %s writes again", self.path)
        self._failing, self._full_need = None, 0

    def prepend(self, items: list[bytes]) -> None:
        """Put records before everything spooled (records older than the spool). Durable when it returns;
        raises OSError (and changes nothing) when they cannot be written."""
        if not items:
            return
        blob = b"".join(frame(r) for r in items)
        with self._changing():
            self._peeked = []
            seg = _Segment((self._segments[0].seq if self._segments else _FIRST_SEQ) - 1,
                           size=len(blob), count=len(items))
            path = self._file(seg)
            try:
                # Until HEAD names it, a crash leaves this file below HEAD's segment: deleted as read.
                with open(path, "wb") as fh:
                    fh.write(blob[: len(blob) // 2])
                    fh.flush()
                    self.fault("prepend:half_written")
                    fh.write(blob[len(blob) // 2 :])
                    fh.flush()
                    os.fsync(fh.fileno())
                self._fsync_dir()
                self.fault("prepend:written")
                self._segments.insert(0, seg)
                try:
                    self._save_head(durable=True)  # the commit point
                except OSError:
                    self._segments.pop(0)
                    raise
            except OSError as exc:
                path.unlink(missing_ok=True)
                self._note_failure(exc, len(blob))
                raise
            self._note_success()
            self.fault("prepend:committed")
            self.spooled += len(items)

    def sync(self) -> None:
        """Make every record appended so far durable."""
        with self._changing():
            if self._unsynced and self._tail is not None:
                self._unsynced = False
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
            try:
                if self._unsynced:
                    os.fsync(self._tail.fileno())  # the next sync() only reaches the new tail
            finally:
                self._unsynced = False
                self._tail.close()
                self._tail = None
        seg = _Segment(self._next_seq)
        self._tail = open(self._file(seg), "ab", buffering=0)  # noqa: SIM115 - kept open for appends
        self._next_seq += 1
        self._segments.append(seg)
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
            seg = self._segments[0]
            self.dropped += seg.count
            logger.warning("spool %s is full: dropping its oldest segment (%d records)", self.path, seg.count)
            self._remove_first()
            self._try_save_head()
        return True

    def _remove_first(self) -> None:
        self._close_tail_if(self._segments[0].seq)
        seg = self._segments.pop(0)
        self._file(seg).unlink(missing_ok=True)
        self.fault("remove:unlinked")

    def _quarantine(self, seg: _Segment, exc: OSError) -> None:
        """A segment that cannot be read: set it aside as ``*.bad``, count its records as lost."""
        logger.error("cannot read spool segment %s (%s): %d records set aside", self._file(seg), exc, seg.count)
        self.lost["spool_error"] += seg.count
        self._close_tail_if(seg.seq)
        self._segments.remove(seg)
        with contextlib.suppress(OSError):
            os.replace(self._file(seg), self._file(seg).with_suffix(".bad"))
        self._try_save_head()

    # -- reading ------------------------------------------------------------------------------------
    def peek(self, n: int) -> list[bytes]:
        """Up to n unread records in order, without consuming them."""
        out: list[bytes] = []
        self._peeked = []
        with self._changing():
            for seg in list(self._segments):
                if len(out) >= n:
                    break
                if seg.start >= seg.size:
                    continue
                try:
                    with open(self._file(seg), "rb") as fh:
                        fh.seek(seg.start)
                        data = fh.read(seg.size - seg.start)
                except OSError as exc:
                    self._quarantine(seg, exc)
                    continue
                found = 0
                for _, body, end, ok in records(data, seg.legacy):
                    if len(out) >= n:
                        break
                    if ok:
                        found += 1
                        out.append(data[body:end])
                        self._peeked.append((seg.seq, seg.start + end))
                if not found:  # damaged since it was opened: nothing left to read there
                    self.corrupt += 1
                    logger.warning("spool segment %s is damaged after byte %d: %d records lost", self._file(seg),
                                   seg.start, seg.count)
                    seg.start, seg.count = seg.size, 0
                    if seg is self._segments[0]:
                        self._remove_first()
                        self._try_save_head()
        return out

    def commit(self, n: int) -> None:
        """The first n records of the last peek were delivered: consume them."""
        with self._changing():
            done = self._peeked[:n]
            self._peeked = []
            for seq, end in done:
                if not self._segments or seq != self._segments[0].seq:
                    continue  # that segment was dropped meanwhile
                first = self._segments[0]
                first.start, first.count = end, first.count - 1
                self.replayed += 1
                if first.count <= 0 or end >= first.size:  # fully read: delete it
                    self._remove_first()
            if done:
                self._try_save_head()
                self.fault("commit:saved")

    def close(self) -> None:
        try:
            self.sync()
        finally:
            with self._changing():
                if self._tail is not None:
                    self._tail.close()
                    self._tail = None
