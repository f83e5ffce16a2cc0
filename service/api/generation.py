"""Request limits, sampling-parameter checks, and one generation request as the HTTP layers see it.

`Generation` adds what the engine does not do itself: text (incremental detokenization for streams) and
stop strings, which end a sample in the API layer (the text stops before the stop string; the tokens
include the one that completed it).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.backend.events import Chunk, Failed, GenRequest, RequestHandle, SampleDone
from service.params import SamplingError, SamplingParams, VersionSpan, check_fits

if TYPE_CHECKING:
    from service.backend.base import RolloutBackend
    from service.tokenizer import Tokenizer


class InvalidRequest(ValueError):
    """Bad input: 400 / INVALID_ARGUMENT with this message."""


class ServiceError(RuntimeError):
    """The server failed to run a valid request: 500 / INTERNAL."""


@dataclass(slots=True)
class Limits:
    max_tokens: int | None = None  # new tokens per sample (None: what max_model_len leaves after the prompt)
    max_n: int = 64
    max_prompts: int = 256  # prompts per HTTP request
    max_stop: int = 16
    max_request_bytes: int = 16 * 2**20  # JSON bodies
    max_upload_bytes: int = 64 * 2**30  # safetensors uploads
    max_message_bytes: int = 8 * 2**20  # gRPC messages (weight chunks are at most 4 MiB)
    stream_interval: int = 8  # gRPC streams send a sample's new tokens once this many are pending (or it ends)


def make_params(limits: Limits, **kw: Any) -> SamplingParams:
    """SamplingParams from API fields (None = default), within the server's limits. The one validation of
    sampling parameters for gRPC, OpenAI and SGLang: a wrong type or range is an InvalidRequest (400 /
    INVALID_ARGUMENT) naming the field."""
    kw = {k: v for k, v in kw.items() if v is not None}
    try:
        params = SamplingParams(**kw)
    except (SamplingError, TypeError) as exc:
        raise InvalidRequest(str(exc)) from exc
    if params.n > limits.max_n:
        raise InvalidRequest(f"n={params.n} exceeds the server limit of {limits.max_n}")
    if limits.max_tokens is not None and params.max_tokens > limits.max_tokens:
        raise InvalidRequest(f"max_tokens={params.max_tokens} exceeds the server limit of {limits.max_tokens}")
    return params


def make_stop(value: Any, limits: Limits) -> list[str]:
    """Stop strings: a string or a list of strings (None: none)."""
    if value is None:
        return []
    stop = [value] if isinstance(value, str) else value
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        raise InvalidRequest(f"stop must be a string or a list of strings, got {value!r}")
    if len(stop) > limits.max_stop:
        raise InvalidRequest(f"{len(stop)} stop strings exceed the server limit of {limits.max_stop}")
    return list(stop)


def check_request(prompt: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """Refuse at submission what the model cannot honour (top_logprobs over the vocabulary, a prompt plus
    max_tokens longer than the context): a sample cut at the context limit is not a real max_tokens stop."""
    try:
        check_fits(params, len(prompt), vocab_size, max_model_len)
    except SamplingError as exc:
        raise InvalidRequest(str(exc)) from exc


def check_prompt(ids: Sequence[Any], vocab_size: int) -> list[int]:
    if not ids:
        raise InvalidRequest("the prompt is empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequest("prompt token ids must be integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    return list(ids)


def start_all(gens: Sequence[Generation]) -> None:
    """Submit the generations of one API request together: all admitted, or none (Overloaded)."""
    if not gens:
        return
    items = [g._request() for g in gens]
    gens[0].backend.submit_all(items)
    for g, (_, handle) in zip(gens, items, strict=True):
        g._handle = handle


async def run_all(gens: Sequence[Generation]) -> list[list[Sample]]:
    """Admit and run the generations of one API request; if one fails, the others are aborted."""
    start_all(gens)
    tasks = [asyncio.ensure_future(g.run()) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a no-op for finished ones; cancelling a running one aborts its request


@dataclass(slots=True)
class Sample:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""  # text handed out so far
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    stop_text: str | None = None  # the text up to a matched stop string
    version_spans: list[VersionSpan] = field(default_factory=list)
    policy_version: str = ""
    rollout_id: str = ""
    num_prompt_tokens: int = 0


@dataclass(slots=True)
class Update:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    text: str
    finish_reason: str | None


class Generation:
    def __init__(self, backend: RolloutBackend, tokenizer: Tokenizer | None, prompt: list[int], params: SamplingParams,
                 request_id: str | None = None, group_id: str | None = None,
                 metadata: dict[str, str] | None = None, stop: Sequence[str] = (), text: bool = True,
                 whole: bool = False) -> None:
        if stop and tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        self.backend, self.tokenizer, self.prompt, self.params = backend, tokenizer, prompt, params
        self.request_id = request_id or uuid.uuid4().hex
        self.group_id, self.metadata = group_id, metadata or {}
        self.stop = [s for s in stop if s]
        self.want_text = text and tokenizer is not None
        # The caller wants the samples only once they end (not streamed): the engine sends no chunks, unless stop
        # strings, which end a sample here, need to see its tokens as they come
        self.stream = not whole or bool(self.stop)
        self.samples = [Sample(i, num_prompt_tokens=len(prompt)) for i in range(params.n)]
        self._handle: RequestHandle | None = None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def start(self) -> RequestHandle:
        """Submit the request (from the event loop's thread); `updates` does it when not done yet."""
        if self._handle is None:
            start_all([self])
        assert self._handle is not None
        return self._handle

    def _request(self) -> tuple[GenRequest, RequestHandle]:
        handle = RequestHandle(self.request_id, self.params.n, asyncio.get_running_loop())
        return GenRequest(self.prompt, self.params, self.request_id, self.group_id, self.metadata,
                          self.stream), handle

    async def updates(self) -> AsyncIterator[Update]:
        handle = self.start()
        try:
            async for ev in handle.events():
                if isinstance(ev, Failed):
                    raise InvalidRequest(ev.message) if ev.invalid else ServiceError(ev.message)
                s = self.samples[ev.index]
                if s.finish_reason is not None:
                    continue
                upd = self._chunk(s, ev) if isinstance(ev, Chunk) else self._done(s, ev)
                if upd is not None:
                    yield upd
                if all(x.finish_reason is not None for x in self.samples):
                    break
        finally:
            if not handle.finished:
                self._abort_rest()

    def _abort_rest(self) -> None:
        if any(x.finish_reason is None for x in self.samples):
            reason = "client"
        elif any(x.stop_text is not None for x in self.samples):
            reason = "stop_string"
        else:
            return
        with contextlib.suppress(RuntimeError):  # shutting down: the loop aborts everything itself
            self.backend.abort(self.request_id, reason)

    async def run(self) -> list[Sample]:
        async for _ in self.updates():
            pass
        return self.samples

    def _chunk(self, s: Sample, ev: Chunk) -> Update | None:
        s.policy_version = ev.policy_version
        start = len(s.token_ids)
        for j, tok in enumerate(ev.token_ids):
            s.token_ids.append(tok)
            s.logprobs.append(ev.logprobs[j])
            last = s.version_spans[-1] if s.version_spans else None
            if last is not None and (last.policy_version, last.drafter_version) == (ev.policy_version,
                                                                                    ev.drafter_version):
                last.end += 1
            else:
                s.version_spans.append(VersionSpan(ev.policy_version, ev.drafter_version, start + j, start + j + 1))
            if ev.top_logprobs is not None:
                s.top_logprobs.append(ev.top_logprobs[j])
            if self.stop and self._stopped(s):
                break
        return self._update(s, start)

    def _stopped(self, s: Sample) -> bool:
        full = self.decode(s.token_ids)
        window = max(0, len(s.text) - max(len(x) for x in self.stop))
        hits = [(pos, x) for x in self.stop if (pos := full.find(x, window)) >= 0]
        if not hits:
            return False
        pos, matched = min(hits)
        s.finish_reason, s.matched_stop, s.stop_text = "stop", matched, full[:pos]
        return True

    def _done(self, s: Sample, ev: SampleDone) -> Update:
        start = len(s.token_ids)
        s.token_ids, s.logprobs = list(ev.token_ids), list(ev.logprobs)
        s.top_logprobs = list(ev.top_logprobs or [])
        s.finish_reason, s.version_spans, s.rollout_id = ev.finish_reason, ev.version_spans, ev.rollout_id
        if ev.finish_reason == "stop" and ev.token_ids:
            s.matched_stop = ev.token_ids[-1]
        if ev.version_spans:
            s.policy_version = ev.version_spans[-1].policy_version
        return self._update(s, start)

    def _update(self, s: Sample, start: int) -> Update | None:
        delta = ""
        if self.want_text:
            if s.stop_text is not None:
                full = s.stop_text
            else:
                full = self.decode(s.token_ids)
                if s.finish_reason is None:
                    hold = max((len(x) for x in self.stop), default=1) - 1
                    full = full[: len(full) - hold] if hold else full
                    full = full.rstrip("\ufffd")
            if full.startswith(s.text):
                delta, s.text = full[len(s.text):], full
            elif s.finish_reason is not None:
                s.text = full
        s.rollout_id = s.rollout_id or f"{self.request_id}:{s.index}"
        if not delta and start == len(s.token_ids) and s.finish_reason is None:
            return None
        return Update(s.index, s.token_ids[start:], s.logprobs[start:], s.top_logprobs[start:], delta,
                      s.finish_reason)
