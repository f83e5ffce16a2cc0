"""What both API layers share: the loop, weights, metrics, auth, limits, and the calls they both offer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.api.auth import Auth
from service.api.generation import InvalidRequest, Limits, check_request
from service.api.push_service import WeightManager
from service.backend.hooks import Hooks
from service.backend.metrics import Metrics
from service.engine.loop import EngineLoop, NotReady, check_mode

if TYPE_CHECKING:
    from service.engine.llm_engine import LLMEngine
    from service.params import SamplingParams
    from service.tokenizer import Tokenizer


@dataclass
class ServiceContext:
    loop: EngineLoop
    weights: WeightManager
    metrics: Metrics
    hooks: Hooks
    auth: Auth = field(default_factory=Auth)
    limits: Limits = field(default_factory=Limits)
    model_name: str = ""

    @property
    def ready(self) -> bool:
        return self.loop.ready.is_set() and self.loop.alive

    def engine(self) -> LLMEngine:
        """The engine, for reading state; raises NotReady (503 / UNAVAILABLE) until it is loaded."""
        if not self.loop.alive and self.loop.ready.is_set():
            raise NotReady("the engine loop has stopped")
        return self.loop.engine

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """The model's own bounds on a request (vocabulary, context), checked before it is submitted."""
        engine = self.engine()
        check_request(prompt, params, engine.model_config.vocab_size, engine.config.max_model_len)

    def tokenizer(self) -> Tokenizer | None:
        return self.engine().tokenizer

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer()
        if tok is None:
            raise InvalidRequest("this model has no tokenizer: send token ids instead of text")
        return tok.encode(text)

    def name(self) -> str:
        return self.model_name or self.engine().model_path.name

    def info(self, admin: bool = False) -> dict[str, Any]:
        """Server state. The model's absolute path only for the admin (a co-located sidecar reads the target
        from it); anyone else gets the folder's name."""
        engine = self.engine()
        tok = engine.tokenizer
        return {
            "model": self.name(),
            "model_path": str(engine.model_path) if admin else engine.model_path.name,
            "policy_version": str(engine.policy_version),
            "drafter_version": str(engine.drafter_version),
            "num_running": engine.num_running,
            "num_waiting": engine.num_waiting,
            "paused": bool(engine.paused),
            "spec_strategy": str(getattr(engine, "spec_strategy", "plain")),
            "mean_accepted_length": float(_safe(lambda: engine.stats.mean_accepted_length)),
            "ready": self.ready,
            "vocab_size": engine.model_config.vocab_size,
            "max_model_len": engine.config.max_model_len,
            "dtype": engine.config.dtype,
            "drafter": str(getattr(engine.config, "drafter", "none")),
            "eos_token_id": -1 if tok is None or tok.eos_token_id is None else tok.eos_token_id,
            "max_waiting_seqs": self.loop.admission.limits.max_waiting_seqs,
            "max_pending_tokens": self.loop.admission.limits.max_pending_tokens,
            "num_pending_tokens": self.loop.admission.tokens,
        }

    async def pause(self, mode: str) -> list[str]:
        try:
            mode = check_mode(mode)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        self.engine()
        return await asyncio.wrap_future(self.loop.pause(mode))

    async def resume(self) -> None:
        self.engine()
        await asyncio.wrap_future(self.loop.resume())

    async def abort(self, request_id: str | None, everything: bool = False) -> list[str]:
        self.engine()
        if everything:
            return await asyncio.wrap_future(self.loop.abort_all("admin"))
        if not request_id:
            raise InvalidRequest("give a request id to abort, or all=true")
        ok = await asyncio.wrap_future(self.loop.abort(request_id, "client"))
        return [request_id] if ok else []

    def report_rewards(self, rewards: dict[str, Any]) -> int:
        clean: dict[str, float] = {}
        for rid, value in rewards.items():
            if not isinstance(rid, str) or not rid:
                raise InvalidRequest("reward keys must be non-empty rollout ids")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequest(f"reward for {rid!r} must be a number, got {value!r}")
            clean[rid] = float(value)
        return self.hooks.report_rewards(clean)


def _safe(fn: Any) -> float:
    for _ in range(5):
        try:
            return float(fn())
        except RuntimeError:  # a deque the engine thread appends to
            continue
    return 0.0
