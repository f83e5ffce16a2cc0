"""Weight updates for the running server: chunked pushes, safetensors uploads and loads from a folder.

New weights (target or drafter) are checked completely against the role's `WeightSpec`, staged by the backend
beside the serving ones off the event loop, then committed: a target commit follows the push's mode (wait |
abort | keep); a drafter commit never holds generation back. One push per role at a time.

A drafter push in mode `with_target` is parked until the next target push publishes both as one atomic pair
(the new policy is never served with the old drafter, whose acceptance would collapse).

A delta push (a `base_version`) holds only what changed since the version it names; it is refused (409 /
FAILED_PRECONDITION, nothing changed) unless that version is the one served when the push takes its role's lock.

In place (`--weight-spare in-place`, no spare): a checked push pauses generation by its mode, loads into the
serving weights and resumes. Failing after its first write, the weights are no version until a complete push;
failing before it (its caller left while generation drained, or before its first byte), nothing changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import stat
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import client.checksums as checksums
from service.api.push_protocol import (
    ChunkReceiver,
    Manifest,
    PushResult,
    Staging,
    body_parts,
    check_role_version,
    dtype_name,
    read_body_head,
    sparse_pairs,
    validate_manifest,
)
from service.backend.base import (
    CAP_DELTA_PUSH,
    PAIR_MODE,
    Destinations,
    PushError,
    PushTooLarge,
    PushUnsupported,
    RolloutBackend,
    SparseValues,
    Staged,
    StaleBase,
    SwapResult,
    WeightSpec,
    check_mode,
)
from service.backend.weight_check import Declared, WeightCheck
from service.config import ConfigError
from service.cpu_threads import behind_generation
from service.safetensors_io import index_map, read_header, read_tensors, safetensors_files

if TYPE_CHECKING:
    from service.backend.metrics import Metrics

logger = logging.getLogger(__name__)
WORKER_EXIT_S = 30.0  # how long a failed push waits for its staging worker to give the spare back


def check_mode_or_error(mode: str, role: str = "target") -> str:
    if role == "drafter" and (mode or "").lower() == PAIR_MODE:
        return PAIR_MODE
    try:
        return check_mode(mode)
    except ValueError as exc:
        hint = f" (drafter pushes also take {PAIR_MODE!r})" if role == "drafter" else ""
        raise PushError(f"{exc}{hint}") from exc


class _Drawn:
    """The tensors of an in-place push, noting whether any was drawn (until then the backend wrote nothing of
    its own) and ending them once `stop` is set (the push's caller left)."""

    __slots__ = ("_stop", "_tensors", "drawn")

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]],
                 stop: threading.Event | None) -> None:
        self._tensors: Iterator[tuple[str, torch.Tensor | SparseValues]] = iter(tensors)
        self._stop, self.drawn = stop, False

    def __iter__(self) -> _Drawn:
        return self

    def __next__(self) -> tuple[str, torch.Tensor | SparseValues]:
        if self._stop is not None and self._stop.is_set():
            raise PushError("the push's caller left before it was loaded")
        item = next(self._tensors)
        self.drawn = True
        return item


async def _offsets(parts: AsyncIterator[list[bytes]]) -> AsyncIterator[tuple[int, list[bytes]]]:
    offset = 0
    async for group in parts:
        yield offset, group
        offset += sum(len(p) for p in group)


class PushService:
    def __init__(self, backend: RolloutBackend, metrics: Metrics | None = None, max_push_bytes: int = 2**40,
                 load_root: str | Path | Sequence[str | Path] | None = None) -> None:
        self.backend = backend
        self.metrics = metrics
        self.max_push_bytes = max_push_bytes
        roots = [load_root] if isinstance(load_root, str | Path) else list(load_root or ())
        self.load_roots = tuple(Path(r).expanduser().resolve() for r in roots if str(r))  # empty: anywhere
        self._locks: dict[str, asyncio.Lock] = {}
        self._parked: tuple[Staged, str] | None = None  # a drafter waiting for the next target push
        self._staging: dict[str, Staging] = {}  # per role: where chunked pushes gather their tensors
        self._paused_for: dict[str, bool] = {}  # in-place pushes under way, per role: whether they resume after
        self._aborted_for: dict[str, list[str]] = {}  # per role: what an in-place push's pause aborted
        self._invalid: dict[str, str] = {}  # per role: why an in-place push left its weights no version
        self._loaded_in_place: set[str] = set()  # roles whose in-place push is loaded and not yet committed
        from service.api.collective import WeightGroups  # it builds on this service

        self.groups = WeightGroups(self)  # pushes over process groups (SGLang's update_weights_from_distributed)

    def role_spec(self, role: str) -> WeightSpec:
        spec = self.backend.weight_roles().get(role)
        if spec is None:
            raise PushUnsupported(self.backend.unsupported(role) or f"this server takes no {role} weights")
        return spec

    def _stage(self, role: str, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]], cast: bool,
               delta: bool = False, into: Destinations | None = None, mode: str = "wait",
               stop: threading.Event | None = None) -> Staged:
        """Runs off the event loop: the backend checks each tensor (the one weight validation's `stream` half)
        and copies it beside the serving weights (`delta`: into a copy of them; `into`: the transport writes
        where the backend offers, service/backend/base.py `Destinations`). In place: generation pauses by
        `mode` first and the backend writes into the serving weights; `stop` (the caller left) withdraws a
        pause not yet taken and ends the load before its next tensor."""
        if not self.backend.weights_in_place:
            return self.backend.stage_weights(role, tensors, cast=cast, delta=delta, into=into)
        if mode == PAIR_MODE:
            raise PushUnsupported(f"mode {PAIR_MODE!r} parks a staged drafter until the next target push; a server "
                                  "loading pushes in place (--weight-spare in-place) has nowhere to park it: push "
                                  "the drafter with mode keep")
        self._pause_in_place(role, mode, stop)
        drawn = _Drawn(tensors, stop)
        try:
            staged = self.backend.stage_weights(role, drawn, cast=cast, delta=delta, into=into)
        except BaseException as exc:
            if drawn.drawn or (into is not None and into.taken):
                self._fail_in_place(role, f"the {role} push failed while loading in place ({exc})")
            else:
                self._withdraw_in_place(role, exc)
            raise
        if stop is not None and stop.is_set():  # loaded, but nobody is left to commit it
            self._fail_in_place(role, f"the {role} push was loaded in place after its caller left")
            raise PushError("the push's caller left while it was loaded")
        self._loaded_in_place.add(role)
        return staged

    def _pause_in_place(self, role: str, mode: str, stop: threading.Event | None = None) -> None:
        """Blocks (a worker thread): generation paused by the push's mode (a drafter's: keep) before any write.
        A wait-mode pause drains what runs first; `stop` set meanwhile withdraws it."""
        was_paused = self.backend.stats().paused
        t0 = time.perf_counter()
        pending = self.backend.pause(mode if role == "target" else "keep")
        while True:
            try:
                aborted = pending.result(timeout=None if stop is None else 0.05)
                break
            except FutureTimeout:
                if stop is not None and stop.is_set() and pending.cancel():
                    logger.warning("in-place %s push withdrawn while generation drained for it: its caller left",
                                   role)
                    raise PushError("the push's caller left before generation paused for it") from None
        self._paused_for[role] = not was_paused
        self._aborted_for[role] = list(aborted)
        logger.info("generation paused (%s) for an in-place %s push after %.3f s%s", mode, role,
                    time.perf_counter() - t0, f", {len(aborted)} aborted" if aborted else "")

    def _withdraw_in_place(self, role: str, exc: BaseException) -> None:
        """Blocks: an in-place push ended after its pause and before its first write: generation resumes on the
        weights it found, which stay their version."""
        resume = self._paused_for.pop(role, None)
        self._aborted_for.pop(role, None)
        logger.warning("in-place %s push ended before it wrote anything (%s): the weights serve on", role, exc)
        if resume:
            self.backend.resume().result()

    def _fail_in_place(self, role: str, reason: str) -> None:
        """Blocks: an in-place push ended after its pause without serving: its weights are marked no version,
        what was paused or queued on them is aborted, and the engine leaves the pause (it admits nothing)."""
        self._loaded_in_place.discard(role)
        if role not in self._paused_for:
            return
        resume = self._paused_for.pop(role)
        self._invalid[role] = reason
        self.backend.set_weights_invalid("; ".join(self._invalid.values()))
        if self.metrics is not None:
            self.metrics.weights_invalid.set(1)
        self.backend.abort_all("weight_push").result()
        if resume:
            self.backend.resume().result()

    def _settle_in_place(self, role: str, version: str, pending: Future[SwapResult]) -> None:
        """Blocks: once the engine has answered an in-place commit, the role's weights are a version again and
        generation resumes, or (not served) they are marked no version."""
        try:
            pending.result()
        except BaseException as exc:
            self._fail_in_place(role, f"the {role} push {version} was loaded in place but not served ({exc!r})")
            return
        self._loaded_in_place.discard(role)
        resume = self._paused_for.pop(role, None)
        if resume is None:
            return
        self._invalid.pop(role, None)
        self.backend.set_weights_invalid("; ".join(self._invalid.values()))
        if self.metrics is not None and not self._invalid:
            self.metrics.weights_invalid.set(0)
        if resume:
            self.backend.resume().result()

    def check_base(self, role: str, base_version: str) -> None:
        """A delta push may apply: this backend takes deltas for `role`, and `base_version` is the one served."""
        if not base_version:
            return
        if role != "target":
            raise PushUnsupported(f"delta pushes (base_version) go to the target only; push the {role} in full")
        info = self.backend.info()
        if CAP_DELTA_PUSH not in info.capabilities:
            raise PushUnsupported(f"the {info.backend} backend takes full pushes only (no base_version): it holds "
                                  "no copy of the serving weights in this process to apply a delta to")
        served = self.backend.stats().policy_version
        if served != base_version:
            raise StaleBase(f"this delta push applies to version {base_version!r}, but the server serves {served!r}"
                            f": nothing was changed; push against {served!r}, or push in full")

    stage_sync = _stage

    def role_lock(self, role: str) -> asyncio.Lock:
        """One push per role at a time (a push over a process group holds it from its first bucket to its swap)."""
        return self._locks.setdefault(role, asyncio.Lock())

    def check(self, role: str, tensors: list[Declared], cast: bool = False) -> None:
        """What a push would be refused for, before it sends anything (`/weights/check`)."""
        WeightCheck(self.role_spec(role), cast).declared(tensors)

    def _park(self, staged: Staged, version: str, start: float) -> PushResult:
        if self._parked is not None:
            logger.info("drafter %s, parked for the next target push, replaced by %s", self._parked[1], version)
            self.backend.discard(self._parked[0])
        self._parked = (staged, version)
        logger.info("drafter %s staged: it serves from the next target push on", version)
        return PushResult(staged.role, version, staged.nbytes, time.perf_counter() - start)

    async def _apply(self, staged: Staged, version: str, mode: str, start: float) -> PushResult:
        if mode == PAIR_MODE:
            return self._park(staged, version, start)
        paired, self._parked = (self._parked, None) if staged.role == "target" else (None, self._parked)
        if paired is not None:
            logger.info("target %s and drafter %s publish as one pair", version, paired[1])
        pending: Future[SwapResult] = self.backend.commit_weights(staged, version, mode, paired)
        if staged.role in self._paused_for:
            try:
                swap = await asyncio.wrap_future(pending)
            finally:  # whatever became of the commit (a caller that left cannot stop one applying), settled here
                await asyncio.shield(asyncio.to_thread(self._settle_in_place, staged.role, version, pending))
            aborted = self._aborted_for.pop(staged.role, [])
            return PushResult(staged.role, version, staged.nbytes, time.perf_counter() - start, swap.swap_seconds,
                              swap.wait_seconds, [*aborted, *swap.aborted])
        try:
            swap = await asyncio.wrap_future(pending)
        except asyncio.CancelledError:
            # The caller left while its push waited. Not applied yet: it never will be (the backend releases
            # the staged weights). Already being applied: it completes, and shows in the version and the log.
            if pending.cancelled():
                logger.warning("push of %s weights %s cancelled: the client left before it was applied",
                               staged.role, version)
            else:
                pending.add_done_callback(lambda f: None if f.cancelled() or f.exception() else logger.warning(
                    "push of %s weights %s applied although its client left", staged.role, version))
            raise
        return PushResult(staged.role, version, staged.nbytes, time.perf_counter() - start, swap.swap_seconds,
                          swap.wait_seconds, swap.aborted)

    apply = _apply

    async def _locked(self, role: str, start: float, work: Any) -> PushResult:
        lock = self.role_lock(role)
        try:
            async with lock:
                try:
                    result: PushResult = await work
                except BaseException as exc:
                    if role in self._loaded_in_place:  # failed between its load and its commit
                        await asyncio.shield(asyncio.to_thread(
                            self._fail_in_place, role, f"the {role} push failed after loading in place ({exc!r})"))
                    raise
        except BaseException:
            if self.metrics is not None:
                self.metrics.weight_push(role, ok=False)
            raise
        self.record(result)
        return result

    def record(self, result: PushResult) -> None:
        role = result.role
        if self.metrics is not None:
            self.metrics.weight_push(role, True, result.seconds, result.nbytes, result.swap_seconds)
        logger.info("%s weights %s applied: %d bytes in %.3f s (swap %.1f ms, waited %.2f s)", role,
                    result.version, result.nbytes, result.seconds, result.swap_seconds * 1e3, result.wait_seconds)

    # -- entry points -----------------------------------------------------------------------------------
    async def push_stream(self, manifest: Manifest, chunks: AsyncIterator[tuple[int, Any]]) -> PushResult:
        """A chunked push: `chunks` yields (offset, bytes) after the manifest."""
        start = time.perf_counter()
        manifest.mode = check_mode_or_error(manifest.mode, manifest.role)
        check_role_version(manifest.role, manifest.version)
        validate_manifest(manifest, self.role_spec(manifest.role), self.max_push_bytes)
        self.check_base(manifest.role, manifest.base_version)
        return await self._locked(manifest.role, start, self._receive(manifest, chunks, start))

    def staging(self, role: str) -> Staging:
        """The buffer `role`'s chunked pushes gather tensors without a destination in (read by tests)."""
        return self._staging.setdefault(role, Staging())

    def _receiver(self, manifest: Manifest, **kw: Any) -> ChunkReceiver[Staged]:
        delta = bool(manifest.base_version)
        into = None if delta else Destinations()
        stop = threading.Event()
        return ChunkReceiver(manifest, lambda ts: self._stage(manifest.role, ts, manifest.cast, delta, into,
                                                              manifest.mode, stop),
                             staging=self.staging(manifest.role),
                             discard=self.backend.discard, into=into, cancelled=stop, **kw)

    async def _staged(self, build: Callable[[threading.Event], Staged]) -> Staged:
        """`build(stop)` off the event loop. A caller that leaves sets `stop` and waits (under the role's lock)
        for the build to end: a pause not taken yet is withdrawn, what was staged goes back to the backend."""
        stop = threading.Event()
        job = _own_thread(lambda: build(stop))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            stop.set()
            with contextlib.suppress(Exception):
                self.backend.discard(await asyncio.shield(job))
            raise

    async def _receive(self, manifest: Manifest, chunks: AsyncIterator[tuple[int, Any]], start: float,
                       receiver: ChunkReceiver[Staged] | None = None,
                       guard: Callable[[Awaitable[PushResult]], Awaitable[PushResult]] | None = None) -> PushResult:
        try:
            self.check_base(manifest.role, manifest.base_version)  # again under the lock: no push ran between
        except BaseException:
            if receiver is not None:
                receiver.cancel()
            raise
        receiver = receiver or self._receiver(manifest)
        try:
            async for offset, data in chunks:
                await receiver.afeed(offset, data)
        except BaseException:
            receiver.cancel()
            # The worker ends at its next piece and gives the spare back: wait for that under the role's lock,
            # so the next push finds the spare (not a fresh build beside a worker still holding it).
            await asyncio.shield(asyncio.to_thread(receiver.join, WORKER_EXIT_S))
            raise
        received = time.perf_counter()
        finishing = asyncio.ensure_future(asyncio.to_thread(receiver.finish))
        try:
            staged = await asyncio.shield(finishing)
        except asyncio.CancelledError:
            # Every byte is in and the worker still builds: what it builds goes back to the backend (the spare),
            # under the role's lock, before the cancel goes on.
            receiver.cancel()
            with contextlib.suppress(Exception):
                self.backend.discard(await asyncio.shield(finishing))
            raise
        staged.nbytes = manifest.total_bytes
        logger.debug("push %s: bytes received after %.3f s, weights staged %.3f s later", manifest.version,
                     received - start, time.perf_counter() - received)
        applied = self._apply(staged, manifest.version, manifest.mode, start)
        return await (guard(applied) if guard is not None else applied)

    async def push_body(self, role: str, version: str, body: AsyncIterator[bytes], *, length: int | None = None,
                        mode: str = "wait", dtype: str | None = None, cast: bool = False,
                        digest: tuple[str, str] | None = None,
                        guard: Callable[[Awaitable[PushResult]], Awaitable[PushResult]] | None = None) -> PushResult:
        """An upload of a safetensors body, streamed into the push's buffers as it arrives (no file): its header
        is checked like a manifest before any tensor byte is taken. `digest`: (kind, hex) of the whole body;
        `guard` wraps the commit (the HTTP route cancels it when its client leaves)."""
        start = time.perf_counter()
        check_role_version(role, version)
        mode = check_mode_or_error(mode, role)
        spec = self.role_spec(role)
        whole = None
        if digest is not None:
            try:
                kind = checksums.kind_of(digest[0])
            except ValueError as exc:
                raise PushError(str(exc)) from None
            if not checksums.well_formed(kind, digest[1]):
                raise PushError(f"the body's {kind} must be {checksums.hex_digits(kind)} hex digits, got {digest[1]!r}")
            whole = (checksums.new(kind), kind, digest[1])
        head = await read_body_head(body, length)
        if not head.tensors:
            raise PushError("the upload holds no tensors")
        declared = dtype_name(dtype) if dtype else dtype_name(head.tensors[0].dtype)
        if not dtype:  # a header names a dtype per tensor: one push holds one
            for t in head.tensors[1:]:
                if dtype_name(t.dtype) != declared:
                    raise PushError(f"the push mixes dtypes: tensor {t.name!r} has dtype {dtype_name(t.dtype)}, "
                                    f"others {declared} (a push holds one dtype)")
        manifest = Manifest(role, version, declared, head.tensors, mode, cast, checksum=None)
        size = len(head.raw) + manifest.total_bytes
        if size > self.max_push_bytes:  # the body would pass the upload limit: refuse before it streams in
            raise PushTooLarge(f"request body exceeds the limit of {self.max_push_bytes} bytes: its safetensors "
                               f"header declares {size}")
        validate_manifest(manifest, spec, self.max_push_bytes)
        if whole is not None:
            whole[0].update(head.raw)

        async def work() -> PushResult:
            receiver = self._receiver(manifest, max_chunk=2**62, whole=whole)
            offsets = _offsets(body_parts(head.rest, body))
            return await self._receive(manifest, offsets, start, receiver, guard)

        return await self._locked(role, start, work())

    async def push_tensors(self, role: str, version: str, tensors: dict[str, torch.Tensor], mode: str = "wait",
                           dtype: str | None = None, cast: bool = False, base_version: str = "") -> PushResult:
        """An upload of whole tensors (a safetensors body). With `base_version`, a delta: only what changed, a
        sparse tensor as the pair `NAME:indices`, `NAME:values` (service/api/push_protocol.py `sparse_pairs`)."""
        start = time.perf_counter()
        check_role_version(role, version)
        mode = check_mode_or_error(mode, role)
        spec = self.role_spec(role)
        if base_version:
            check_role_version(role, base_version)
        if not tensors and not base_version:
            raise PushError("the upload holds no tensors")
        entries = sparse_pairs(tensors, spec) if base_version else dict(tensors)
        declared = dtype_name(dtype) if dtype else None
        for name, t in entries.items():
            got = dtype_name(str((t.values if isinstance(t, SparseValues) else t).dtype))
            if declared is not None and got != declared:
                raise PushError(f"tensor {name!r} has dtype {got}, but the upload declares {declared}")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if nbytes > self.max_push_bytes:
            raise PushError(f"upload of {nbytes} bytes exceeds the server limit of {self.max_push_bytes} bytes")
        try:
            if entries:
                WeightCheck(spec, cast).declared(
                    (Declared(n, str((t.values if isinstance(t, SparseValues) else t).dtype), tuple(t.shape))
                     for n, t in entries.items()), partial=bool(base_version))
        except PushError as exc:
            raise PushError(f"{role} upload: {exc}") from exc
        self.check_base(role, base_version)

        async def work() -> PushResult:
            self.check_base(role, base_version)  # again under the lock: no push of it ran between
            staged = await self._staged(lambda stop: self._stage(role, entries.items(), cast, bool(base_version),
                                                                 None, mode, stop))
            staged.nbytes = nbytes
            return await self._apply(staged, version, mode, start)

        return await self._locked(role, start, work())

    async def load_path(self, role: str, version: str, path: str, mode: str = "wait",
                        cast: bool = False) -> PushResult:
        """Load safetensors weights from a folder the server can read, or from a sealed memfd of a process on
        this host (`/proc/<pid>/fd/<fd>`, `client.push_weights_memfd`)."""
        start = time.perf_counter()
        check_role_version(role, version)
        mode = check_mode_or_error(mode, role)
        if MEMFD_PATH.fullmatch(path or ""):
            os.close(open_sealed_memfd(path))  # refused now, not after the pushes ahead of it
            self.role_spec(role)

            def build(stop: threading.Event) -> Staged:
                fd = open_sealed_memfd(path)  # this thread's own: open for as long as it reads
                try:
                    files = [("memfd", Path(f"/proc/self/fd/{fd}"))]
                    return self._read_files(role, f"memfd {path!r}", None, files, cast, mode, stop)
                finally:
                    os.close(fd)
        else:
            folder = self._allowed(path)
            files = self._files(folder)
            self.role_spec(role)

            def build(stop: threading.Event) -> Staged:
                return self._read_files(role, f"folder {str(folder)!r}", folder, files, cast, mode, stop)

        async def work() -> PushResult:
            return await self._apply(await self._staged(build), version, mode, start)

        return await self._locked(role, start, work())

    def _allowed(self, path: str) -> Path:
        if not path:
            raise PushError("path is required")
        folder = Path(path).expanduser().resolve()
        if not self._inside(folder):
            raise PermissionError(f"path {path!r} is outside the folders the server may load from (--load-root)")
        if not folder.is_dir():
            raise PushError(f"no such folder on the server: {path!r}")
        return folder

    def _inside(self, path: Path) -> bool:
        return not self.load_roots or any(path.is_relative_to(r) for r in self.load_roots)

    def _files(self, folder: Path) -> list[tuple[str, Path]]:
        """The folder's safetensors files (the name the folder gives each, its resolved path): each a regular file
        inside the load root (a shard that is a symlink to a file elsewhere is refused like a folder elsewhere)."""
        try:
            files = safetensors_files(folder)
        except ConfigError as exc:
            raise PushError(str(exc)) from exc
        resolved = []
        for f in files:
            real = f.resolve()
            if not self._inside(real):
                raise PermissionError(f"{f.name} in {str(folder)!r} resolves to a file outside the folder the "
                                      "server may load from")
            if not real.is_file():
                raise PushError(f"{f.name} in {str(folder)!r} is not a regular file")
            resolved.append((f.name, real))
        return resolved

    def _declared(self, folder: Path | None, files: list[tuple[str, Path]]) -> list[Declared]:
        """Every tensor the files' headers announce (headers checked against their files), and the index's map
        checked against them."""
        try:
            weight_map = index_map(folder) if folder is not None else None
            out = [Declared(name, dtype, shape, label) for label, real in files
                   for name, (dtype, shape) in read_header(real).items()]
        except ConfigError as exc:
            raise PushError(str(exc)) from exc
        if weight_map is not None:
            found = {d.name for d in out}
            for d in out:
                mapped = weight_map.get(d.name)
                if mapped is not None and Path(mapped).name != d.where:
                    raise PushError(f"tensor {d.name!r} is in {d.where}, but the index maps it to {mapped}")
            absent = sorted(set(weight_map) - found)
            if absent:
                raise PushError(f"the index names tensors no file holds: {absent[:8]}")
        return out

    def _read_files(self, role: str, where: str, folder: Path | None, files: list[tuple[str, Path]], cast: bool,
                    mode: str = "wait", stop: threading.Event | None = None) -> Staged:
        """Stage the tensors of safetensors `files` (a folder's, or one memfd's: `folder` None, no index)."""
        try:
            WeightCheck(self.role_spec(role), cast).declared(self._declared(folder, files))
            if self.backend.weights_in_place:  # refused here leaves the serving weights as they are
                self._read_checked(role, [real for _, real in files], cast)
        except (PushError, ConfigError) as exc:
            raise PushError(f"{role} {where}: {exc}") from exc
        into = Destinations()
        try:
            staged = self._stage(role, read_tensors([real for _, real in files], into.get), cast, into=into,
                                 mode=mode, stop=stop)
        except ConfigError as exc:  # a file changed or tore after its header was checked
            raise PushError(f"{role} {where}: {exc}") from exc
        staged.nbytes = sum(real.stat().st_size for _, real in files)
        return staged

    def _read_checked(self, role: str, files: list[Path], cast: bool) -> None:
        """Before an in-place load pauses anything: every tensor of the files read and put through the one
        weight validation (shapes, dtype, finite values), so a bad file is refused with nothing written."""
        for _ in WeightCheck(self.role_spec(role), cast).stream(read_tensors(files)):
            pass


def _own_thread(fn: Callable[[], Staged]) -> asyncio.Future[Staged]:
    """`fn()` on a thread of its own, running behind the engine's (`behind_generation`), as a future of the
    running loop: not on the loop's shared pool, whose threads would keep the lower priority."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Staged] = loop.create_future()

    def settle(result: Staged | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result, error = None, None
        try:
            with behind_generation():
                result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits it
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="specroll-stage", daemon=True).start()
    return done


MEMFD_PATH = re.compile(r"/proc/\d+/fd/\d+")
MEMFD_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def open_sealed_memfd(path: str) -> int:
    """The server's own fd for another process's memfd named by `path` (`/proc/<pid>/fd/<fd>`), checked: a memfd
    (not a file or a pipe reached through /proc, which --load-root would govern) sealed against writes,
    shrinking and growing, so the bytes cannot change while they are read. The kernel decides whether this
    server may open it (same host, PID namespace and user, or the rights to read that process)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise PushError(f"memfd {path!r} cannot be opened by the server: {exc.strerror} (it must be a file of a "
                        "live process on the server's host, in its PID namespace, readable by the server's user)"
                        ) from exc
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if not target.startswith("/memfd:") or not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PushError(f"{path!r} is not a memfd; a checkpoint on disk is loaded by its folder's path")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & MEMFD_SEALS != MEMFD_SEALS:
            raise PushError(f"memfd {path!r} is not sealed: seal it against writes, shrinking and growing "
                            "(F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW) before pushing it, so its bytes cannot "
                            "change while the server reads them")
    except BaseException:
        os.close(fd)
        raise
    return fd
