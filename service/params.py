"""Sampling parameters and what every layer says about a sample: plain Python, no torch."""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass


class SamplingError(ValueError):
    """Sampling parameters that cannot be honoured; the message names the field."""


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings.

    Logprob definition: `logprobs` returned for each token are log-probabilities under the distribution the
    token was actually drawn from, i.e. after the penalties, temperature, top-k, top-p and min-p (for
    temperature 0 the same processing with temperature 1). `raw_logprobs=True` also returns log_softmax of the
    unprocessed logits (no penalties either). `top_logprobs=k` returns the k most likely tokens of the processed
    distribution.

    Penalties (vLLM's and OpenAI's definitions, applied to the logits before the temperature): a token's logit
    loses `frequency_penalty` times its count in the output so far and `presence_penalty` once if it occurs
    there; with `repetition_penalty` r, a token that occurs in the prompt or the output has a positive logit
    divided by r and a negative one multiplied by r. The output so far is every token sampled before the
    position, so under speculative decoding a drafted position counts the drafts before it.
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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

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
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the logits (each at its neutral value changes nothing)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


MAX_INT32 = 2**31 - 1
_INTS = ("n", "top_k", "max_tokens", "top_logprobs")
_REALS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
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


@dataclass(frozen=True, slots=True)
class ModelBounds:
    """What the served model bounds a request by: its vocabulary, its context and the sequences it runs at once."""

    vocab_size: int
    max_model_len: int
    num_slots: int


def validate_request(prompt: Sequence[object], params: SamplingParams, bounds: ModelBounds, *,
                     cut_at_context: bool = False) -> list[int]:
    """The one check of a request against the model: every API (HTTP, gRPC) and the offline engine call it before
    anything is queued, so one request never fails the batch it runs in. Returns the prompt as ints; raises
    SamplingError naming what does not fit. The server refuses a prompt plus max_tokens over the context (a sample
    cut there is not a real max_tokens stop); the offline engine may cut instead (`cut_at_context`)."""
    if not prompt:
        raise SamplingError("the prompt is empty: it must contain at least one token")
    if not all(_is_int(t) for t in prompt):
        raise SamplingError("prompt token ids must be integers")
    ids = [int(t) for t in prompt]  # type: ignore[call-overload]
    vocab, context = bounds.vocab_size, bounds.max_model_len
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise SamplingError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
    if params.top_logprobs > vocab:
        raise SamplingError(f"top_logprobs={params.top_logprobs} exceeds the vocabulary size {vocab}")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise SamplingError(f"stop_token_ids out of range [0, {vocab}): {bad[:5]}")
    if params.n > bounds.num_slots:
        raise SamplingError(f"n={params.n} exceeds the {bounds.num_slots} sequences the cache holds")
    if len(ids) >= context:
        raise SamplingError(f"prompt has {len(ids)} tokens; max_model_len is {context}")
    if not cut_at_context and len(ids) + params.max_tokens > context:
        total = len(ids) + params.max_tokens
        raise SamplingError(
            f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) is {total}"
            f" tokens, more than max_model_len {context}: lower max_tokens to at most "
            f"{max(context - len(ids), 0)} or shorten the prompt")
    return ids


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class VersionSpan:
    """Output tokens [start, end) were produced by these weight versions."""

    policy_version: str
    drafter_version: str
    start: int
    end: int


def sample_seed(base: int, index: int) -> int:
    """Distinct, deterministic seeds for the n samples of one seeded request (the same on every backend)."""
    digest = hashlib.blake2b(f"{base}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
