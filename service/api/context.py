"""What both API layers share: the backend, weight pushes, metrics, auth, limits, and the calls they both offer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from service.api.auth import Auth
from service.api.generation import InvalidRequest, Limits, check_text_size, validate
from service.backend.base import BackendInfo, NotReady, RolloutBackend, check_mode
from service.params import ModelBounds

if TYPE_CHECKING:
    from service.api.push_service import PushService
    from service.backend.metrics import Metrics
    from service.params import SamplingParams
    from service.tokenizer import Tokenizer


def folder_names(drafter: str) -> str:
    """A --drafter setting with each folder cut to its name ("suffix,/models/q/draft" -> "suffix,draft",
    "eagle:/heads/e1" -> "eagle:e1"): only the admin sees where the server's files are."""
    items = []
    for item in drafter.split(","):
        method, sep, path = item.partition(":")
        if sep and "/" not in method:  # method:DIR
            items.append(f"{method}:{PurePath(path).name}" if path else item)
        else:
            items.append(PurePath(item).name if "/" in item else item)
    return ",".join(items)


@dataclass
class ServiceContext:
    backend: RolloutBackend
    pushes: PushService
    metrics: Metrics
    auth: Auth = field(default_factory=Auth)
    limits: Limits = field(default_factory=Limits)
    model_name: str = ""
    degraded_fn: Callable[[], list[str]] | None = None  # why the server serves degraded (e.g. the buffer's disk)

    def __post_init__(self) -> None:
        # Tokenizing runs here, never on the event loop: a long text would stall every client of that loop
        self._tokenize_pool = ThreadPoolExecutor(self.limits.tokenize_workers, thread_name_prefix="specroll-tokenize")

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.pushes.groups.close_all()  # ends the processes receiving weight groups' broadcasts

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

    def validate(self, prompt: Sequence[Any], params: SamplingParams) -> list[int]:
        """The request checked against the model's bounds before it is submitted (the one check: see
        `generation.validate`); returns the prompt's ids."""
        info = self.model()
        return validate(prompt, params, ModelBounds(info.vocab_size, info.max_model_len, info.num_slots))

    def tokenizer(self) -> Tokenizer | None:
        self.model()
        return self.backend.tokenizer

    def _text_tokenizer(self, texts: Sequence[str]) -> Tokenizer:
        tok = self.tokenizer()
        if tok is None:
            raise InvalidRequest("this model has no tokenizer: send token ids instead of text")
        max_model_len = self.model().max_model_len
        for text in texts:
            check_text_size(text, max_model_len, self.limits)
        return tok

    def encode(self, text: str) -> list[int]:
        """Token ids of one text, on the caller's thread (from the event loop, `await tokenize` instead)."""
        return self._text_tokenizer([text]).encode(text)

    async def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, computed on the tokenizer threads; each text's size is checked first."""
        tok = self._text_tokenizer(texts)
        if not texts:
            return []
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, tok.encode_batch, list(texts))

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
            "drafter": info.drafter if admin else folder_names(info.drafter),
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
