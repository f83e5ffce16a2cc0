"""Weight pushes over a private torch.distributed process group, in SGLang's protocol (what slime and AReaL call).

`/init_weights_update_group` joins a group the trainer hosts (rank 0, a TCP store at master_address:master_port;
this server is rank `rank_offset`). Each `/update_weights_from_distributed` call announces one bucket (names,
dtypes, shapes), then the trainer broadcasts its tensors from rank 0 in that order. The server checks the bucket
against the served model's WeightSpec before it receives a byte, then feeds each tensor as it lands to a staging
thread that builds the spare; the bucket that completes the checkpoint commits the push (wait | abort | keep).

A refused bucket closes the group (the trainer broadcasts it anyway; its bytes must never be read as the next
bucket's). A failed broadcast (trainer died, group timed out, a size other than announced) discards the push and
closes the group; the old weights serve on (in place: no version until a complete push). Gloo groups are
received in a child process (collective_child.py), which a mismatched broadcast aborts; NCCL groups here.

vLLM's weight-transfer protocol (TRL, vLLM's trainer engine) runs on the same groups: `start` opens the push,
each `update` is a bucket (maybe packed into chunks of a size both sides know: `packed_chunks`), `finish` commits.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from service.api.collective_child import ChildReceiver, Part, Piece, SlotFree, join_group
from service.api.push_protocol import PushResult, check_role_version
from service.backend.base import PushError, Staged
from service.backend.weight_check import DTYPES, Declared, WeightCheck, dtype_name
from service.cpu_threads import behind_generation

if TYPE_CHECKING:
    from service.api.push_service import PushService

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 120.0
TRANSFER_GROUP = "weight-transfer"  # the store prefix of the weight-transfer engine's group
DEFAULT_PACKED_BYTES = 2**30  # vLLM's default packed buffer: trainer and server cut chunks at the same size
_END = object()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def nbytes(d: Declared) -> int:
    n = DTYPES[dtype_name(d.dtype)].itemsize
    for x in d.shape:
        n *= x
    return n


def packed_chunks(bucket: Sequence[Declared], buffer_bytes: int) -> list[list[Declared]]:
    """vLLM's packed layout: tensors in order, a chunk closing with the tensor that takes it past buffer_bytes."""
    chunks: list[list[Declared]] = []
    current: list[Declared] = []
    size = 0
    for d in bucket:
        current.append(d)
        size += nbytes(d)
        if size > buffer_bytes:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


@dataclass(slots=True)
class Pending:
    """One version arriving bucket by bucket: a staging thread consumes the tensors as they come."""

    version: str
    mode: str
    cast: bool
    check: WeightCheck
    start: float
    received: set[str] = field(default_factory=set)
    dtype: str | None = None
    feed: queue.Queue[Any] = field(default_factory=queue.Queue)
    staged: Staged | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    consumed: bool = False  # the staging thread stopped taking from the feed

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The staging thread's side: each tensor is copied before the next is asked for, which is what lets a
        receiver reuse a slot once its `SlotFree` is taken."""
        while (item := self.feed.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, SlotFree):
                item.release()
                continue
            yield item

    def emit(self, item: Any) -> None:
        """The receiving side: hand over a tensor or a `SlotFree` (released at once once staging stopped)."""
        with self.lock:
            if not self.consumed:
                self.feed.put(item)
                return
        if isinstance(item, SlotFree):
            item.release()

    def stop_consuming(self) -> None:
        """The staging thread ends: what it left in the feed is dropped, its slots freed for the receiver."""
        with self.lock:
            self.consumed = True
        while True:
            try:
                item = self.feed.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, SlotFree):
                item.release()


def pieces(bucket: Sequence[Declared], packed_bytes: int | None) -> list[Piece]:
    """The broadcasts a bucket arrives in: one a tensor, or vLLM's packed chunks (one dtype a push, so the
    tensors' offsets in a chunk stay aligned)."""
    def part(d: Declared, offset: int) -> Part:
        return Part(d.name, DTYPES[dtype_name(d.dtype)], d.shape, offset, nbytes(d))

    if packed_bytes is None:
        return [Piece(nbytes(d), dtype_name(d.dtype), False, (part(d, 0),)) for d in bucket]
    out = []
    for chunk in packed_chunks(bucket, packed_bytes):
        parts, offset = [], 0
        for d in chunk:
            parts.append(part(d, offset))
            offset += nbytes(d)
        out.append(Piece(offset, dtype_name(chunk[0].dtype), True, tuple(parts)))
    return out


@dataclass(slots=True)
class Group:
    """A joined group: gloo received by a child process (`receiver`), NCCL in this one (`pg`)."""

    name: str
    pg: Any
    device: torch.device
    timeout_s: float
    receiver: ChildReceiver | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pending: Pending | None = None
    expiry: asyncio.Task[None] | None = None  # discards a push whose next bucket does not come

    packed_bytes: int | None = None  # the weight-transfer engine's packed chunk size; None: one tensor a broadcast

    def receive(self, bucket: Sequence[Declared], packed_bytes: int | None, emit: Callable[[Any], None]) -> None:
        """Blocking: the bucket's tensors, broadcast from rank 0 in order, each passed to `emit` as it lands."""
        plan = pieces(bucket, packed_bytes)
        if self.receiver is not None:
            self.receiver.receive(plan, emit)
            return
        import torch.distributed as dist

        for piece in plan:
            buf = torch.empty(piece.nbytes, dtype=torch.uint8, device=self.device)
            dist.broadcast(buf if piece.packed else buf.view(piece.parts[0].dtype), 0, group=self.pg)
            buf = buf if buf.device.type == "cpu" else buf.cpu()
            for p in piece.parts:
                emit((p.name, buf[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape)))

    def leave(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            return
        import torch.distributed as dist

        dist.destroy_process_group(self.pg)


@dataclass(frozen=True, slots=True)
class TransferInit:
    """vLLM's NCCL init_info (master_address/master_port rendezvous), with ours: backend, timeout_s, group_name."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BYTES
    packed_num_buffers: int = 2  # the trainer's double buffering; the server receives chunk by chunk
    backend: str = field(default_factory=default_backend)
    timeout_s: float = DEFAULT_TIMEOUT_S
    group_name: str = TRANSFER_GROUP

    def __post_init__(self) -> None:
        if not 0 < self.packed_buffer_size_bytes <= 2**40:
            raise PushError(f"packed_buffer_size_bytes must be in (0, 2**40], got {self.packed_buffer_size_bytes}")
        if self.packed_num_buffers < 1:
            raise PushError(f"packed_num_buffers must be >= 1, got {self.packed_num_buffers}")


class WeightGroups:
    """The process groups this server joined, by name, and the push each one is carrying."""

    def __init__(self, pushes: PushService) -> None:
        self.pushes = pushes
        self._groups: dict[str, Group] = {}
        self._transfer: str | None = None  # the weight-transfer engine's group
        self._transfers = 0  # pushes over it so far: names the versions a trainer leaves unnamed

    async def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                   backend: str, timeout_s: float | None = None) -> None:
        if backend not in BACKENDS:
            raise PushError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise PushError("backend nccl needs CUDA, which this server does not have: use gloo")
        if not group_name or group_name in self._groups:
            raise PushError(f"a weight update group named {group_name!r} exists: destroy it first" if group_name
                            else "group_name is required")
        if not 0 < rank_offset < world_size:
            raise PushError(f"rank_offset must be in [1, world_size), got {rank_offset} of {world_size}")
        timeout = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
        if not 0 < timeout <= 3600:
            raise PushError(f"timeout_s must be in (0, 3600], got {timeout}")
        try:
            if backend == "gloo":
                pg, receiver = None, await asyncio.to_thread(ChildReceiver.start, master_address, int(master_port),
                                                             rank_offset, world_size, group_name, timeout)
            else:
                pg, receiver = await asyncio.to_thread(join_group, master_address, int(master_port), rank_offset,
                                                       world_size, group_name, backend, timeout), None
        except Exception as exc:
            raise PushError(f"could not join weight update group {group_name!r} at {master_address}:{master_port}: "
                            f"{exc}") from exc
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._groups[group_name] = Group(group_name, pg, device, timeout, receiver)
        logger.info("joined weight update group %s (rank %d of %d, %s)", group_name, rank_offset, world_size, backend)

    # -- vLLM's weight-transfer engine: init, start, update (a bucket), finish (the swap), shutdown -------------
    async def transfer_init(self, info: TransferInit) -> None:
        """Join the trainer's group as the engine; an engine already there is shut down first (a restarted
        trainer re-initialises; a broadcast under way is waited for, at most its timeout)."""
        if self._transfer is not None:
            await self.transfer_shutdown()
        await self.init(info.master_address, info.master_port, info.rank_offset, info.world_size, info.group_name,
                        info.backend, info.timeout_s)
        self._groups[info.group_name].packed_bytes = info.packed_buffer_size_bytes if info.packed else None
        self._transfer = info.group_name

    def _engine(self) -> Group:
        group = self._groups.get(self._transfer or "")
        if group is None:
            self._transfer = None
            raise PushError("no weight transfer engine: call /init_weight_transfer_engine first (a failed or "
                            "timed-out broadcast shuts it down)")
        return group

    async def transfer_start(self, mode: str, cast: bool) -> None:
        """Open a push (it holds the target's push lock until finish); one still open is discarded."""
        group = self._engine()
        async with group.lock:
            if group.pending is not None:
                self._discard(group, "a new weight update started before it finished")
            self._transfers += 1
            group.pending = await self._begin(group, f"weight-transfer-{self._transfers}", mode, cast)
            group.expiry = asyncio.create_task(self._expire(group, group.pending))

    async def transfer_update(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                              packed: bool | None = None) -> int:
        """One bucket: checked, then received (packed as the engine was initialised unless `packed` says
        otherwise). Returns how many tensors the push still lacks."""
        group = self._engine()
        async with group.lock:
            try:
                if group.pending is None:
                    raise PushError("no weight update is open: call /start_weight_update first")
                bucket = self._declare(names, dtypes, shapes)
                self._check_bucket(group.pending, bucket)
            except PushError as exc:
                self._close(group, f"bucket refused: {exc}")
                raise PushError(f"{exc} (the weight transfer engine is shut down, as its broadcast must not be read "
                                "as the next bucket: init it again)") from exc
            chunk = group.packed_bytes if packed is None else (
                (group.packed_bytes or DEFAULT_PACKED_BYTES) if packed else None)
            left = await self._take(group, bucket, chunk)
            group.expiry = asyncio.create_task(self._expire(group, group.pending))
            return left

    async def transfer_finish(self, version: str | None) -> PushResult:
        """Commit the open push (all-or-nothing, in its mode) as `version`, or the engine's next version name."""
        group = self._engine()
        async with group.lock:
            pending = group.pending
            if pending is None:
                raise PushError("no weight update is open: call /start_weight_update first")
            if version is not None:
                check_role_version("target", version)
            left = sorted(set(pending.check.spec.shapes) - pending.received)
            if left:
                self._discard(group, f"finished with {len(left)} tensors not sent")
                raise PushError(f"the weight update is incomplete: {len(left)} tensors were not sent (first: "
                                f"{left[:4]}); {self._outcome()}")
            if group.expiry is not None:
                group.expiry.cancel()
                group.expiry = None
            group.pending = None
            pending.version = version or pending.version
            return await self._commit(pending)

    async def transfer_shutdown(self) -> None:
        name, self._transfer = self._transfer, None
        group = self._groups.get(name or "")
        if group is not None:
            async with group.lock:
                if self._groups.get(group.name) is group:
                    self._close(group, "weight transfer engine shut down")

    async def destroy(self, group_name: str) -> None:
        group = self._groups.get(group_name)
        if group is None:
            raise PushError(f"no weight update group named {group_name!r}")
        async with group.lock:
            if self._groups.get(group_name) is group:  # not closed meanwhile by a failed broadcast
                self._close(group, "destroyed")

    def close_all(self) -> None:
        """Server shutdown: every group closed, its push discarded, its receiving process ended."""
        for group in list(self._groups.values()):
            self._close(group, "the server shuts down")
        self._transfer = None

    def _close(self, group: Group, why: str) -> None:
        self._discard(group, why)
        self._groups.pop(group.name, None)
        try:
            group.leave()
        except Exception as exc:  # a group whose peer died may fail to tear down: it is dropped either way
            logger.warning("weight update group %s did not close cleanly: %s", group.name, exc)
        logger.info("weight update group %s closed: %s", group.name, why)

    async def _expire(self, group: Group, pending: Pending) -> None:
        """A push that started holds the target's push lock: one whose trainer stops sending is given up."""
        await asyncio.sleep(group.timeout_s)
        async with group.lock:
            if group.pending is pending and self._groups.get(group.name) is group:
                self._close(group, f"no bucket of version {pending.version} came for {group.timeout_s:g} s")

    def _discard(self, group: Group, why: str) -> None:
        if group.expiry is not None and group.expiry is not asyncio.current_task():
            group.expiry.cancel()
        group.expiry = None
        pending, group.pending = group.pending, None
        if pending is None:
            return
        pending.feed.put(PushError(f"push {pending.version} discarded: {why}"))
        if pending.thread is not None:
            pending.thread.join()
        self.pushes.role_lock("target").release()
        if self.pushes.metrics is not None:
            self.pushes.metrics.weight_push("target", ok=False)
        logger.warning("push %s over group %s discarded (%d tensors received): %s", pending.version, group.name,
                       len(pending.received), why)

    async def _begin(self, group: Group, version: str, mode: str, cast: bool) -> Pending:
        check_role_version("target", version)
        from service.api.push_service import check_mode_or_error

        mode = check_mode_or_error(mode)
        check = WeightCheck(self.pushes.role_spec("target"), cast)
        await self.pushes.role_lock("target").acquire()
        pending = Pending(version, mode, cast, check, time.perf_counter())

        def stage() -> None:
            try:
                with behind_generation(cpus=2):  # this thread and the child receiving the broadcast
                    pending.staged = self.pushes.stage_sync("target", pending.tensors(), cast, mode=mode)
            except BaseException as exc:
                pending.error = exc
            finally:
                pending.stop_consuming()

        pending.thread = threading.Thread(target=stage, name="specroll-group-push", daemon=True)
        pending.thread.start()
        return pending

    def _check_bucket(self, pending: Pending, bucket: list[Declared]) -> None:
        again = sorted({d.name for d in bucket} & pending.received)
        if again:
            raise PushError(f"tensors {again[:8]} were received already for version {pending.version}")
        dtype = pending.check.declared(bucket, partial=True)
        if pending.dtype is not None and dtype != pending.dtype:
            raise PushError(f"the push mixes dtypes: this bucket is {dtype}, earlier ones {pending.dtype}")
        pending.dtype = dtype

    async def update(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                     version: str, mode: str, cast: bool = False, load_format: str | None = None
                     ) -> PushResult | int:
        """One bucket. Returns how many tensors the push still lacks, or the push's result once it committed."""
        group = self._groups.get(group_name)
        if group is None:
            raise PushError(f"no weight update group named {group_name!r}: call /init_weights_update_group first")
        async with group.lock:
            try:
                if load_format not in (None, "", "auto"):
                    raise PushError(f"load_format {load_format!r} is not supported: send plain tensors")
                bucket = self._declare(names, dtypes, shapes)
                if group.pending is not None and group.pending.version != version:
                    self._discard(group, f"version {version} started before it was complete")
                if group.pending is None:
                    group.pending = await self._begin(group, version, mode, cast)
                self._check_bucket(group.pending, bucket)
            except PushError as exc:
                self._close(group, f"bucket refused: {exc}")
                raise PushError(f"{exc} (the group is closed, as its broadcast must not be read as the next bucket: "
                                "init a new one)") from exc
            pending = group.pending
            left = await self._take(group, bucket, None)
            if left:
                group.expiry = asyncio.create_task(self._expire(group, pending))
                return left
            group.pending = None
            return await self._commit(pending)

    @staticmethod
    def _declare(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[Declared]:
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise PushError(f"names, dtypes and shapes must be equally long and not empty (got {len(names)}, "
                            f"{len(dtypes)}, {len(shapes)})")
        return [Declared(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes,
                                                                                      strict=True)]

    async def _take(self, group: Group, bucket: list[Declared], packed_bytes: int | None) -> int:
        """Receive a checked bucket into the open push; returns how many tensors it still lacks. A failed
        broadcast discards the push and closes the group."""
        pending = group.pending
        assert pending is not None
        if group.expiry is not None:
            group.expiry.cancel()
            group.expiry = None
        try:
            await asyncio.to_thread(group.receive, bucket, packed_bytes, pending.emit)
        except Exception as exc:  # ReceiveFailed, or a gloo/NCCL error raised here
            self._close(group, f"the broadcast failed: {exc}")
            raise PushError(f"the broadcast of version {pending.version} failed, {self._outcome()} (the group is "
                            f"closed): {exc}") from exc
        pending.received.update(d.name for d in bucket)
        return len(set(pending.check.spec.shapes) - pending.received)

    def _outcome(self) -> str:
        """What a discarded push left serving: the old weights, or (loaded in place) no version at all."""
        if self.pushes.backend.weights_invalid:
            return "the weights it wrote in place serve no version until a complete push"
        return "nothing changed"

    async def _commit(self, pending: Pending) -> PushResult:
        lock = self.pushes.role_lock("target")
        try:
            pending.feed.put(_END)
            assert pending.thread is not None
            await asyncio.to_thread(pending.thread.join)
            if pending.error is not None:
                raise pending.error
            assert pending.staged is not None
            result = await self.pushes.apply(pending.staged, pending.version, pending.mode, pending.start)
        except BaseException:
            if self.pushes.metrics is not None:
                self.pushes.metrics.weight_push("target", ok=False)
            raise
        finally:
            lock.release()
        self.pushes.record(result)
        return result
