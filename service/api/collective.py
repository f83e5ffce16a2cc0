"""Weight pushes over a private torch.distributed process group, in SGLang's protocol (what slime and AReaL call).

`/init_weights_update_group` joins a group the trainer hosts (rank 0, a TCP store at master_address:master_port;
this server is rank `rank_offset`). Each `/update_weights_from_distributed` call announces one bucket (names,
dtypes, shapes), then the trainer broadcasts its tensors from rank 0 in that order. The server checks the bucket
against the served model's WeightSpec with the one weight validation before it receives a byte, receives it,
and feeds it to a staging thread that builds the spare weights; the bucket that completes the checkpoint commits
the push (mode wait | abort | keep), and only then does anything serve.

A refused bucket closes the group: the trainer broadcasts it anyway, and its bytes must never be read as the next
bucket's. A broadcast that fails (the trainer died, the group timed out) discards the push and closes the group;
the old weights serve on and the next group can start at once.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from service.api.push_protocol import PushResult, check_role_version
from service.backend.base import PushError, Staged
from service.backend.weight_check import DTYPES, Declared, WeightCheck, dtype_name

if TYPE_CHECKING:
    from service.api.push_service import PushService

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 120.0
_END = object()


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

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        while (item := self.feed.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item


@dataclass(slots=True)
class Group:
    name: str
    pg: Any
    device: torch.device
    timeout_s: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pending: Pending | None = None
    expiry: asyncio.Task[None] | None = None  # discards a push whose next bucket does not come

    def receive(self, bucket: Sequence[Declared]) -> list[tuple[str, torch.Tensor]]:
        """Blocking: the bucket's tensors, broadcast from rank 0 in order."""
        import torch.distributed as dist

        out = []
        for d in bucket:
            t = torch.empty(d.shape, dtype=DTYPES[dtype_name(d.dtype)], device=self.device)
            dist.broadcast(t, 0, group=self.pg)
            out.append((d.name, t if t.device.type == "cpu" else t.cpu()))
        return out


class WeightGroups:
    """The process groups this server joined, by name, and the push each one is carrying."""

    def __init__(self, pushes: PushService) -> None:
        self.pushes = pushes
        self._groups: dict[str, Group] = {}

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
            pg = await asyncio.to_thread(join_group, master_address, int(master_port), rank_offset, world_size,
                                         group_name, backend, timeout)
        except Exception as exc:
            raise PushError(f"could not join weight update group {group_name!r} at {master_address}:{master_port}: "
                            f"{exc}") from exc
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._groups[group_name] = Group(group_name, pg, device, timeout)
        logger.info("joined weight update group %s (rank %d of %d, %s)", group_name, rank_offset, world_size, backend)

    async def destroy(self, group_name: str) -> None:
        group = self._groups.get(group_name)
        if group is None:
            raise PushError(f"no weight update group named {group_name!r}")
        async with group.lock:
            if self._groups.get(group_name) is group:  # not closed meanwhile by a failed broadcast
                self._close(group, "destroyed")

    def _close(self, group: Group, why: str) -> None:
        import torch.distributed as dist

        self._discard(group, why)
        self._groups.pop(group.name, None)
        try:
            dist.destroy_process_group(group.pg)
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
                pending.staged = self.pushes.stage_sync("target", pending.tensors(), cast)
            except BaseException as exc:
                pending.error = exc

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
                if not (len(names) == len(dtypes) == len(shapes)) or not names:
                    raise PushError(f"names, dtypes and shapes must be equally long and not empty (got {len(names)}, "
                                    f"{len(dtypes)}, {len(shapes)})")
                bucket = [Declared(str(n), str(d), tuple(int(x) for x in s))
                          for n, d, s in zip(names, dtypes, shapes, strict=True)]
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
            try:
                tensors = await asyncio.to_thread(group.receive, bucket)
            except Exception as exc:
                self._close(group, f"the broadcast failed: {exc}")
                raise PushError(f"the broadcast of version {version} failed, nothing changed: {exc}") from exc
            for item in tensors:
                pending.feed.put(item)
            pending.received.update(d.name for d in bucket)
            left = sorted(set(pending.check.spec.shapes) - pending.received)
            if group.expiry is not None:
                group.expiry.cancel()
                group.expiry = None
            if left:
                group.expiry = asyncio.create_task(self._expire(group, pending))
                return len(left)
            group.pending = None
            return await self._commit(pending)

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
