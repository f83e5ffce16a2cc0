"""Admission control: a bounded queue of work, refused cleanly (503 / RESOURCE_EXHAUSTED + Retry-After) beyond it.

Every request is admitted (or refused) when it is submitted, on the caller's thread, under one lock, so
concurrent submissions can never over-admit; a request of several prompts is admitted whole or not at
all. Admitted work is counted until its last sample finished, failed or was aborted (`Ticket.release`, once).

Two bounds, both on work the engine has not finished:
- sequences waiting beyond the running batch: admitted sequences minus the batch's slots must stay within
  `max_waiting_seqs`;
- tokens: prompt + max_tokens of every admitted, unfinished sequence (running ones included: that is the
  work a new request queues behind) must stay within `max_pending_tokens`.
An idle server admits any single request that passed validation, however large, so a bound never makes a
request impossible. Zero turns a bound off.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

P = "specroll:"


class Overloaded(RuntimeError):
    """The server's queue is full: 503 / RESOURCE_EXHAUSTED, try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def request_share(num_slots: int) -> int:
    """The most samples one request runs at once, on either engine: the slots less a reserve of an eighth (at
    least one; none with a single slot). One request can then never take every slot: a small request arriving
    behind it starts at the next step (docs/api.md, "Fairness")."""
    return num_slots if num_slots < 2 else num_slots - max(1, num_slots // 8)


@dataclass(slots=True)
class AdmissionLimits:
    max_waiting_seqs: int = 4096
    max_pending_tokens: int = 16_000_000
    retry_after_s: int = 2

    def __post_init__(self) -> None:
        if self.max_waiting_seqs < 0 or self.max_pending_tokens < 0 or self.retry_after_s < 1:
            raise ValueError("max_waiting_seqs and max_pending_tokens must be >= 0 (0: no bound), "
                             f"retry_after_s >= 1; got {self}")


class Ticket:
    """One admitted request's share of the bounds, given back exactly once."""

    __slots__ = ("_admission", "seqs", "tokens")

    def __init__(self, admission: Admission, seqs: int, tokens: int) -> None:
        self._admission: Admission | None = admission
        self.seqs, self.tokens = seqs, tokens

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._give_back(self)


class Admission:
    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        self.slots = 0  # sequences the running batch holds (set once the engine is loaded)
        self.seqs = 0  # admitted, unfinished sequences
        self.tokens = 0  # their prompt + max_tokens
        self.refused = 0
        self._lock = threading.Lock()

    @property
    def waiting_seqs(self) -> int:
        return max(0, self.seqs - self.slots)

    def admit(self, work: Sequence[tuple[int, int]]) -> list[Ticket]:
        """Admit every (sequences, tokens per sequence) item or none; raises Overloaded."""
        seqs = sum(n for n, _ in work)
        tokens = sum(n * t for n, t in work)
        lim = self.limits
        with self._lock:
            if self.seqs:
                waiting = self.seqs + seqs - self.slots
                if lim.max_waiting_seqs and waiting > lim.max_waiting_seqs:
                    self.refused += 1
                    raise Overloaded(f"server overloaded: {self.waiting_seqs} sequences wait (limit "
                                     f"{lim.max_waiting_seqs}); retry later", lim.retry_after_s)
                if lim.max_pending_tokens and self.tokens + tokens > lim.max_pending_tokens:
                    self.refused += 1
                    raise Overloaded(f"server overloaded: {self.tokens} tokens of work pending (limit "
                                     f"{lim.max_pending_tokens}); retry later", lim.retry_after_s)
            self.seqs += seqs
            self.tokens += tokens
        return [Ticket(self, n, n * t) for n, t in work]

    def _give_back(self, ticket: Ticket) -> None:
        with self._lock:
            self.seqs -= ticket.seqs
            self.tokens -= ticket.tokens


class AdmissionCollector(Collector):
    """The bounds and their use in the server's registry, read at scrape time."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        a, lim = self.admission, self.admission.limits
        for name, doc, value in (
                ("admission_max_waiting_seqs", "Sequences that may wait beyond the running batch (0: no bound)",
                 lim.max_waiting_seqs),
                ("admission_max_pending_tokens", "Prompt + max_tokens of unfinished work allowed (0: no bound)",
                 lim.max_pending_tokens),
                ("admission_waiting_seqs", "Admitted sequences beyond the running batch's slots", a.waiting_seqs),
                ("admission_pending_tokens", "Prompt + max_tokens of admitted, unfinished sequences", a.tokens)):
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], value)
            yield g
        c = CounterMetricFamily(P + "requests_refused", "Requests refused because the queue was full",
                                labels=["reason"])
        c.add_metric(["overloaded"], a.refused)
        yield c
