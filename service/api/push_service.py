"""Weight updates for the running server: chunked pushes, safetensors uploads and loads from a folder.

New weights (target or draft model) are checked completely, built beside the serving ones off the engine
thread, then swapped between two engine steps. A target swap follows the push's mode (wait | abort |
keep); a drafter swap never holds generation back. One push per role at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from service.api.push_protocol import (
    ChunkReceiver,
    Manifest,
    PushError,
    PushResult,
    PushUnsupported,
    check_role_version,
    dtype_name,
    validate_manifest,
)
from service.config import ConfigError, ModelConfig
from service.engine.loop import EngineLoop, SwapResult, check_mode
from service.models.llama import CausalLM
from service.models.loader import (
    WeightError,
    build_model,
    check_tensors,
    iter_safetensors,
    load_tensors,
    safetensors_files,
)

if TYPE_CHECKING:
    from service.backend.metrics import Metrics
    from service.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def draft_model_of(engine: LLMEngine) -> tuple[str, CausalLM] | None:
    """The engine's draft-model drafter that pushes go to: (name, serving model), or None."""
    for name, drafter in getattr(engine, "drafters", {}).items():
        model = getattr(getattr(drafter, "exec", None), "model", None)
        if isinstance(model, CausalLM):
            return name, model
    return None


def _placed(model: CausalLM, dtype: torch.dtype, device: torch.device) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.dtype == dtype and p.device.type == device.type


def check_mode_or_error(mode: str) -> str:
    try:
        return check_mode(mode)
    except ValueError as exc:
        raise PushError(str(exc)) from exc


class WeightManager:
    def __init__(self, loop: EngineLoop, metrics: Metrics | None = None, max_push_bytes: int = 2**40,
                 load_root: str | Path | None = None, reuse_buffers: bool = True) -> None:
        self.loop = loop
        self.metrics = metrics
        self.max_push_bytes = max_push_bytes
        self.load_root = Path(load_root).resolve() if load_root else None
        # Double buffering: the weights a swap replaced become the buffer the next push of that role is
        # loaded into (no allocation, no page faults). The engine keeps no reference to replaced weights.
        self.reuse_buffers = reuse_buffers
        self._spare: dict[str, CausalLM] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # -- per role ---------------------------------------------------------------------------------------
    def role_config(self, role: str) -> ModelConfig:
        engine = self.loop.engine
        if role == "target":
            return engine.model_config
        found = draft_model_of(engine)
        if found is None:
            drafter = getattr(engine.config, "drafter", "none")
            raise PushUnsupported(f"the server runs drafter {drafter!r}, which has no draft model to push weights "
                                  "into (start it with --drafter <draft model folder>)")
        return found[1].config

    def _build(self, role: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> CausalLM:
        """The role's new weights, beside the serving ones (runs off the event loop and the engine thread)."""
        engine = self.loop.engine
        cfg = self.role_config(role)
        spare = self._spare.pop(role, None)
        if spare is not None and spare.config == cfg and _placed(spare, engine.dtype, engine.device):
            try:
                load_tensors(spare, tensors)
            except BaseException:
                self._spare[role] = spare  # not serving: its contents do not matter, its memory does
                raise
            return spare
        return build_model(cfg, tensors, engine.dtype, engine.device)

    def _keep_or_free(self, role: str, replaced: Any) -> None:
        if isinstance(replaced, CausalLM) and self.reuse_buffers:
            self._spare[role] = replaced
        elif replaced is not None:
            self.loop.hooks.release(replaced)  # freed on the hooks thread, not the event loop

    def _abandoned(self, role: str, version: str, model: CausalLM, pending: Future[SwapResult]) -> None:
        """The caller left while its push waited. Not applied yet: it never will be (the engine skips a
        cancelled swap) and the staged weights are freed. Already being applied: it completes, and shows in the
        version and the log."""
        if pending.cancelled():
            logger.warning("push of %s weights %s cancelled: the client left before it was applied; "
                           "the staged weights are freed", role, version)
            self._keep_or_free(role, model)
            return
        aloop = asyncio.get_running_loop()

        def finished(f: Future[SwapResult]) -> None:
            failed = f.cancelled() or f.exception() is not None
            if not failed:
                logger.warning("push of %s weights %s applied although its client left", role, version)
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nothing to keep
                aloop.call_soon_threadsafe(self._keep_or_free, role, model if failed else f.result().replaced)

        pending.add_done_callback(finished)

    def _swap_drafter(self, engine: LLMEngine, model: CausalLM, version: str) -> CausalLM:
        found = draft_model_of(engine)
        if found is None:
            raise PushUnsupported("the draft model went away")
        engine.swap_drafter(found[0], model, version)
        return found[1]

    async def _apply(self, role: str, version: str, model: CausalLM, mode: str, nbytes: int,
                     start: float) -> PushResult:
        if role == "target":
            pending = self.loop.swap_target(model, version, mode)
            try:
                swap: SwapResult = await asyncio.wrap_future(pending)
            except asyncio.CancelledError:
                self._abandoned(role, version, model, pending)
                raise
            self._keep_or_free(role, swap.replaced)
            return PushResult(role, version, nbytes, time.perf_counter() - start, swap.swap_seconds,
                              swap.wait_seconds, swap.aborted)
        t0 = time.perf_counter()
        replaced = await asyncio.wrap_future(self.loop.call(lambda e: self._swap_drafter(e, model, version)))
        swap_seconds = time.perf_counter() - t0
        self._keep_or_free(role, replaced)
        return PushResult(role, version, nbytes, time.perf_counter() - start, swap_seconds)

    async def _locked(self, role: str, start: float, work: Any) -> PushResult:
        lock = self._locks.setdefault(role, asyncio.Lock())
        try:
            async with lock:
                result: PushResult = await work
        except BaseException:
            if self.metrics is not None:
                self.metrics.weight_push(role, ok=False)
            raise
        if self.metrics is not None:
            self.metrics.weight_push(role, True, result.seconds, result.nbytes, result.swap_seconds)
        logger.info("%s weights %s applied: %d bytes in %.3f s (swap %.1f ms, waited %.2f s)", role,
                    result.version, result.nbytes, result.seconds, result.swap_seconds * 1e3, result.wait_seconds)
        return result

    # -- entry points -----------------------------------------------------------------------------------
    async def push_stream(self, manifest: Manifest, chunks: AsyncIterator[tuple[int, Any]]) -> PushResult:
        """A chunked push: `chunks` yields (offset, bytes) after the manifest."""
        start = time.perf_counter()
        manifest.mode = check_mode_or_error(manifest.mode)
        check_role_version(manifest.role, manifest.version)
        validate_manifest(manifest, self.role_config(manifest.role), self.max_push_bytes)
        return await self._locked(manifest.role, start, self._receive(manifest, chunks, start))

    async def _receive(self, manifest: Manifest, chunks: AsyncIterator[tuple[int, Any]], start: float) -> PushResult:
        receiver: ChunkReceiver[CausalLM] = ChunkReceiver(manifest, lambda ts: self._build(manifest.role, ts))
        try:
            async for offset, data in chunks:
                await receiver.afeed(offset, data)
        except BaseException:
            receiver.cancel()
            raise
        received = time.perf_counter()
        model = await asyncio.to_thread(receiver.finish)
        logger.debug("push %s: bytes received after %.3f s, weights built %.3f s later", manifest.version,
                     received - start, time.perf_counter() - received)
        return await self._apply(manifest.role, manifest.version, model, manifest.mode, manifest.total_bytes, start)

    async def push_tensors(self, role: str, version: str, tensors: dict[str, torch.Tensor], mode: str = "wait",
                           dtype: str | None = None) -> PushResult:
        """An upload of whole tensors (a safetensors body)."""
        start = time.perf_counter()
        check_role_version(role, version)
        mode = check_mode_or_error(mode)
        cfg = self.role_config(role)
        if not tensors:
            raise PushError("the upload holds no tensors")
        declared = dtype_name(dtype) if dtype else None
        for name, t in tensors.items():
            got = dtype_name(str(t.dtype))
            if declared is not None and got != declared:
                raise PushError(f"tensor {name!r} has dtype {got}, but the upload declares {declared}")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if nbytes > self.max_push_bytes:
            raise PushError(f"upload of {nbytes} bytes exceeds the server limit of {self.max_push_bytes} bytes")
        try:
            check_tensors(cfg, {n: tuple(t.shape) for n, t in tensors.items()})
        except WeightError as exc:
            raise PushError(f"{role} upload: {exc}") from exc

        async def work() -> PushResult:
            model = await asyncio.to_thread(self._build, role, tensors.items())
            return await self._apply(role, version, model, mode, nbytes, start)

        return await self._locked(role, start, work())

    async def load_path(self, role: str, version: str, path: str, mode: str = "wait") -> PushResult:
        """Load safetensors weights from a folder the server can read."""
        start = time.perf_counter()
        check_role_version(role, version)
        mode = check_mode_or_error(mode)
        folder = self._allowed(path)
        self.role_config(role)

        async def work() -> PushResult:
            model, nbytes = await asyncio.to_thread(self._read_folder, role, folder)
            return await self._apply(role, version, model, mode, nbytes, start)

        return await self._locked(role, start, work())

    def _allowed(self, path: str) -> Path:
        if not path:
            raise PushError("path is required")
        folder = Path(path).expanduser().resolve()
        if self.load_root is not None and not folder.is_relative_to(self.load_root):
            raise PermissionError(f"path {path!r} is outside the folder the server may load from")
        if not folder.is_dir():
            raise PushError(f"no such folder on the server: {path!r}")
        return folder

    def _read_folder(self, role: str, folder: Path) -> tuple[CausalLM, int]:
        from safetensors import safe_open

        try:
            files = safetensors_files(folder)
        except ConfigError as exc:
            raise PushError(str(exc)) from exc
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                    sl = sf.get_slice(name)
                    shapes[name] = tuple(sl.get_shape())
                    try:
                        dtype_name(sl.get_dtype())
                    except PushError as exc:
                        raise PushError(f"tensor {name!r} in {f.name}: {exc}") from exc
        try:
            check_tensors(self.role_config(role), shapes)
        except WeightError as exc:
            raise PushError(f"{role} folder {str(folder)!r}: {exc}") from exc
        return self._build(role, iter_safetensors(files)), sum(f.stat().st_size for f in files)
