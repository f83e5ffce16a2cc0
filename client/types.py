"""Results the client returns: plain dataclasses, no protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class VersionSpan:
    """Output tokens [start, end) were produced by these weight versions."""

    policy_version: str
    drafter_version: str
    start: int
    end: int


@dataclass(slots=True)
class TokenChunk:
    """New tokens of one sample, as streamed."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    policy_version: str
    drafter_version: str
    raw_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Sample:
    """One finished sample (rollout). Logprobs are those of the distribution each token was drawn from."""

    request_id: str
    index: int
    rollout_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version_spans: list[VersionSpan]
    num_prompt_tokens: int
    num_output_tokens: int
    raw_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    tokens_per_step: float = 0.0
    strategy: str = ""
    text: str = ""

    @property
    def policy_versions(self) -> list[str]:
        return sorted({s.policy_version for s in self.version_spans})


@dataclass(slots=True)
class Completion:
    """All samples of one prompt, in sample order."""

    request_id: str
    prompt_token_ids: list[int]
    samples: list[Sample]


@dataclass(slots=True)
class PushResult:
    role: str
    version: str
    bytes: int
    seconds: float
    swap_seconds: float
    wait_seconds: float
    aborted: list[str]

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclass(slots=True)
class ServerInfo:
    model: str
    model_path: str
    policy_version: str
    drafter_version: str
    num_running: int
    num_waiting: int
    paused: bool
    spec_strategy: str
    mean_accepted_length: float
    ready: bool
    vocab_size: int
    max_model_len: int
    dtype: str
    drafter: str
    eos_token_id: int
    max_waiting_seqs: int = 0  # admission bounds (0: none)
    max_pending_tokens: int = 0
    num_pending_tokens: int = 0
    backend: str = ""  # "native" | "vllm"
    capabilities: list[str] = field(default_factory=list)

    @classmethod
    def from_proto(cls, msg: Any) -> ServerInfo:
        values = {f: getattr(msg, f) for f in cls.__dataclass_fields__}
        values["capabilities"] = list(values["capabilities"])
        return cls(**values)
