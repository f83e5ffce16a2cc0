"""The engine thread's inbox: one message class per operation another thread asks of the engine.

A caller builds the message (its arguments are checked there, once) and posts it; the engine thread takes the
messages between two steps, in order, and dispatches them by type (`EngineLoop`). A message that answers carries
its caller's future; a caller that cancels the future before the engine took the message withdraws it.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.backend.base import SwapResult, check_mode

if TYPE_CHECKING:
    from service.backend.base import DrafterCopy, Staged, TeacherSnapshot
    from service.backend.events import GenRequest, RequestHandle


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
