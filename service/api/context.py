"""What both API layers share: the backend, weight pushes, metrics, auth, limits, and the calls they both offer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.api.auth import Auth
from service.api.generation import InvalidRequest, Limits, check_request
from service.backend.base import BackendInfo, NotReady, RolloutBackend, check_mode

if TYPE_CHECKING:
    from service.api.push_service import PushService
    from service.backend.metrics import Metrics
    from service.params import SamplingParams
    from service.tokenizer import Tokenizer


@dataclass
class ServiceContext:
    backend: RolloutBackend
    pushes: PushService
    metrics: Metrics
    auth: Auth = field(default_factory=Auth)
    limits: Limits = field(default_factory=Limits)
    model_name: str = ""
    degraded_fn: Callable[[], list[str]] | None = None  # why the server serves degraded (e.g. the buffer's disk)

    @property
    def ready(self) -> bool:
        return self.backend.ready

    def degraded(self) -> list[str]:
        """Reasons the server runs degraded while it still serves (a full spool disk, Redis down)."""
        try:
            return self.degraded_fn() if self.degraded_fn is not None else []
        except Exception:
            return ["unknown"]

    def model(self) -> BackendInfo:
        """What the backend serves; raises NotReady (503 / UNAVAILABLE) until it is loaded."""
        if not self.backend.alive:
            raise NotReady(f"the engine has stopped: {self.backend.load_error or 'engine loop ended'}")
        return self.backend.info()

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """The model's own bounds on a request (vocabulary, context), checked before it is submitted."""
        info = self.model()
        check_request(prompt, params, info.vocab_size, info.max_model_len)

    def tokenizer(self) -> Tokenizer | None:
        self.model()
        return self.backend.tokenizer

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer()
        if tok is None:
            raise InvalidRequest("this model has no tokenizer: send token ids instead of text")
        return tok.encode(text)

    def name(self) -> str:
        return self.model_name or self.model().model_path.name

    def info(self, admin: bool = False) -> dict[str, Any]:
        """Server state. The model's absolute path only for the admin (a co-located sidecar reads the target
        from it); anyone else gets the folder's name."""
        info = self.model()
        stats = self.backend.stats()
        admission = self.backend.admission
        return {
            "model": self.name(),
            "model_path": str(info.model_path) if admin else info.model_path.name,
            "backend": info.backend,
            "capabilities": sorted(info.capabilities),
            "policy_version": stats.policy_version,
            "drafter_version": stats.drafter_version,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "paused": stats.paused,
            "spec_strategy": stats.strategy,
            "mean_accepted_length": stats.mean_accepted_length,
            "ready": self.ready,
            "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len,
            "dtype": info.dtype,
            "drafter": info.drafter,
            "eos_token_id": -1 if info.eos_token_id is None else info.eos_token_id,
            "max_waiting_seqs": admission.limits.max_waiting_seqs,
            "max_pending_tokens": admission.limits.max_pending_tokens,
            "num_pending_tokens": admission.tokens,
        }

    async def pause(self, mode: str) -> list[str]:
        try:
            mode = check_mode(mode)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        self.model()
        return await asyncio.wrap_future(self.backend.pause(mode))

    async def resume(self) -> None:
        self.model()
        await asyncio.wrap_future(self.backend.resume())

    async def abort(self, request_id: str | None, everything: bool = False) -> list[str]:
        self.model()
        if everything:
            return await asyncio.wrap_future(self.backend.abort_all("admin"))
        if not request_id:
            raise InvalidRequest("give a request id to abort, or all=true")
        ok = await asyncio.wrap_future(self.backend.abort(request_id, "client"))
        return [request_id] if ok else []

    def report_rewards(self, rewards: dict[str, Any]) -> int:
        clean: dict[str, float] = {}
        for rid, value in rewards.items():
            if not isinstance(rid, str) or not rid:
                raise InvalidRequest("reward keys must be non-empty rollout ids")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequest(f"reward for {rid!r} must be a number, got {value!r}")
            clean[rid] = float(value)
        return self.backend.hooks.report_rewards(clean)
