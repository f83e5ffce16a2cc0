"""The engine thread's inbox: one message class per operation another thread asks of the engine, and the
engine as that thread drives it (`EngineCore`).

A caller builds the message (its arguments are checked there, once) and posts it; the engine thread takes the
messages between two steps, in order, and dispatches them by type (`EngineLoop`). A message that answers carries
its caller's future; a caller that cancels the future before the engine took the message withdraws it.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from service.backend.base import SwapResult, check_mode

if TYPE_CHECKING:
    import torch
    from torch import nn

    from service.backend.base import DrafterCopy, Staged, StatsSnapshot, TeacherSnapshot
    from service.backend.events import GenRequest, RequestHandle
    from service.drafter_spec import DrafterSpec
    from service.engine.scheduler import Scheduler
    from service.engine.stats import EngineStats
    from service.engine.types import Request, StepOutput
    from service.models.llama import CausalLM
    from service.params import SamplingParams


class ServesTarget(Protocol):
    model: CausalLM  # the target serving now


class EngineCore(Protocol):
    """What the engine thread (loop.py, holds.py, dispatch.py) and the weight stager (weights.py) call on the
    engine: `LLMEngine` is the one implementation. They depend on this contract, not on the engine's module."""

    scheduler: Scheduler
    runner: ServesTarget
    requests: dict[str, Request]
    stats: EngineStats
    policy_version: str
    last_strategy: str
    drafter_spec: DrafterSpec
    dtype: torch.dtype
    device: torch.device

    @property
    def drafter_version(self) -> str: ...
    @property
    def num_running(self) -> int: ...
    def enqueue(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                group_id: str | None = None) -> str: ...
    def abort(self, request_id: str) -> bool: ...
    def abort_all(self) -> list[str]: ...
    def step(self) -> list[StepOutput]: ...
    def finish_aborted(self) -> list[StepOutput]: ...
    def take_failures(self) -> dict[str, str]: ...
    def has_unfinished(self) -> bool: ...
    def take_compiled(self) -> None: ...
    def snapshot(self) -> StatsSnapshot: ...
    def drafter_weights(self) -> tuple[str, nn.Module] | None: ...
    def swap_target(self, model: CausalLM, version: str) -> None: ...
    def swap_drafter(self, module: nn.Module, version: str) -> None: ...
    def close(self) -> None: ...


class AppliesWeights(Protocol):
    """What holds.py calls on the weight stager (`WeightStager`, weights.py): serve staged weights now."""

    def apply(self, staged: Staged, version: str) -> None: ...


def settle(fut: Future[Any], result: Any = None, exc: BaseException | None = None) -> bool:
    """Hand a result to a caller's future unless the caller already gave up (cancelled it): the engine thread
    never fails because of a caller's state. Returns whether the caller got it."""
    if fut.done():
        return False
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:  # cancelled between the check and the set
        return False
    return True


@dataclass(slots=True)
class AddRequests:
    """Admitted requests (their tickets taken) for the scheduler's waiting queue."""

    items: list[tuple[GenRequest, RequestHandle]]


@dataclass(slots=True)
class Abort:
    request_id: str
    reason: str
    future: Future[bool] = field(default_factory=Future)


@dataclass(slots=True)
class AbortAll:
    reason: str
    future: Future[list[str]] = field(default_factory=Future)


@dataclass(slots=True)
class Pause:
    """Pause generation: "wait" once nothing runs, "abort" after aborting what runs, "keep" now."""

    mode: str
    future: Future[list[str]] = field(default_factory=Future)

    def __post_init__(self) -> None:
        self.mode = check_mode(self.mode)


@dataclass(slots=True)
class Resume:
    future: Future[None] = field(default_factory=Future)


@dataclass(slots=True)
class CommitWeights:
    """Serve staged weights as `version` between two steps. A target commit follows `mode`; a drafter commit
    never holds generation back (it changes how fast tokens come, not which), so its mode is "keep". A paired
    `drafter` (staged drafter weights and their version) swaps in the same pause as its target."""

    staged: Staged
    version: str
    mode: str
    drafter: tuple[Staged, str] | None = None
    future: Future[SwapResult] = field(default_factory=Future)

    def __post_init__(self) -> None:
        self.mode = check_mode(self.mode) if self.staged.role == "target" else "keep"


@dataclass(slots=True)
class LendTeacher:
    """For the in-process drafter trainer: the serving target model and its version, lent read-only."""

    future: Future[TeacherSnapshot] = field(default_factory=Future)


@dataclass(slots=True)
class CopyDrafter:
    """For the in-process drafter trainer: a copy of the serving drafter's weights (None: it has none)."""

    future: Future[DrafterCopy | None] = field(default_factory=Future)


@dataclass(slots=True)
class Shutdown:
    """The last message: abort what is in flight (every stream gets its final event), then stop."""


Message = AddRequests | Abort | AbortAll | Pause | Resume | CommitWeights | LendTeacher | CopyDrafter | Shutdown
