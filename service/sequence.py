"""Request and sequence state: plain Python objects shared by the scheduler, the runner and the API layers."""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field


class SamplingError(ValueError):
    """Sampling parameters that cannot be honoured; the message names the field."""


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings.

    Logprob definition: `logprobs` returned for each token are log-probabilities under the distribution the
    token was actually drawn from, i.e. after temperature, top-k, top-p and min-p (for temperature 0 the
    same processing with temperature 1). `raw_logprobs=True` also returns log_softmax of the unprocessed
    logits. `top_logprobs=k` returns the k most likely tokens of the processed distribution.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0
    raw_logprobs: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.top_k <= MAX_INT32, f"top_k must be in [0, 2^31) (0 or -1 disables), got {self.top_k}"),
            (self.n <= MAX_INT32, f"n must be < 2^31, got {self.n}"),
            (self.max_tokens <= MAX_INT32, f"max_tokens must be < 2^31, got {self.max_tokens}"),
            (self.top_logprobs <= MAX_INT32, f"top_logprobs must be < 2^31, got {self.top_logprobs}"),
            (all(0 <= t <= MAX_INT32 for t in self.stop_token_ids),
             f"stop_token_ids must be in [0, 2^31), got {list(self.stop_token_ids)[:5]}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.top_logprobs >= 0, f"top_logprobs must be >= 0, got {self.top_logprobs}"),
            (self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2^63), got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_INT32 = 2**31 - 1
_INTS = ("n", "top_k", "max_tokens", "top_logprobs")
_REALS = ("temperature", "top_p", "min_p")
_BOOLS = ("ignore_eos", "raw_logprobs")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_types(p: SamplingParams) -> None:
    """The one type check every API goes through: JSON and protobuf values of the wrong kind are refused, never
    silently truncated or cast (n=1.7, top_k=2.5, ignore_eos="yes", stop_token_ids=5)."""
    for name in _INTS:
        v = getattr(p, name)
        if not _is_int(v):
            raise SamplingError(f"{name} must be an integer, got {v!r}")
    for name in _REALS:
        v = getattr(p, name)
        if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
            raise SamplingError(f"{name} must be a finite number, got {v!r}")
        setattr(p, name, float(v))
    for name in _BOOLS:
        v = getattr(p, name)
        if not isinstance(v, bool):
            raise SamplingError(f"{name} must be true or false, got {v!r}")
    if p.seed is not None and not _is_int(p.seed):
        raise SamplingError(f"seed must be an integer, got {p.seed!r}")
    ids = p.stop_token_ids
    if isinstance(ids, str | bytes) or not isinstance(ids, list | tuple) or not all(_is_int(t) for t in ids):
        raise SamplingError(f"stop_token_ids must be a list of integers, got {ids!r}")


def check_fits(params: SamplingParams, prompt_len: int, vocab_size: int, max_model_len: int) -> None:
    """What the model itself bounds: top_logprobs by the vocabulary, prompt + max_tokens by the context."""
    if params.top_logprobs > vocab_size:
        raise SamplingError(f"top_logprobs={params.top_logprobs} exceeds the vocabulary size {vocab_size}")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise SamplingError(f"stop_token_ids out of range [0, {vocab_size}): {bad[:5]}")
    if prompt_len + params.max_tokens > max_model_len:
        total = prompt_len + params.max_tokens
        raise SamplingError(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) is {total}"
            f" tokens, more than max_model_len {max_model_len}: lower max_tokens to at most "
            f"{max(max_model_len - prompt_len, 0)} or shorten the prompt")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_seq_counter = itertools.count()


@dataclass(slots=True)
class VersionSpan:
    """Output tokens [start, end) were produced by these weight versions."""

    policy_version: str
    drafter_version: str
    start: int
    end: int


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample being generated. Its KV lives in cache slot `slot`; positions [0, num_cached) are valid."""

    request_id: str
    index: int  # sample index within the request (0..n-1)
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    group_id: str | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    version_spans: list[VersionSpan] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    slot: int = -1
    num_cached: int = 0  # tokens whose K/V are in the target cache
    draft_cached: int = 0  # tokens whose K/V are in a draft model's cache
    num_emitted: int = 0  # output tokens already handed out by step()
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, pos: int) -> int:
        n_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n_prompt else self.output_token_ids[pos - n_prompt]

    def tokens_from(self, start: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt :]
        return self.prompt_token_ids[start:] + self.output_token_ids

    def append_token(
        self, token: int, logprob: float, raw_logprob: float | None, top: dict[int, float] | None,
        eos_token_ids: tuple[int, ...], max_model_len: int,
    ) -> bool:
        """Record one generated token; returns True when the sequence finished with it."""
        self.output_token_ids.append(token)
        self.logprobs.append(logprob)
        if raw_logprob is not None:
            self.raw_logprobs.append(raw_logprob)
        if top is not None:
            self.top_logprobs.append(top)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
            self.finish(FinishReason.STOP)
        elif len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= max_model_len:
            self.finish(FinishReason.LENGTH)
        return self.is_finished

    def record_versions(self, policy_version: str, drafter_version: str) -> None:
        """Attribute the output tokens not yet covered by a span to the given weight versions."""
        end = len(self.output_token_ids)
        last = self.version_spans[-1] if self.version_spans else None
        if last is not None and (last.policy_version, last.drafter_version) == (policy_version, drafter_version):
            last.end = end
        elif last is None or last.end < end:
            self.version_spans.append(VersionSpan(policy_version, drafter_version, last.end if last else 0, end))

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.monotonic()


@dataclass(slots=True)
class Request:
    """A prompt with its n samples; the samples share the prompt's prefill."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    group_id: str | None = None

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    raw_logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    version_spans: list[VersionSpan] = field(default_factory=list)
    text: str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one sequence: the new tokens since the last step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None
    new_raw_logprobs: list[float] | None = None
    new_top_logprobs: list[dict[int, float]] | None = None
    policy_version: str = ""
    drafter_version: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


def completion_of(seq: Sequence) -> CompletionOutput:
    p = seq.params
    return CompletionOutput(
        index=seq.index,
        token_ids=list(seq.output_token_ids),
        logprobs=list(seq.logprobs),
        finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        raw_logprobs=list(seq.raw_logprobs) if p.raw_logprobs else None,
        top_logprobs=list(seq.top_logprobs) if p.top_logprobs else None,
        version_spans=[VersionSpan(v.policy_version, v.drafter_version, v.start, v.end) for v in seq.version_spans],
    )
