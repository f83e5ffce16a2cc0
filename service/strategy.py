"""Adaptive speculation strategy: per step, pick (drafter, k) for the running batch from live measurements.

Two things are measured: the cost of a step (wall seconds, EWMA per batch-size bucket and strategy) and each
drafter's per-token acceptance rate alpha (EWMA, shared across buckets). The expected tokens a row emits with
k drafts is (1 - alpha^(k+1)) / (1 - alpha), so the predicted throughput of a strategy is
batch * E[tokens] / cost. A cost not yet measured is extrapolated as plain * (1 + k * m), where m, the
relative cost of one more draft position, is learned per (bucket, drafter) from the speculative steps
measured there (or taken from the drafter's nearest bucket that has one, scaled down for smaller batches):
a model-free drafter's extra position costs a wider verify, a draft model's also a draft forward. Step costs
are what the engine measured, including the catch-up pass a draft model makes after other strategies ran
(a switch costs that) and the work between two steps. A small exploration rate re-measures neighbours of the
best strategy, so the choice follows a drifting target and drafter, and backs off when acceptance collapses;
now and then any arm is re-measured, so a drafter written off comes back when it recovers. Torch-free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Strategy:
    drafter: str | None  # None = plain decoding
    k: int = 0

    @property
    def name(self) -> str:
        return "plain" if self.drafter is None or self.k == 0 else f"{self.drafter}:k={self.k}"


PLAIN = Strategy(None, 0)


def bucket_of(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclass(slots=True)
class Ewma:
    value: float | None = None
    n: int = 0

    def update(self, x: float, rate: float) -> None:
        self.value = x if self.value is None else (1 - rate) * self.value + rate * x
        self.n += 1


@dataclass(slots=True)
class AdaptiveStrategy:
    drafters: list[str]
    ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    decay: float = 0.2  # weight of the newest measurement
    explore: float = 0.05
    explore_any: float = 0.2  # of the exploring steps, the share that tries any arm rather than a neighbour
    prior_alpha: float = 0.6
    marginal_cost: float = 0.5  # prior m until a bucket's speculative steps have been measured
    seed: int = 0
    fixed: Strategy | None = None  # set to pin one strategy (k = 0 pins plain decoding)
    cost: dict[tuple[int, Strategy], Ewma] = field(default_factory=dict)
    alpha: dict[str, Ewma] = field(default_factory=dict)
    trials: dict[str, Ewma] = field(default_factory=dict)  # alpha = EWMA(successes) / EWMA(trials)
    slope: dict[tuple[int, str], Ewma] = field(default_factory=dict)  # (bucket, drafter) -> learned m
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def arms(self) -> list[Strategy]:
        return [PLAIN] + [Strategy(d, k) for d in self.drafters for k in self.ks]

    def acceptance(self, drafter: str) -> float:
        hits, trials = self.alpha.get(drafter), self.trials.get(drafter)
        if hits is None or trials is None or not trials.value:
            return self.prior_alpha
        return hits.value / trials.value

    def expected_tokens(self, s: Strategy) -> float:
        if s.k == 0:
            return 1.0
        a = min(self.acceptance(s.drafter), 0.999)
        return (1 - a ** (s.k + 1)) / (1 - a)

    def _slope(self, bucket: int, drafter: str) -> float:
        own = self.slope.get((bucket, drafter))
        if own is not None and own.value is not None:
            return own.value
        measured = [b for b, d in self.slope if d == drafter]
        if not measured:
            return self.marginal_cost
        nearest = min(measured, key=lambda b: abs(b.bit_length() - bucket.bit_length()))
        # Extra draft positions cost compute in proportion to the batch while a step's fixed cost does not,
        # so a smaller batch than the nearest measured one pays relatively less for them.
        return self.slope[(nearest, drafter)].value * min(1.0, bucket / nearest)

    def predicted_cost(self, bucket: int, s: Strategy) -> float:
        c = self.cost.get((bucket, s))
        if c is not None and c.value is not None:
            return c.value
        plain = self.cost.get((bucket, PLAIN))
        base = plain.value if plain is not None and plain.value is not None else 1.0
        return base * (1 + self._slope(bucket, s.drafter) * s.k) if s.drafter else base

    def predicted_throughput(self, batch_size: int, s: Strategy) -> float:
        return batch_size * self.expected_tokens(s) / self.predicted_cost(bucket_of(batch_size), s)

    def choose(self, batch_size: int) -> Strategy:
        if self.fixed is not None:
            return self.fixed
        if not self.drafters:
            return PLAIN
        arms = self.arms
        best = max(arms, key=lambda s: self.predicted_throughput(batch_size, s))
        bucket = bucket_of(batch_size)
        if (bucket, PLAIN) not in self.cost:
            return PLAIN  # measure the baseline of a new bucket first
        if self._rng.random() < self.explore:
            # Mostly a neighbour of the best (refine k); sometimes any arm, so a drafter whose estimate went
            # stale (say, its acceptance collapsed and has since recovered) gets measured again.
            if self._rng.random() < self.explore_any:
                return self._rng.choice(arms)
            i = arms.index(best)
            return arms[self._rng.choice([j for j in (i - 1, i + 1) if 0 <= j < len(arms)])]
        return best

    def record(self, s: Strategy, batch_size: int, seconds: float, num_accepted: list[int] | None = None) -> None:
        """One step's measurement; num_accepted per row for speculative steps."""
        bucket = bucket_of(batch_size)
        self.cost.setdefault((bucket, s), Ewma()).update(seconds, self.decay)
        plain = self.cost.get((bucket, PLAIN))
        if s.k and s.drafter and plain is not None and plain.value:
            m = max(0.0, (seconds / plain.value - 1) / s.k)
            self.slope.setdefault((bucket, s.drafter), Ewma()).update(m, self.decay)
        if s.k and num_accepted is not None:
            # Truncated-geometric estimate: a row with a accepted of k drafts saw a successes and, if a < k,
            # one failure. Rows whose drafter proposed fewer than k count the missing drafts as failures.
            successes = sum(num_accepted)
            trials = successes + sum(1 for a in num_accepted if a < s.k)
            if trials:
                self.alpha.setdefault(s.drafter, Ewma()).update(successes, self.decay)
                self.trials.setdefault(s.drafter, Ewma()).update(trials, self.decay)

    def snapshot(self) -> dict[str, float]:
        return {d: self.acceptance(d) for d in self.drafters}
