"""Weight pushes on the vLLM backend: stage a pushed role's tensors as safetensors files (service/vllm/weights.py),
then load them into vLLM's workers inside a pause (`reload_weights`, or the worker extension's drafter reload),
drop the prefixes cached under the old weights and tag later tokens with the new versions.

A mixin of `VllmBackend` (service/vllm/backend.py), which owns the engine, its loop, pause and resume: these are
the `RolloutBackend` weight calls, kept apart from the request path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.backend.base import (
    PushError,
    PushUnsupported,
    SparseValues,
    Staged,
    SwapResult,
    WeightSpec,
    check_mode,
)
from service.config import EngineConfig
from service.drafter_spec import DrafterItem
from service.vllm.requests import Versions
from service.vllm.weights import WeightFiles, drafter_unsupported

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class WeightPushes:
    """The weight calls of `RolloutBackend`; they use VllmBackend's attributes below and its `info`, `_call`
    (run a coroutine on the engine's loop), `_pause` and `_resume`."""

    config: EngineConfig
    drafter: DrafterItem
    table: Any
    versions: Versions
    _roles: dict[str, WeightSpec]
    _files: WeightFiles
    _engine: Any
    _paused: bool

    def weight_roles(self) -> dict[str, WeightSpec]:
        self.info()
        return dict(self._roles)

    def unsupported(self, role: str) -> str:
        if role == "drafter" and role not in self._roles:
            if self.drafter.has_weights and not self.table:
                return "the server runs with speculation off (--spec off): its drafter is not loaded"
            return drafter_unsupported(self.drafter)
        return ""

    def stage_checked(self, role: str, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]], *,
                      delta: bool = False) -> Staged:
        """Runs after the one validation (`RolloutBackend.stage_weights`): nothing unchecked reaches a worker.
        Delta pushes are refused (no CAP_DELTA_PUSH): the workers hold the serving weights, this process has no
        copy of them to apply a delta to."""
        if role not in self._roles:
            raise PushUnsupported(self.unsupported(role) or f"no weights to push for role {role!r}")
        if delta:
            raise PushUnsupported("the vLLM backend takes full pushes only (no base_version)")
        folder, nbytes = self._files.stage(tensors, self.config.dtype)  # type: ignore[arg-type]
        return Staged(role, nbytes, folder)

    def commit_weights(self, staged: Staged, version: str, mode: str,
                       drafter: tuple[Staged, str] | None = None) -> Future[SwapResult]:
        """A target commit follows `mode`; a drafter commit freezes generation (keep) for the reload only."""
        mode = check_mode(mode) if staged.role == "target" else "keep"
        fut = self._call(self._commit(staged, version, mode, drafter))

        def cleanup(f: Future[SwapResult]) -> None:
            for s in (staged, drafter[0] if drafter else None):
                if s is not None:
                    self._files.release(s.payload)

        fut.add_done_callback(cleanup)
        return fut

    async def _commit(self, staged: Staged, version: str, mode: str,
                      drafter: tuple[Staged, str] | None) -> SwapResult:
        """Inside a pause: load the staged files into the serving model(s), drop cached prefixes computed by
        the old target weights, tag later tokens with the new versions, resume (unless an admin paused before).
        A paired drafter loads first: if it fails, the target is not touched (fail closed)."""
        loop = asyncio.get_running_loop()
        t_wait = loop.time()
        was_paused = self._paused
        aborted = [] if was_paused else await self._pause(mode)
        t0 = loop.time()
        try:
            draft = drafter or ((staged, version) if staged.role == "drafter" else None)
            if draft is not None:
                await self._reload_drafter(draft[0].payload)
            if staged.role == "target":
                await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": str(staged.payload)})
                # Every cached block's KV came from the old weights: none may serve a later prefix hit. vLLM can
                # drop the cache only with no block in use, so requests kept running (mode keep) are preempted:
                # their prompt and output so far are prefilled again by the new weights when generation resumes.
                await self._engine.reset_prefix_cache(reset_running_requests=True)
                self.versions.policy = str(version)
            if draft is not None:
                self.versions.drafter = f"{self.drafter.method}@{draft[1]}"
            await self._engine.update_weight_version(self.versions.publish())  # every later step carries it
        finally:
            if not was_paused:
                await self._resume()
        logger.info("now serving %s", f"policy {self.versions.policy}, drafter {self.versions.drafter}")
        if staged.role == "target" and drafter is None and "drafter" in self._roles:
            logger.warning("the %s drafter keeps its weights after target push %s: acceptance may drop until a "
                           "drafter push (or one paired with the target: mode %r) lands", self.drafter.method,
                           version, "with_target")
        return SwapResult(str(version), loop.time() - t0, t0 - t_wait, aborted)

    async def _reload_drafter(self, folder: Path) -> None:
        """Every worker loads the draft model's weights (`service/vllm/worker_ext.py`); they answer instead of
        raising, so a failure refuses the push and leaves the engine alive."""
        errors = [e for e in await self._engine.collective_rpc("specroll_reload_drafter", args=(str(folder),)) if e]
        if errors:
            raise PushError(f"drafter reload failed: {errors[0]}")

    def discard(self, staged: Staged) -> None:
        self._files.release(staged.payload)
