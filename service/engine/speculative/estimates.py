"""What the adaptive strategy measures per drafter: discounted acceptance posteriors per draft position (arms'
step costs: arm_costs.py). Torch-free."""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class Ewma:
    value: float | None = None
    n: int = 0

    def update(self, x: float, rate: float) -> None:
        self.value = x if self.value is None else (1 - rate) * self.value + rate * x
        self.n += 1


@dataclass(slots=True)
class Ratio:
    """A rate as the ratio of two exponentially weighted sums (seconds per token, say): each measurement weighs
    by its size, so a large one counts for more than a small one, unlike an average of per-measurement rates."""

    num: Ewma = field(default_factory=Ewma)
    den: Ewma = field(default_factory=Ewma)

    def update(self, num: float, den: float, rate: float) -> None:
        self.num.update(num, rate)
        self.den.update(den, rate)

    @property
    def value(self) -> float | None:
        return self.num.value / self.den.value if self.den.value else None


@dataclass(slots=True)
class Acceptance:
    """Discounted Beta posteriors of one drafter's acceptance, one per draft position: of the `trials[j]`
    rows whose verification reached draft j + 1, `hits[j]` accepted it (a conditional rate). Pooled over batch
    sizes, and per batch bucket (`buckets`): a bucket's rate is its own counts shrunk towards the pooled rate
    by `bucket_trials` pseudo-trials (see `rates`)."""

    hits: list[float]
    trials: list[float]
    bucket_trials: float = 16.0
    # bucket -> (hits, trials), discounted up to `_faded[bucket]` of `_fades` (see `fade`): read them by `_bucket`
    buckets: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)
    recent: deque[tuple[int, list[int], list[int]]] = field(default_factory=lambda: deque(maxlen=4))  # per step
    _fades: int = 0  # `fade` calls so far
    _keep: float = 1.0  # their discount
    _faded: dict[int, int] = field(default_factory=dict)  # bucket -> `_fades` its counts are discounted to

    @classmethod
    def empty(cls, depth: int, bucket_trials: float = 16.0) -> Acceptance:
        return cls([0.0] * depth, [0.0] * depth, bucket_trials)

    def rates(self, prior: float, prior_trials: float, draw: random.Random | None = None,
              bucket: int | None = None) -> list[float]:
        """Per-position rates (posterior means, or one Thompson draw with `draw`). Position 1's prior is
        `prior`; each deeper position's is the rate found for the one before, so a depth never measured
        extrapolates from the measured ones. With `bucket`, the pooled rates (drawn or not) are the prior of
        that bucket's counts, worth `bucket_trials` trials: a bucket never measured takes the pooled rates, one
        measured at length its own."""
        out, mean = [], prior
        for h, t in zip(self.hits, self.trials, strict=True):
            a, b = h + mean * prior_trials, t - h + (1 - mean) * prior_trials
            mean = draw.betavariate(max(a, 1e-3), max(b, 1e-3)) if draw else a / (a + b)
            out.append(mean)
        if bucket is None or bucket not in self.buckets:
            return out
        # Position j's prior is the pooled rate scaled as the bucket's rate at j - 1 stands to the pooled one:
        # where a bucket's first drafts fare worse than elsewhere, its deeper ones are expected to as well.
        hits, trials = self._bucket(bucket)
        n, scale, rates = self.bucket_trials, 1.0, []
        for p, h, t in zip(out, hits, trials, strict=True):
            prior = min(p * scale, 1.0)
            rates.append((h + prior * n) / (t + n))
            scale = rates[-1] / max(p, 1e-6)
        return rates

    def fade(self, keep: float) -> None:
        """Discount every count (once per step), so a drafter not run for a while becomes uncertain again. A
        bucket's counts are discounted when next read (`_bucket`), by every fade since: a step reads one bucket of
        the up to seven a rollout passes through."""
        if keep != self._keep:  # bring every bucket up to date at the old discount first
            for bucket in self.buckets:
                self._bucket(bucket)
            self._keep = keep
        self.hits = [h * keep for h in self.hits]
        self.trials = [t * keep for t in self.trials]
        self._fades += 1

    def _bucket(self, bucket: int) -> tuple[list[float], list[float]]:
        """A bucket's (hits, trials), discounted up to now."""
        hits, trials = self.buckets[bucket]
        if lag := self._fades - self._faded.get(bucket, 0):
            keep = self._keep ** lag
            hits[:] = [h * keep for h in hits]
            trials[:] = [t * keep for t in trials]
            self._faded[bucket] = self._fades
        return hits, trials

    def observe_rows(self, rows: list[tuple[int, int]], trials_per_step: float, bucket: int = 0) -> None:
        """One step's rows, as (num_accepted, num_drafted) each, in batch bucket `bucket` (see `observe`). Draft
        j + 1 was tried by the rows that accepted the j drafts before it and proposed it, and accepted by those that
        accepted more than j. A draft a row's drafter did not propose is no trial: the strategy's choice knew the row
        had none."""
        depth = max((m for _, m in rows), default=0)
        hits, trials = [0] * depth, [0] * depth
        for (n, m), count in Counter(rows).items():  # a batch's rows share a few (accepted, drafted) pairs
            for j in range(min(n, depth)):
                hits[j] += count
            for j in range(min(n + 1, m)):
                trials[j] += count
        if depth and trials[0]:
            self.observe(hits, trials, trials_per_step, bucket)

    def observe(self, hits: list[int], trials: list[int], trials_per_step: float, bucket: int = 0) -> None:
        """One step's counts per position, in batch bucket `bucket`. A change, not noise (a policy push made
        the drafter stale): the posterior restarts from the newest steps alone. One step decides at large
        batches; at small ones, where a step holds few trials, the last few do. Tested on the counts pooled over
        positions, against what the bucket expects, once it has counts of its own worth its prior: a bucket's
        rate is not the others' (rows deep in the tail's long responses are not those at full batch), and
        tested against the pooled rate, the tail's first steps restarted a drafter right at full batch."""
        self.recent.append((bucket, hits, trials))
        own = self._bucket(bucket) if bucket in self.buckets else None
        if own is None or own[1][0] < self.bucket_trials:
            self._add(bucket, hits, trials, trials_per_step)
            return
        pooled_hits, pooled_trials = sum(self.hits), sum(self.trials)
        n = self.bucket_trials
        expected = (sum(own[0]) + n * pooled_hits / max(pooled_trials, 1e-9)) / (sum(own[1]) + n)
        h = t = 0
        for i, (b, step_hits, step_trials) in enumerate(reversed(self.recent)):
            if b != bucket:
                break
            h, t = h + sum(step_hits), t + sum(step_trials)
            if pooled_trials >= trials_per_step and t >= 6 and _changed(expected, h / t, t):
                self.hits, self.trials = [0.0] * len(self.hits), [0.0] * len(self.trials)
                self.buckets.clear()
                self._faded.clear()
                for step in list(self.recent)[-(i + 1):]:
                    self._add(*step, trials_per_step)
                self.recent.clear()
                return
        self._add(bucket, hits, trials, trials_per_step)

    def _add(self, bucket: int, hits: list[int], trials: list[int], trials_per_step: float) -> None:
        # One step counts for at most trials_per_step rows at its first position: rows are not independent.
        scale = min(1.0, trials_per_step / max(trials[0], 1))
        grow = len(hits) - len(self.hits)  # a pinned k deeper than the strategy's arms
        if grow > 0:
            self.hits, self.trials = self.hits + [0.0] * grow, self.trials + [0.0] * grow
            for bucket_hits, bucket_trials in self.buckets.values():
                bucket_hits += [0.0] * grow
                bucket_trials += [0.0] * grow
        if bucket in self.buckets:
            bucket_hits, bucket_trials = self._bucket(bucket)
        else:
            bucket_hits, bucket_trials = self.buckets[bucket] = [0.0] * len(self.hits), [0.0] * len(self.hits)
            self._faded[bucket] = self._fades
        for j, (h, t) in enumerate(zip(hits, trials, strict=True)):
            self.hits[j] += h * scale
            self.trials[j] += t * scale
            bucket_hits[j] += h * scale
            bucket_trials[j] += t * scale


def _changed(p: float, observed: float, trials: float) -> bool:
    return abs(observed - p) > 0.15 + 3 * math.sqrt(max(p * (1 - p), 0.01) / trials)
