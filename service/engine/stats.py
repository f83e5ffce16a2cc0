"""Counters the engine keeps for the metrics endpoint and the adaptive strategy. No torch here."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StepRecord:
    kind: str  # prefill | decode | spec
    batch_size: int
    seconds: float
    strategy: str = "plain"
    k: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


@dataclass(slots=True)
class EngineStats:
    """Running totals since start plus a window of recent steps."""

    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=256))

    def record_step(self, kind: str, sched: Any, batch_size: int, seconds: float,
                    record: StepRecord | None = None) -> None:
        self.num_steps += 1
        if kind == "prefill":
            self.prompt_tokens += sum(len(r.prompt_token_ids) for r in sched.requests)
            self.generation_tokens += batch_size
        rec = record or StepRecord(kind, batch_size, seconds, emitted_tokens=batch_size)
        if kind != "prefill":
            self.generation_tokens += rec.emitted_tokens
        if rec.k:
            self.spec_drafts += rec.batch_size
            self.spec_draft_tokens += rec.drafted_tokens
            self.spec_accepted_tokens += rec.accepted_tokens
        self.recent.append(rec)

    def add_accepted_per_position(self, counts: list[int]) -> None:
        if len(self.accepted_per_position) < len(counts):
            self.accepted_per_position += [0] * (len(counts) - len(self.accepted_per_position))
        for i, c in enumerate(counts):
            self.accepted_per_position[i] += c

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per sequence per speculative step (1 + accepted drafts), over recent SD steps."""
        spec = [r for r in self.recent if r.k and r.batch_size]
        if not spec:
            return 0.0
        return sum(r.emitted_tokens for r in spec) / sum(r.batch_size for r in spec)
