"""Prometheus metrics, named after vLLM's with a ``specroll:`` prefix.

Counters the engine already keeps (tokens, speculative decoding) are read from the backend's stats snapshot
at scrape time; latencies, batch sizes, aborts and weight pushes are observed as they happen. Both backends
report under these names, so one dashboard serves both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from service.backend.base import StatsSnapshot

logger = logging.getLogger(__name__)

P = "specroll:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PUSH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """Gauges and engine-kept counters, read when Prometheus scrapes."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily(P + "ready", "1 once the model is loaded and the engine loop runs")
        ready.add_metric([], 1.0 if self._m.ready_fn() else 0.0)
        yield ready
        stats = self._m.stats_fn()
        if stats is None:
            return
        for name, doc, value in (
            ("num_requests_running", "Sequences in the running batch", stats.num_running),
            ("num_requests_waiting", "Sequences waiting for a slot", stats.num_waiting),
            ("paused", "1 while generation is paused", 1.0 if stats.paused else 0.0),
            ("admission_held", "1 while a push or pause in mode wait holds waiting requests back",
             1.0 if stats.admission_held else 0.0),
            ("compiling", "1 while the forwards compile in the background (steps run eager ones meanwhile)",
             1.0 if stats.compiling else 0.0),
            ("spec_decode_mean_accepted_length", "Tokens per sequence per speculative step (recent steps)",
             stats.mean_accepted_length),
        ):
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], float(value))
            yield g
        versions = GaugeMetricFamily(P + "weight_version", "Weight version served, per role (value 1)",
                                     labels=["role", "version"])
        versions.add_metric(["target", stats.policy_version], 1.0)
        versions.add_metric(["drafter", stats.drafter_version], 1.0)
        yield versions
        strategy = GaugeMetricFamily(P + "spec_decode_strategy", "Current decoding strategy (value 1)",
                                     labels=["strategy"])
        strategy.add_metric([stats.strategy], 1.0)
        yield strategy
        for name, doc, value in (
            ("prompt_tokens", "Prefill tokens processed", stats.prompt_tokens),
            ("generation_tokens", "Tokens generated", stats.generation_tokens),
            ("engine_steps", "Engine steps run", stats.num_steps),
            ("spec_decode_num_drafts", "Sequence-steps that verified a draft", stats.spec_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed", stats.spec_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted", stats.spec_accepted_tokens),
        ):
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], float(value))
            yield c
        per_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position", labels=["position"])
        for pos, count in enumerate(stats.accepted_per_position):
            per_pos.add_metric([str(pos)], float(count))
        yield per_pos


class Metrics:
    def __init__(self, ready_fn: Callable[[], bool] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.stats_fn: Callable[[], StatsSnapshot | None] = lambda: None  # the backend's, once it is built
        self.ready_fn = ready_fn or (lambda: False)
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Time from arrival to a sample's last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.batch = Histogram(P + "batch_size", "Sequences per engine step", buckets=BATCH_BUCKETS, registry=r)
        self.strategy_steps = Counter(P + "spec_decode_strategy_steps", "Engine steps per decoding strategy",
                                      ["strategy"], registry=r)
        self.success = Counter(P + "request_success", "Finished samples by finish reason", ["finished_reason"],
                               registry=r)
        self.aborts = Counter(P + "requests_aborted", "Aborted requests by reason", ["reason"], registry=r)
        self.push_seconds = Histogram(P + "weight_sync_seconds", "Duration of a weight push or load", ["role"],
                                      buckets=PUSH_BUCKETS, registry=r)
        self.push_bytes = Counter(P + "weight_sync_bytes", "Bytes of weights received", ["role"], registry=r)
        self.pushes = Counter(P + "weight_sync", "Weight pushes and loads by result", ["role", "result"],
                              registry=r)
        self.swap_seconds = Histogram(P + "weight_swap_seconds", "Time the engine loop was held for a swap",
                                      ["role"], buckets=LATENCY_BUCKETS, registry=r)
        self.unrecorded = Counter(P + "rollouts_unrecorded", "Finished rollouts a rollout callback (the buffer) "
                                  "failed to take: they reached the client but not the buffer", registry=r)
        self.sampling_exact = Gauge(P + "spec_decode_sampling_exact", "1 when sampled requests are served with "
                                    "speculation on, 0 when refused (the reason in the label)", ["reason"], registry=r)
        self.weights_invalid = Gauge(P + "weights_invalid", "1 while the serving weights are no version (an "
                                     "in-place push failed after its first write): generation is refused",
                                     registry=r)
        r.register(_EngineCollector(self))

    def rollout_unrecorded(self) -> None:
        self.unrecorded.inc()

    # -- observations (engine thread and API layers) -----------------------------------------------
    def observe_step(self, batch_size: int, strategy: str) -> None:
        self.batch.observe(batch_size)
        self.strategy_steps.labels(strategy or "plain").inc()

    def observe_tokens(self, ttft: float | None, gap: float, n_tokens: int) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
            n_tokens -= 1
        if gap > 0 and n_tokens > 0:
            per = gap / n_tokens
            for _ in range(n_tokens):
                self.itl.observe(per)

    def observe_finished(self, e2e: float, reason: str) -> None:
        self.e2e.observe(e2e)
        self.success.labels(reason).inc()

    def aborted(self, reason: str, count: int = 1) -> None:
        self.aborts.labels(reason).inc(count)

    def weight_push(self, role: str, ok: bool, seconds: float = 0.0, nbytes: int = 0,
                    swap_seconds: float | None = None) -> None:
        self.pushes.labels(role, "ok" if ok else "error").inc()
        if ok:
            self.push_seconds.labels(role).observe(seconds)
            self.push_bytes.labels(role).inc(nbytes)
            if swap_seconds is not None:
                self.swap_seconds.labels(role).observe(swap_seconds)

    def speculative_sampling(self, exact: bool, reason: str = "") -> None:
        """The start-up verdict on sampled requests under speculation (the vLLM backend's self-check)."""
        self.sampling_exact.labels(reason[:500]).set(1.0 if exact else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
