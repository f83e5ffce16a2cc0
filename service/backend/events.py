"""What flows between the engine loop and the API layers: requests in, events and rollout records out."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from service.params import SamplingParams, VersionSpan


@dataclass(slots=True)
class GenRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    group_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    # False: the consumer wants each sample whole when it ends (its SampleDone), so the engine sends no Chunk
    # events for it; a consumer that streams nothing is spared an event every step for every sample.
    stream: bool = True


@dataclass(slots=True)
class Chunk:
    """New tokens of sample `index` from one engine step, with the weight versions that produced them."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    raw_logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    policy_version: str
    drafter_version: str


@dataclass(slots=True)
class SampleDone:
    """Sample `index` finished; carries the whole rollout so non-streaming callers need nothing else."""

    index: int
    rollout_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    version_spans: list[VersionSpan]
    num_steps: int
    strategy: str
    token_ids: list[int]
    logprobs: list[float]
    raw_logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None

    @property
    def tokens_per_step(self) -> float:
        return self.num_output_tokens / self.num_steps if self.num_steps else 0.0


@dataclass(slots=True)
class Failed:
    """The request could not run; `invalid` means the caller's input was wrong."""

    message: str
    invalid: bool = False


Event = Chunk | SampleDone | Failed


@dataclass(slots=True)
class RolloutRecord:
    """One finished sample, as handed to on_rollout_finished callbacks (the rollout buffer)."""

    rollout_id: str
    request_id: str
    index: int
    group_id: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[float]
    version_spans: list[VersionSpan]
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    metadata: dict[str, str]
    policy_version: str
    drafter_version: str
    created_at: float
    finished_at: float = field(default_factory=time.time)
    raw_logprobs: list[float] | None = None
    params: SamplingParams | None = None  # how the sample was drawn (the distillation target's processing)
    top_logprobs: list[dict[int, float]] | None = None

    @property
    def never_started(self) -> bool:
        """Aborted before its first token (queued when a shutdown, pause or client ended it): nothing to train
        on, so it is not a rollout; its client still gets the final message."""
        return self.finish_reason == "abort" and not self.output_token_ids


def whole_chunks(done: SampleDone) -> list[Chunk]:
    """A finished sample's tokens as the chunks a stream would have merged into: one per run of tokens that the
    same weight versions produced (its version spans), in order. For consumers that asked for no chunks."""
    n = len(done.token_ids)
    spans = done.version_spans or ([VersionSpan("", "", 0, n)] if n else [])
    return [Chunk(done.index, done.token_ids[s.start:s.end], done.logprobs[s.start:s.end],
                  None if done.raw_logprobs is None else done.raw_logprobs[s.start:s.end],
                  None if done.top_logprobs is None else done.top_logprobs[s.start:s.end],
                  s.policy_version, s.drafter_version) for s in spans]


def coalesce(events: list[Event]) -> list[Event]:
    """Merge each sample's consecutive chunks produced by the same weight versions; a sample's chunks stay
    before its SampleDone, in order."""
    out: list[Event] = []
    open_chunk: dict[int, int] = {}  # sample index -> position in `out` of its chunk still open for merging
    for ev in events:
        if isinstance(ev, Chunk):
            at = open_chunk.get(ev.index)
            last = out[at] if at is not None else None
            if isinstance(last, Chunk) and (last.policy_version, last.drafter_version) == (
                    ev.policy_version, ev.drafter_version) and (last.raw_logprobs is None) == (
                    ev.raw_logprobs is None) and (last.top_logprobs is None) == (ev.top_logprobs is None):
                out[at] = Chunk(ev.index, last.token_ids + ev.token_ids, last.logprobs + ev.logprobs,
                                None if last.raw_logprobs is None else last.raw_logprobs + (ev.raw_logprobs or []),
                                None if last.top_logprobs is None else last.top_logprobs + (ev.top_logprobs or []),
                                ev.policy_version, ev.drafter_version)
                continue
            open_chunk[ev.index] = len(out)
        elif isinstance(ev, SampleDone):
            open_chunk.pop(ev.index, None)
        else:
            open_chunk.clear()
        out.append(ev)
    return out


class RequestHandle:
    """Events of one request, pushed by the engine thread and read by one consumer on its event loop."""

    def __init__(self, request_id: str, n: int, aloop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.n = n
        self.arrival = time.monotonic()
        self.created_at = time.time()
        self._aloop = aloop
        self._aq: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.finished = False
        self.ticket: Any = None  # its admission ticket (service.backend.admission.Ticket)

    def release(self) -> None:
        """Give the request's share of the admission bounds back (engine thread; idempotent)."""
        if self.ticket is not None:
            self.ticket.release()

    def put_many(self, events: list[Event]) -> None:
        """Called from the engine thread."""
        # RuntimeError: the consumer's event loop is closed, nobody listens any more
        with contextlib.suppress(RuntimeError):
            self._aloop.call_soon_threadsafe(self._aq.put_nowait, events)

    def _done(self, ev: Event, remaining: int) -> int:
        if isinstance(ev, SampleDone):
            remaining -= 1
        return 0 if isinstance(ev, Failed) else remaining

    async def events(self, stream_interval: int = 1) -> AsyncIterator[Event]:
        """The request's events. Chunks that queued up while the consumer was busy are merged per sample, and
        with `stream_interval` > 1 held back until a sample has that many new tokens or something else (a
        finish, a failure) must go out: fewer, larger messages."""
        remaining = self.n
        pending: list[Event] = []
        while remaining > 0:
            pending.extend(await self._aq.get())
            while not self._aq.empty():
                pending.extend(self._aq.get_nowait())
            if len(pending) > 1:
                pending = coalesce(pending)
            if stream_interval > 1 and all(isinstance(e, Chunk) and len(e.token_ids) < stream_interval
                                           for e in pending):
                continue
            out, pending = pending, []
            for ev in out:
                remaining = self._done(ev, remaining)
                yield ev
        self.finished = True


def _put_all(puts: list[tuple[asyncio.Queue[list[Event]], list[Event]]]) -> None:
    for q, events in puts:
        q.put_nowait(events)


def deliver(items: list[tuple[RequestHandle, list[Event]]]) -> None:
    """Hand one step's events to their consumers (engine thread), waking each event loop once rather than once
    per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[list[Event]], list[Event]]]] = {}
    for handle, events in items:
        by_loop.setdefault(handle._aloop, []).append((handle._aq, events))
    for aloop, puts in by_loop.items():
        # RuntimeError: the consumers' event loop is closed, nobody listens any more
        with contextlib.suppress(RuntimeError):
            aloop.call_soon_threadsafe(_put_all, puts)
