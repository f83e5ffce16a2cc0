"""One request on the vLLM engine: its n samples as n vLLM requests, streamed into specroll's events.

Each sample's deltas become `Chunk`s tagged with the weight versions serving when they arrived; its end becomes
a `SampleDone` and a `RolloutRecord` for the buffer, exactly as the native engine's dispatcher does (the final
event goes out once the rollout store holds the record).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.backend.events import Chunk, Failed, GenRequest, RequestHandle, RolloutRecord, SampleDone, deliver
from service.backend.hooks import Hooks
from service.backend.metrics import Metrics
from service.params import VersionSpan
from service.vllm.sampling import to_vllm


@dataclass(slots=True)
class Sample:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    spans: list[VersionSpan] = field(default_factory=list)
    steps: int = 0
    running: bool = False  # produced a token and is not finished (counts as running)

    def add(self, tokens: list[int], lps: list[float], tops: list[dict[int, float]] | None, policy: str,
            drafter: str) -> None:
        start = len(self.token_ids)
        self.token_ids += tokens
        self.logprobs += lps
        if tops is not None:
            self.top_logprobs += tops
        last = self.spans[-1] if self.spans else None
        if last is not None and (last.policy_version, last.drafter_version) == (policy, drafter):
            last.end = len(self.token_ids)
        else:
            self.spans.append(VersionSpan(policy, drafter, start, len(self.token_ids)))
        self.steps += 1


def sample_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


class Outbox:
    """Events of all requests gathered over one pass of the driver loop and handed over in one go: one wake-up of
    each consumer event loop per engine step (as the native dispatcher does), not one per sample."""

    def __init__(self) -> None:
        self._items: list[tuple[RequestHandle, list[Any]]] = []

    def put(self, handle: RequestHandle, events: list[Any]) -> None:
        if not self._items:
            asyncio.get_running_loop().call_soon(self.flush)
        self._items.append((handle, events))

    def flush(self) -> None:
        items, self._items = self._items, []
        deliver(items)


class Versions:
    """The weight versions serving now, and the label vLLM puts on every engine step under them.

    A token's versions come from that label, not from what serves when its output reaches us: outputs vLLM made
    before a push's pause can arrive after the push committed (hundreds of rows put a backlog in front of the
    driver loop), and were tagged with the new versions. `publish` runs inside the push's pause: vLLM labels
    every later step with it (`AsyncLLM.update_weight_version`), and the output processor keeps each request's
    labels per output token."""

    def __init__(self, policy: str, drafter: str) -> None:
        self.policy, self.drafter = policy, drafter
        self._pairs = {"default": (policy, drafter)}  # "default": vLLM's label before any update_weight_version

    def publish(self) -> str:
        """A new label for the versions serving now (after a commit set them)."""
        label = f"specroll-{len(self._pairs)}"
        self._pairs[label] = (self.policy, self.drafter)
        return label

    def of(self, label: str | None) -> tuple[str, str]:
        return self._pairs.get(label or "", (self.policy, self.drafter))


def token_labels(starts: list[tuple[str, int]], first: int, count: int) -> list[str | None]:
    """Labels of output tokens first .. first + count - 1, from (label, first token index) starts in order."""
    out: list[str | None] = []
    j = 0
    for i in range(first, first + count):
        while j + 1 < len(starts) and starts[j + 1][1] <= i:
            j += 1
        out.append(starts[j][0])
    return out


class RequestRun:
    """Drives the samples of one request on the driver's event loop."""

    def __init__(self, req: GenRequest, handle: RequestHandle, engine: Any, vllm: Any, versions: Versions,
                 hooks: Hooks, metrics: Metrics | None, strategy: Callable[[], str],
                 on_done: Callable[[RequestRun], None], outbox: Outbox, share: int) -> None:
        self.req, self.handle, self.engine, self.vllm, self.outbox = req, handle, engine, vllm, outbox
        self.share = share  # the most samples of this request in vLLM at once (`request_share`)
        self.aborted = False  # samples not started yet end as aborted instead of starting
        self.versions, self.hooks, self.metrics, self.strategy = versions, hooks, metrics, strategy
        self.on_done = on_done
        self.samples = [Sample(i) for i in range(req.params.n)]
        self.finished = 0
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def sample_ids(self) -> list[str]:
        return [sample_id(self.req.request_id, i) for i in range(self.req.params.n)]

    def running_sample_ids(self) -> list[str]:
        return [sample_id(self.req.request_id, s.index) for s in self.samples if s.running]

    def num_running(self) -> int:
        return sum(1 for s in self.samples if s.running)

    def start(self) -> None:
        gate = asyncio.Semaphore(self.share)  # vLLM admits each sample as its own request: cap them here
        self.tasks = [asyncio.ensure_future(self._gated(s, gate)) for s in self.samples]

    async def _gated(self, s: Sample, gate: asyncio.Semaphore) -> None:
        try:
            await gate.acquire()
        except asyncio.CancelledError:
            self._finish(s, "abort")
            return
        try:
            if self.aborted:
                self._finish(s, "abort")
            else:
                await self._run(s)
        finally:
            gate.release()

    async def _run(self, s: Sample) -> None:
        prompt = {"prompt_token_ids": list(self.req.prompt_token_ids)}
        params = to_vllm(self.req.params, s.index, self.vllm)
        reason = "abort"
        last_time = 0.0
        try:
            sid = sample_id(self.req.request_id, s.index)
            async for out in self.engine.generate(prompt, params, request_id=sid):
                c = out.outputs[0]
                if c.token_ids:
                    self._chunk(s, list(c.token_ids), c.logprobs, self._labels(sid, c, len(s.token_ids),
                                                                               len(c.token_ids)))
                    now = time.monotonic()
                    if self.metrics is not None:
                        self.metrics.observe_tokens(None if not last_time else now - self.handle.arrival,
                                                    now - last_time if last_time else 0.0, len(c.token_ids))
                    last_time = now
                if c.finish_reason is not None:
                    reason = "abort" if c.finish_reason == "abort" else c.finish_reason
                    if reason not in ("stop", "length", "abort"):
                        reason = "stop"
        except asyncio.CancelledError:
            reason = "abort"
        except Exception as exc:  # this request only: its consumer gets the error
            logging.getLogger(__name__).exception("sample %s failed", sample_id(self.req.request_id, s.index))
            self.outbox.put(self.handle, [Failed(f"engine error: {exc}")])
            reason = "abort"
        self._finish(s, reason)

    def _labels(self, sid: str, c: Any, first: int, count: int) -> list[str | None]:
        """vLLM's weight-version label of each new token: the final output carries its spans; before that, the
        output processor's state of the request holds where each label started (it has processed exactly the
        tokens handed to us so far). None where vLLM has none."""
        spans = getattr(c, "weight_versions", None)
        if spans:
            starts = [(span.version, span.start) for span in spans]
        else:
            processor = getattr(self.engine, "output_processor", None)
            internal = (getattr(processor, "external_req_ids", None) or {}).get(sid) or [sid]  # vLLM adds a suffix
            state = (getattr(processor, "request_states", None) or {}).get(internal[-1])
            starts = list(getattr(state, "weight_version_starts", None) or [])
        return token_labels(starts, first, count) if starts else [None] * count

    def _chunk(self, s: Sample, tokens: list[int], logprobs: Any, labels: list[str | None]) -> None:
        """One event per run of tokens with the same versions (a chunk across a push is split)."""
        lo = 0
        for i in range(1, len(tokens) + 1):
            if i == len(tokens) or labels[i] != labels[lo]:
                self._piece(s, tokens[lo:i], logprobs, lo, labels[lo])
                lo = i

    def _piece(self, s: Sample, tokens: list[int], logprobs: Any, offset: int, label: str | None) -> None:
        lps: list[float] = []
        tops: list[dict[int, float]] | None = [] if self.req.params.top_logprobs else None
        for j, tok in enumerate(tokens):
            entry = logprobs[offset + j] if logprobs is not None and offset + j < len(logprobs) else {}
            lps.append(float(entry[tok].logprob) if tok in entry else float("nan"))
            if tops is not None:
                k = self.req.params.top_logprobs
                ranked = sorted(((v.rank, t, v.logprob) for t, v in entry.items() if v.rank is not None))
                tops.append({t: float(lp) for _, t, lp in ranked[:k]})
        policy, drafter = self.versions.of(label)
        s.add(tokens, lps, tops, policy, drafter)
        s.running = True
        if self.req.stream:  # otherwise the sample goes out whole in its SampleDone
            self.outbox.put(self.handle, [Chunk(s.index, tokens, lps, None, tops, policy, drafter)])

    def _finish(self, s: Sample, reason: str) -> None:
        s.running = False
        self.finished += 1
        rid = self.req.request_id
        rollout_id = f"{rid}:{s.index}"
        n_prompt, n_out = len(self.req.prompt_token_ids), len(s.token_ids)
        tops = list(s.top_logprobs) if self.req.params.top_logprobs else None
        last = ((s.spans[-1].policy_version, s.spans[-1].drafter_version) if s.spans
                else (self.versions.policy, self.versions.drafter))
        if self.metrics is not None:
            self.metrics.observe_finished(time.monotonic() - self.handle.arrival, reason)
        record = RolloutRecord(
            rollout_id=rollout_id, request_id=rid, index=s.index, group_id=self.req.group_id,
            prompt_token_ids=list(self.req.prompt_token_ids), output_token_ids=list(s.token_ids),
            logprobs=list(s.logprobs), version_spans=list(s.spans), finish_reason=reason, num_prompt_tokens=n_prompt,
            num_output_tokens=n_out, metadata=dict(self.req.metadata), policy_version=last[0],
            drafter_version=last[1], created_at=self.handle.created_at, params=self.req.params,
            top_logprobs=tops)
        done = SampleDone(index=s.index, rollout_id=rollout_id, finish_reason=reason, num_prompt_tokens=n_prompt,
                          num_output_tokens=n_out, version_spans=list(s.spans), num_steps=s.steps,
                          strategy=self.strategy(), token_ids=list(s.token_ids), logprobs=list(s.logprobs),
                          top_logprobs=tops)
        if self.finished == len(self.samples):
            self.handle.release()
            self.on_done(self)
        if self.hooks.takes_rollouts and not record.never_started:  # after the sample's chunks: the outbox
            self.outbox.flush()  # flushes before the hooks thread runs
            self.hooks.rollout_finished(record, lambda: deliver([(self.handle, [done])]))
        else:
            self.outbox.put(self.handle, [done])
