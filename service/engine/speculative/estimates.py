"""What the adaptive strategy measures, per drafter and per arm: discounted acceptance posteriors per draft
position, and exponentially weighted step costs. Torch-free."""

from __future__ import annotations

import math
import random
from collections import deque
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
class Measured:
    """Recent steps of one arm in one bucket: their mean batch size, seconds and draft positions verified
    (exponentially weighted)."""

    batch: Ewma = field(default_factory=Ewma)
    seconds: Ewma = field(default_factory=Ewma)
    tokens: Ewma = field(default_factory=Ewma)  # draft positions verified

    def update(self, batch_size: int, seconds: float, tokens: int) -> None:
        self.batch.update(batch_size, 0.3)
        self.seconds.update(seconds, 0.3)
        self.tokens.update(tokens, 0.3)


@dataclass(slots=True)
class Acceptance:
    """Discounted Beta posteriors of one drafter's acceptance, one per draft position: of the `trials[j]`
    rows whose verification reached draft j + 1, `hits[j]` accepted it (a conditional rate)."""

    hits: list[float]
    trials: list[float]
    recent: deque[tuple[list[int], list[int]]] = field(default_factory=lambda: deque(maxlen=4))  # per step

    @classmethod
    def empty(cls, depth: int) -> Acceptance:
        return cls([0.0] * depth, [0.0] * depth)

    def rates(self, prior: float, prior_trials: float, draw: random.Random | None = None) -> list[float]:
        """Per-position rates (posterior means, or one Thompson draw with `draw`). Position 1's prior is
        `prior`; each deeper position's is the rate found for the one before, so a depth never measured
        extrapolates from the measured ones."""
        out, mean = [], prior
        for h, t in zip(self.hits, self.trials, strict=True):
            a, b = h + mean * prior_trials, t - h + (1 - mean) * prior_trials
            mean = draw.betavariate(max(a, 1e-3), max(b, 1e-3)) if draw else a / (a + b)
            out.append(mean)
        return out

    def pooled(self) -> tuple[float, float]:
        return sum(self.hits), sum(self.trials)

    def fade(self, keep: float) -> None:
        """Discount every count (once per step), so a drafter not run for a while becomes uncertain again."""
        self.hits = [h * keep for h in self.hits]
        self.trials = [t * keep for t in self.trials]

    def observe(self, hits: list[int], trials: list[int], trials_per_step: float) -> None:
        """One step's counts per position. A change, not noise (a policy push made the drafter stale): the
        posterior restarts from the newest steps alone. One step decides at large batches; at small ones, where
        a step holds few trials, the last few do. Tested on the counts pooled over positions."""
        self.recent.append((hits, trials))
        pooled_hits, pooled_trials = self.pooled()
        h = t = 0
        for i, (step_hits, step_trials) in enumerate(reversed(self.recent)):
            h, t = h + sum(step_hits), t + sum(step_trials)
            if pooled_trials >= trials_per_step and t >= 6 and _changed(pooled_hits / pooled_trials, h / t, t):
                self.hits, self.trials = [0.0] * len(self.hits), [0.0] * len(self.trials)
                for step_hits, step_trials in list(self.recent)[-(i + 1):]:
                    self._add(step_hits, step_trials, trials_per_step)
                self.recent.clear()
                return
        self._add(hits, trials, trials_per_step)

    def _add(self, hits: list[int], trials: list[int], trials_per_step: float) -> None:
        # One step counts for at most trials_per_step rows at its first position: rows are not independent.
        scale = min(1.0, trials_per_step / max(trials[0], 1))
        grow = len(hits) - len(self.hits)  # a pinned k deeper than the strategy's arms
        if grow > 0:
            self.hits, self.trials = self.hits + [0.0] * grow, self.trials + [0.0] * grow
        for j, (h, t) in enumerate(zip(hits, trials, strict=True)):
            self.hits[j] += h * scale
            self.trials[j] += t * scale


def _changed(p: float, observed: float, trials: float) -> bool:
    return abs(observed - p) > 0.15 + 3 * math.sqrt(max(p * (1 - p), 0.01) / trials)
