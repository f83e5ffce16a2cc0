"""Turns engine step outputs into per-request events, metrics and finished-rollout records (engine thread)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.backend.events import Chunk, Failed, RequestHandle, RolloutRecord, SampleDone, deliver
from service.backend.hooks import Hooks
from service.engine.types import Request, StepOutput
from service.params import VersionSpan

if TYPE_CHECKING:
    from service.backend.metrics import Metrics
    from service.engine.inbox import EngineCore


@dataclass(slots=True)
class Tracked:
    handle: RequestHandle
    request: Request
    metadata: dict[str, str]
    steps: list[int]
    last_token_time: list[float]
    remaining: int
    stream: bool  # False: no Chunk events, each sample goes out whole in its SampleDone


class Dispatcher:
    def __init__(self, metrics: Metrics | None, hooks: Hooks) -> None:
        self.metrics = metrics
        self.hooks = hooks
        self.tracked: dict[str, Tracked] = {}

    def track(self, handle: RequestHandle, request: Request, metadata: dict[str, str], stream: bool = True) -> None:
        n = len(request.seqs)
        self.tracked[request.request_id] = Tracked(handle, request, metadata, [0] * n, [0.0] * n, n, stream)

    def fail(self, request_id: str, message: str) -> None:
        """One request failed on its own: its consumer gets the error; nobody else is touched."""
        tr = self.tracked.pop(request_id, None)
        if tr is not None:
            tr.handle.put_many([Failed(message)])

    def fail_all(self, message: str) -> None:
        for tr in self.tracked.values():
            tr.handle.release()
            tr.handle.put_many([Failed(message)])
        self.tracked.clear()

    def dispatch(self, engine: EngineCore, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        batches: dict[str, list[Any]] = {}
        finished: list[tuple[RolloutRecord, RequestHandle, SampleDone]] = []
        for out in outputs:
            tr = self.tracked.get(out.request_id)
            if tr is None:
                continue
            events = batches.setdefault(out.request_id, [])
            i = out.index
            if out.new_token_ids:
                tr.steps[i] += 1
                if tr.stream:
                    events.append(Chunk(i, list(out.new_token_ids), list(out.new_logprobs), out.new_raw_logprobs,
                                        out.new_top_logprobs, out.policy_version, out.drafter_version))
                if self.metrics is not None:
                    last = tr.last_token_time[i]
                    self.metrics.observe_tokens(None if last else now - tr.handle.arrival,
                                                now - last if last else 0.0, len(out.new_token_ids))
                tr.last_token_time[i] = now
            if out.finished:
                record, done = self._finish(engine, tr, i, out, now)
                if self.hooks.takes_rollouts and not record.never_started:
                    finished.append((record, tr.handle, done))
                else:
                    events.append(done)
        deliveries = []
        for rid, events in batches.items():
            tr = self.tracked[rid]
            if events:
                deliveries.append((tr.handle, events))
            if tr.remaining == 0:
                tr.handle.release()
                del self.tracked[rid]
        deliver(deliveries)
        # A sample's final event goes out once the rollout store holds it durably (after its chunks: the
        # hand-off is queued behind the deliveries above).
        for record, handle, done in finished:
            self.hooks.rollout_finished(record, _sender(handle, done))

    def _finish(self, engine: EngineCore, tr: Tracked, i: int, out: StepOutput,
                now: float) -> tuple[RolloutRecord, SampleDone]:
        seq = tr.request.seqs[i]
        tr.remaining -= 1
        spans = [VersionSpan(s.policy_version, s.drafter_version, s.start, s.end) for s in seq.version_spans]
        reason = out.finish_reason or "abort"
        rollout_id = f"{tr.request.request_id}:{i}"
        raw = list(seq.raw_logprobs) if seq.params.raw_logprobs else None
        if self.metrics is not None:
            self.metrics.observe_finished(now - tr.handle.arrival, reason)
        record = RolloutRecord(
            rollout_id=rollout_id, request_id=tr.request.request_id, index=i, group_id=tr.request.group_id,
            prompt_token_ids=list(tr.request.prompt_token_ids), output_token_ids=list(seq.output_token_ids),
            logprobs=list(seq.logprobs), version_spans=spans, finish_reason=reason,
            num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
            metadata=dict(tr.metadata), policy_version=engine.policy_version,
            drafter_version=engine.drafter_version, created_at=tr.handle.created_at, raw_logprobs=raw,
            params=seq.params, top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs else None,
        )
        return record, SampleDone(
            index=i, rollout_id=rollout_id, finish_reason=reason, num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens, version_spans=spans, num_steps=tr.steps[i],
            strategy=engine.last_strategy, token_ids=list(seq.output_token_ids),
            logprobs=list(seq.logprobs), raw_logprobs=raw,
            top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs else None,
        )


def _sender(handle: RequestHandle, done: SampleDone) -> Callable[[], None]:
    return lambda: deliver([(handle, [done])])
