"""The engine's plain records, torch-free: requests and their sequences, what the scheduler hands the runner, what
a step produced and what it hands out. Every part of the engine shares them, so they sit under all of it."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import KW_ONLY, dataclass, field

from service.params import FinishReason, SamplingParams, VersionSpan


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


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

    def tokens_left(self, max_model_len: int) -> int:
        """Tokens this sequence may still emit: what its max_tokens leaves, within max_model_len."""
        return min(self.params.max_tokens - len(self.output_token_ids), max_model_len - self.num_tokens)

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

    def emit(self, policy_version: str, drafter_version: str) -> StepOutput:
        """The output since the last emit (what one engine step hands out for this sequence)."""
        start, self.num_emitted = self.num_emitted, len(self.output_token_ids)
        p = self.params
        return StepOutput(
            request_id=self.request_id, index=self.index,
            new_token_ids=self.output_token_ids[start:], new_logprobs=self.logprobs[start:],
            finished=self.is_finished, finish_reason=self.finish_reason.value if self.finish_reason else None,
            new_raw_logprobs=self.raw_logprobs[start:] if p.raw_logprobs else None,
            new_top_logprobs=self.top_logprobs[start:] if p.top_logprobs else None,
            policy_version=policy_version, drafter_version=drafter_version,
            num_prompt_tokens=len(self.prompt_token_ids), num_output_tokens=len(self.output_token_ids),
        )


@dataclass(slots=True)
class Request:
    """A prompt with its n samples; the samples share the prompt's prefill."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    group_id: str | None = None
    prompt_key: tuple[int, ...] = field(init=False)  # hashable prompt: requests repeating it share a prefill row

    def __post_init__(self) -> None:
        self.prompt_key = tuple(self.prompt_token_ids)

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


@dataclass(slots=True)
class SlotCopy:
    """Copy K/V positions [0, length) of cache slot `src` into slot `dst`."""

    src: int
    dst: int
    length: int


@dataclass(slots=True)
class SchedulerOutput:
    kind: str  # "prefill" | "decode" | "idle"
    # Prefill: the admitted requests; one row per distinct prompt, rows occupy slots [slot_lo, slot_lo +
    # len(prompts)); seqs are every admitted sample in slot order from slot_lo, row_of[i] the row of seqs[i].
    requests: list[Request] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    row_of: list[int] = field(default_factory=list)
    # Decode: running sequences in slot order, slots [0, len(seqs)).
    seqs: list[Sequence] = field(default_factory=list)
    # Compaction moves to apply, in order, before the forward pass.
    moves: list[SlotCopy] = field(default_factory=list)
    # After a prefill: copy each row's prompt K/V into the slots of the other samples with that prompt.
    forks: list[SlotCopy] = field(default_factory=list)
    slot_lo: int = 0


@dataclass(slots=True)
class TokenResult:
    """Host-side result of sampling one token for one sequence."""

    token: int
    logprob: float
    raw_logprob: float | None
    top: dict[int, float] | None


@dataclass(frozen=True, slots=True)
class Arm:
    drafter: str | None  # None = plain decoding
    k: int = 0
    # (lookahead drafter, n): rows it has n or more drafts for take its drafts (service/engine/strategy.py). The same
    # arm as without: it costs the same step.
    assist: tuple[str, int] | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        if self.drafter is None or self.k == 0:
            return "plain"
        return f"{self.drafter}:k={self.k}" + (f"+{self.assist[0]}" if self.assist else "")


PLAIN = Arm(None, 0)


@dataclass(slots=True)
class StepResult:
    """What one step produced, plain or speculative: per sequence (slot order) the tokens it emits (1..k+1),
    and for a speculative step the drafts proposed and accepted."""

    seqs: list[Sequence]
    tokens: list[list[TokenResult]]
    prev_num_tokens: list[int]  # each sequence's length before the step
    _: KW_ONLY  # the rest by name: several share a type, so a reorder cannot pass one for another
    k: int = 0  # draft depth (0: plain)
    num_accepted: list[int] = field(default_factory=list)
    num_drafted: list[int] = field(default_factory=list)
    assisted: list[bool] = field(default_factory=list)  # rows whose drafts came from the assisting drafter
    draft_seconds: float = 0.0
    caught_up: tuple[int, float] = (0, 0.0)  # tokens the drafter fed to catch up before drafting, their seconds
    captured: bool = False  # the step captured a CUDA graph or compiled a forward: its time measures nothing
    arm: Arm = PLAIN  # the arm that ran: the chosen one, or plain when its drafter proposed nothing for any row

    @classmethod
    def plain(cls, seqs: list[Sequence], results: list[TokenResult]) -> StepResult:
        return cls(seqs, [[r] for r in results], [s.num_tokens for s in seqs])

    def num_emitted(self) -> int:
        """Tokens the step's sequences gained (after postprocessing: stops cut a row's tokens short)."""
        return sum(s.num_tokens - t for s, t in zip(self.seqs, self.prev_num_tokens, strict=True))
