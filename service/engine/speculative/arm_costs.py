"""What an arm's step costs in a batch bucket, as the adaptive strategy draws it; measurements are filed by
`ArmKey` (bucket, drafter, k). Torch-free.

One line for all arms and buckets (`StepCostModel`) and, per (bucket, arm), a correction: the arm's recent seconds
there over what the line predicts now, shrunk towards 1 by the number of measurements (`correction`).

A step is slowed by whatever else runs on the machine, never sped up, so one stall must not shut an arm out:
- an arm measured once at over `STALL` times the line draws its correction between 1 and that price, at the
  quantile of the draw that sets its noise (no extra random numbers);
- a later step under 1 / `STALL` of the arm's mean, both against the line, says that mean was a stall: it is
  forgotten.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from service.engine.speculative.cost_model import StepCostModel
from service.engine.speculative.estimates import Ewma
from service.engine.types import Arm

ArmKey = tuple[int, str | None, int]  # (bucket, drafter, k)


def bucket_of(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()


def arm_key(batch_size: int, s: Arm) -> ArmKey:
    return bucket_of(batch_size), s.drafter if s.k else None, s.k


STALL = 2.0  # one step this many times the line may be a stall; one this many times cheaper (against the line)
# than the arm's mean before says that mean was one


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
class ArmCosts:
    model: StepCostModel
    spread: float = 0.05  # relative spread of an unmeasured arm's cost draw; shrinks with measurements
    measured: dict[ArmKey, Measured] = field(default_factory=dict)

    def _ratio(self, arm: ArmKey) -> tuple[float, int]:
        """The arm's recent seconds over what the line predicts now for them, and its measurements."""
        m = self.measured.get(arm)
        if m is None or m.seconds.value is None:
            return 1.0, 0
        _, drafter, k = arm
        predicted = self.model.predict(drafter, k, round(m.batch.value), round(m.tokens.value))
        return m.seconds.value / predicted, m.seconds.n

    def correction(self, arm: ArmKey) -> tuple[float, int]:
        """What the line misses for this arm (measured / predicted, shrunk towards 1), and its measurements."""
        ratio, n = self._ratio(arm)
        return _shrunk(ratio, n), n

    def predict(self, arm: ArmKey, batch_size: int, tokens: int | None = None) -> float:
        """Seconds of a step; `tokens`: the draft positions it verifies (default batch_size * k)."""
        _, drafter, k = arm
        return self.model.predict(drafter, k, batch_size, tokens) * self.correction(arm)[0]

    def draw(self, arm: ArmKey, batch_size: int, tokens: int, rng: random.Random) -> float:
        """A draw of a step's seconds from what is known of the arm (the module docstring says how)."""
        ratio, n = self._ratio(arm)
        corr = _shrunk(ratio, n)
        z = rng.gauss(0.0, 1.0)
        if n == 1 and ratio > STALL:
            corr **= 0.5 * math.erfc(-z / math.sqrt(2))  # the draw's quantile
        _, drafter, k = arm
        return self.model.predict(drafter, k, batch_size, tokens) * corr * math.exp(z * self.spread / math.sqrt(1 + n))

    def record(self, arm: ArmKey, batch_size: int, seconds: float, tokens: int) -> None:
        """One measured step of the arm: `tokens`, the draft positions its verify pass computed."""
        _, drafter, k = arm
        mean_ratio, n = self._ratio(arm)
        if n and mean_ratio > STALL * seconds / self.model.predict(drafter, k, batch_size, tokens):
            del self.measured[arm]  # what it measured before was a stall (both against the line as it is now)
        measured = self.measured.get(arm)
        if measured is None:
            measured = self.measured[arm] = Measured()
        measured.update(batch_size, seconds, tokens)
        self.model.record(drafter, k, batch_size, seconds, tokens)


def _shrunk(ratio: float, n: int) -> float:
    """A measured / predicted ratio shrunk towards 1 by n measurements (worth two of the line's)."""
    return 1.0 + (ratio - 1.0) * n / (n + 2)
