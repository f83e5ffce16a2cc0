"""What the adaptive strategy measures, per drafter and per arm: discounted acceptance posteriors per draft
position, and exponentially weighted step costs. Torch-free."""

from __future__ import annotations

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
class Measured:
    """Recent steps of one arm in one bucket: their mean batch size and seconds (exponentially weighted)."""

    batch: Ewma = field(default_factory=Ewma)
    seconds: Ewma = field(default_factory=Ewma)

    def update(self, batch_size: int, seconds: float) -> None:
        self.batch.update(batch_size, 0.3)
        self.seconds.update(seconds, 0.3)


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
