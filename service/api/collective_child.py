"""Receiving a gloo group's broadcasts in a child process: a broadcast of another size than announced ends it, not
the server (gloo's TCP transport aborts the whole process on more bytes than the receiving tensor holds).

The child joins the trainer's group (the rendezvous of `join_group`) and receives each piece (one tensor, or one
packed chunk) straight into shared memory the server maps: two memfd slots per group, reused once the staging
thread has copied their tensors into the spare, so there is no allocation per bucket and at most two batches in
flight. The parent sends JSON commands over a unix seqpacket socket (memfds ride along as SCM_RIGHTS); the child
reports each piece as it lands, so staging runs while the rest of the bucket arrives. A broadcast shorter than
announced leaves the NaN the child wrote at its end and is refused (gloo lets it pass). The child's death (EOF on
the socket), an error it reports, or its silence past the group's timeout is a failed broadcast; it exits when
the socket closes or its parent dies.

    python -m service.api.collective_child FD
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.cpu_threads import raise_nice

logger = logging.getLogger(__name__)

SLOT_BYTES = 64 << 20  # a batch of pieces fills a slot up to this; a larger piece gets a slot of its own size
SLOTS = 2  # one being received while the staging thread copies the other
MAX_PIECES = 256  # pieces per command: a seqpacket message stays small
ALIGN = 64
GROW = 2 << 20  # slot sizes round up to this
STARTUP_S = 60.0  # the child's interpreter and torch import, on top of the group's timeout
COMMAND_BYTES = 256 << 10  # a command: at most MAX_PIECES pieces
REPLY_BYTES = 16 << 10
GRACE_S = 5.0  # past the group's timeout: the child's own gloo timeout should speak first
CANARY_BYTES = 16
MODULE = "service.api.collective_child"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ReceiveFailed(RuntimeError):
    """The child could not join or receive: it reported an error, died, or fell silent."""


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
               timeout_s: float) -> Any:
    """Join the trainer's group the way torch's own init_process_group builds one (a TCP store, prefixed by the
    group's name), without touching this process's default group."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@dataclass(frozen=True, slots=True)
class Part:
    """A tensor inside a piece, at `offset` bytes from the piece's start."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Piece:
    """One broadcast: a tensor in its own dtype, or (packed) a uint8 chunk of several tensors of `dtype`."""

    nbytes: int
    dtype: str
    packed: bool
    parts: tuple[Part, ...]


@dataclass(slots=True)
class _Batch:
    pieces: list[Piece]
    offsets: list[int]
    nbytes: int
    slot: int = -1


@dataclass(slots=True)
class _Slot:
    size: int = 0
    base: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))


@dataclass(frozen=True, slots=True)
class SlotFree:
    """Put in the staging feed after a slot's last tensor: taken, the slot's tensors are consumed."""

    receiver: ChildReceiver
    slot: int

    def release(self) -> None:
        self.receiver.release(self.slot)


def batches(pieces: list[Piece]) -> list[_Batch]:
    out: list[_Batch] = []
    for p in pieces:
        last = out[-1] if out else None
        if last is None or len(last.pieces) >= MAX_PIECES or (last.pieces and last.nbytes + p.nbytes > SLOT_BYTES):
            last = _Batch([], [], 0)
            out.append(last)
        last.offsets.append(last.nbytes)
        last.pieces.append(p)
        last.nbytes += -(-p.nbytes // ALIGN) * ALIGN
    return out


class ChildReceiver:
    """The server's handle on one group's receiving child (`start` spawns it and joins); thread-safe."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, errlog: Any, timeout_s: float) -> None:
        self.proc, self._sock, self._errlog, self.timeout_s = proc, sock, errlog, timeout_s
        self._lock = threading.Lock()
        self._slots = [_Slot() for _ in range(SLOTS)]
        self._free: collections.deque[int] = collections.deque(range(SLOTS))
        self._waiting: collections.deque[_Batch] = collections.deque()
        self._closed = False

    @classmethod
    def start(cls, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
              timeout_s: float) -> ChildReceiver:
        """Blocking: spawn the child and have it join the trainer's gloo group."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               "OMP_NUM_THREADS": "1"}
        errlog = tempfile.TemporaryFile()  # noqa: SIM115 (the receiver owns it: closed in close())
        try:
            proc = subprocess.Popen([sys.executable, "-m", MODULE, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errlog, env=env)
        except BaseException:
            ours.close()
            errlog.close()
            raise
        finally:
            theirs.close()
        receiver = cls(proc, ours, errlog, timeout_s)
        try:
            receiver._send({"op": "join", "master_address": master_address, "master_port": master_port,
                            "rank": rank, "world_size": world_size, "group_name": group_name,
                            "timeout_s": timeout_s})
            receiver._message(timeout_s + STARTUP_S)
        except BaseException:
            receiver.close()
            raise
        return receiver

    def receive(self, pieces: list[Piece], emit: Callable[[Any], None]) -> None:
        """Blocking: the pieces, broadcast from rank 0 in order; each tensor is passed to `emit` as it lands (a
        view of shared memory, valid until the `SlotFree` emitted after its slot's last tensor is released)."""
        plan = batches(pieces)
        with self._lock:
            self._waiting.extend(plan)
            self._dispatch()
        for batch in plan:
            for piece, offset in zip(batch.pieces, batch.offsets, strict=True):
                self._message(self.timeout_s + GRACE_S)
                base = self._slots[batch.slot].base
                for part in piece.parts:
                    start = offset + part.offset
                    if part.nbytes:
                        emit((part.name, base[start:start + part.nbytes].view(part.dtype).view(part.shape)))
                    else:
                        emit((part.name, torch.empty(part.shape, dtype=part.dtype)))
            emit(SlotFree(self, batch.slot))

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
            self._dispatch()

    def close(self) -> None:
        """End the child (it holds no state worth a graceful exit) and free the slots."""
        with self._lock:
            self._closed = True
            self._waiting.clear()
        self._sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._errlog.close()
        self._slots = [_Slot() for _ in range(SLOTS)]  # the memory goes with the last view of it

    # -- internals ----------------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Under the lock: send each waiting batch whose turn it is to a free slot (growing the slot if needed)."""
        while self._waiting and self._free and not self._closed:
            batch = self._waiting.popleft()
            batch.slot = slot = self._free.popleft()
            try:
                if self._slots[slot].size < batch.nbytes:
                    self._grow(slot, batch.nbytes)
                self._send({"op": "recv", "slot": slot, "pieces": [
                    [off, p.nbytes, p.dtype, p.packed, p.parts[-1].name]
                    for p, off in zip(batch.pieces, batch.offsets, strict=True)]})
            except OSError as exc:  # the child is gone: the reader sees EOF
                logger.warning("the receiving process of a weight group cannot take a command: %s", exc)
                self._closed = True

    def _grow(self, slot: int, nbytes: int) -> None:
        size = -(-nbytes // GROW) * GROW
        fd = os.memfd_create("specroll-weights", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            socket.send_fds(self._sock, [json.dumps({"op": "slot", "slot": slot, "size": size}).encode()], [fd])
        finally:
            os.close(fd)
        self._slots[slot] = _Slot(size, torch.frombuffer(mm, dtype=torch.uint8))  # the old mapping goes with
        # its last view

    def _send(self, msg: dict[str, Any]) -> None:
        self._sock.sendall(json.dumps(msg).encode())

    def _message(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not select.select([self._sock], [], [], min(1.0, max(0.0, deadline - time.monotonic())))[0]:
            if time.monotonic() >= deadline:
                self.proc.kill()
                raise ReceiveFailed(f"the receiving process heard nothing for {timeout_s:g} s")
        try:
            data = self._sock.recv(REPLY_BYTES)
        except OSError as exc:
            data = b""
            logger.debug("weight group socket: %s", exc)
        if not data:
            raise ReceiveFailed(self._death())
        msg = json.loads(data)
        if "error" in msg:
            raise ReceiveFailed(str(msg["error"]))
        return dict(msg)

    def _death(self) -> str:
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        why = f"signal {_signal_name(-code)}" if code < 0 else f"exit code {code}"
        try:
            self._errlog.seek(0, os.SEEK_END)
            self._errlog.seek(max(0, self._errlog.tell() - 4096))
            tail = self._errlog.read().decode(errors="replace").strip().splitlines()
        except ValueError:  # closed meanwhile (the group was closed)
            tail = []
        said = next((line.strip() for line in reversed(tail) if "what():" in line),
                    next((line.strip() for line in reversed(tail) if "Error" in line), ""))
        if tail:
            logger.warning("the receiving process of a weight group died (%s); its last words: %s", why,
                           " | ".join(tail[-6:]))
        hint = " (the trainer broadcast more bytes than the bucket announced)" if "doesn't match" in said else ""
        return f"the receiving process died ({why}){hint}" + (f": {said.removeprefix('what():').strip()}"
                                                              if said else "")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


# -- the child ------------------------------------------------------------------------------------------------
def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


def _receive(pg: Any, base: torch.Tensor, pieces: list[list[Any]], sock: socket.socket) -> None:
    import torch.distributed as dist

    works = []
    for offset, nbytes, dtype_name, packed, _ in pieces:
        dtype = DTYPES[dtype_name]
        view = base[offset:offset + nbytes]
        tensor = view if packed else view.view(dtype)
        tail = min(nbytes, CANARY_BYTES) // dtype.itemsize * dtype.itemsize
        if tail:
            view[nbytes - tail:].view(dtype).fill_(float("nan"))
        works.append(dist.broadcast(tensor, 0, group=pg, async_op=True))
    for (offset, nbytes, dtype_name, _, name), work in zip(pieces, works, strict=True):
        work.wait()
        dtype = DTYPES[dtype_name]
        tail = min(nbytes, CANARY_BYTES) // dtype.itemsize * dtype.itemsize
        if tail and not bool(torch.isfinite(base[offset + nbytes - tail:offset + nbytes].view(dtype)).all()):
            raise ReceiveFailed(f"tensor {name!r}: the trainer broadcast fewer bytes than the bucket announced (or "
                                "values that are not finite)")
        sock.sendall(b'{"done": 1}')


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    sock = socket.socket(fileno=int(argv[0]))
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(1)
    raise_nice()  # before joining: gloo's threads inherit it (the parent counts this process's CPU)
    slots: dict[int, torch.Tensor] = {}
    pg = None
    while True:
        data, fds, _, _ = socket.recv_fds(sock, COMMAND_BYTES, 1)
        if not data:
            os._exit(0)  # the server closed the group (or exited)
        msg = json.loads(data)
        try:
            if msg["op"] == "join":
                pg = join_group(msg["master_address"], int(msg["master_port"]), int(msg["rank"]),
                                int(msg["world_size"]), str(msg["group_name"]), "gloo", float(msg["timeout_s"]))
                sock.sendall(b'{"joined": 1}')
            elif msg["op"] == "slot":
                mm = mmap.mmap(fds[0], int(msg["size"]), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                os.close(fds[0])
                slots[int(msg["slot"])] = torch.frombuffer(mm, dtype=torch.uint8)
            elif msg["op"] == "recv":
                _receive(pg, slots[int(msg["slot"])], msg["pieces"], sock)
        except Exception as exc:  # the group is unusable after a failed broadcast: report, then leave
            try:
                said = str(exc) if isinstance(exc, ReceiveFailed) else f"{type(exc).__name__}: {exc}"
                sock.sendall(json.dumps({"error": said[:2000]}).encode())
            finally:
                os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
