"""Online step-cost model for the adaptive strategy: one small weighted least-squares fit, torch-free.

    plain step of B rows:            cost = a + b * B
    speculative step, drafter d, k:  cost = a + b * B + k * u + v * T + k * (u_d + v_d * B)

(a, b) are the target's fixed and per-row cost; k * u + v * T is what k more positions cost the verify pass, shared
by all drafters (T: the draft positions it computes); k * (u_d + v_d * B) is the drafter's own work. All parameters
are fit jointly from every measured step, so one bucket's steps inform the others and one drafter's steps price
another's verify. Steps are weighted by 1 / cost^2 (relative error) and fade by `forget`. A weak ridge prior ties
the terms to the target's cost, so the fit is defined from the first step. docs/design-notes.md has more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class StepCostModel:
    drafters: list[str]
    own: list[float] | None = None  # per drafter, a draft position's own work over a target position's, a priori
    forget: float = 0.99  # per measured step
    prior_marginal: float = 0.3  # one draft position costs this fraction of a plain step, a priori
    prior_rows: float = 32.0  # a priori, a plain step of this many rows costs twice a one-row step
    prior_weight: float = 0.05  # strength of the priors, in measured steps
    _ata: np.ndarray = field(init=False)  # [n, n] weighted, faded sums of phi phi^T over measured steps
    _aty: np.ndarray = field(init=False)  # [n] and of phi * seconds
    _prior: np.ndarray = field(init=False)  # [n, n] the priors' penalty, per unit of their weight
    _theta: list[float] | None = field(init=False, default=None)
    _index: dict[str, int] = field(init=False)  # drafter -> its first own parameter
    _scale: float | None = field(init=False, default=None)  # typical step cost, for scale-free priors

    def __post_init__(self) -> None:
        n = 4 + 2 * len(self.drafters)
        if self.own is None:
            self.own = [0.0] * len(self.drafters)
        if len(self.own) != len(self.drafters) or min(self.own, default=0.0) < 0:
            raise ValueError(f"own costs {self.own} do not give each of {self.drafters} a cost of 0 or more")
        self._ata, self._aty = np.zeros((n, n)), np.zeros(n)
        self._index = {d: 4 + 2 * i for i, d in enumerate(self.drafters)}
        # Each prior adds (r . theta)^2: b = a / prior_rows, u = prior_marginal * a, v = prior_marginal * b, each
        # drafter's (u_d, v_d) = own[d] * (a, b); and a tiny ridge keeps unseen drafters' parameters defined.
        rows = [{1: self.prior_rows, 0: -1.0}, {2: 1.0, 0: -self.prior_marginal},
                {3: self.prior_rows, 1: -self.prior_marginal * self.prior_rows}]
        for i, own in zip(range(4, n, 2), self.own, strict=True):
            rows += [{i: 1.0, 0: -own}, {i + 1: self.prior_rows, 1: -own * self.prior_rows}]
        self._prior = 1e-9 * np.eye(n)
        for r in rows:
            v = np.zeros(n)
            v[list(r)] = list(r.values())
            self._prior += np.outer(v, v)

    def _features(self, drafter: str | None, k: int, batch: int, tokens: int | None = None) -> list[float]:
        phi = [1.0, float(batch)] + [0.0] * (2 + 2 * len(self.drafters))
        if drafter is not None and k:
            i = self._index[drafter]
            phi[2], phi[i], phi[i + 1] = float(k), float(k), float(k * batch)
            phi[3] = float(k * batch if tokens is None else tokens)
        return phi

    def record(self, drafter: str | None, k: int, batch: int, seconds: float, tokens: int | None = None) -> None:
        """One measured step; `tokens`: the draft positions its verify pass computed (default batch * k)."""
        if seconds <= 0:
            return
        phi = np.array(self._features(drafter, k, batch, tokens))
        w = 1.0 / (seconds * seconds)
        outer = np.outer(phi, phi)
        outer *= w
        self._aty *= self.forget  # in place, as forget * sums + w * phi terms: the same arithmetic, no new arrays
        self._aty += (w * seconds) * phi
        self._ata *= self.forget
        self._ata += outer
        # Cost per row-equivalent, so the prior weighs the same whatever batch this step had.
        unit = seconds * (1 + 1 / self.prior_rows) / (1 + batch / self.prior_rows)
        self._scale = unit if self._scale is None else 0.9 * self._scale + 0.1 * unit
        self._theta = None

    @property
    def measured(self) -> bool:
        return self._scale is not None

    def theta(self) -> list[float]:
        if self._theta is None:
            n = len(self._aty)
            lam = self.prior_weight / (self._scale or 1.0) ** 2
            ata = self._ata + lam * self._prior
            theta = np.linalg.solve(ata, self._aty)
            # A drafter's own work costs nothing or more. Fit freely, a draft model's own term went below 0
            # whenever its steps were all that measured the verify term, which then priced the verify passes of
            # a drafter never run (a suffix table) above the draft model's whole step: it was never tried.
            # Pinned at 0, the draft model's step is all verify until another drafter's steps tell them apart.
            # A pinned term stays a hair below 0: only a newly negative one takes another solve (re-solving for the
            # pinned ones too made every fit with one pinned term five solves).
            pinned: set[int] = set()
            for _ in range(2 * len(self.drafters)):
                negative = [i for i in range(4, n) if theta[i] < 0 and i not in pinned]
                if not negative:
                    break
                pinned.update(negative)
                ata[negative, negative] += 1e6 * lam
                theta = np.linalg.solve(ata, self._aty)
            self._theta = theta.tolist()
        return self._theta

    def predict(self, drafter: str | None, k: int, batch: int, tokens: int | None = None) -> float:
        """Predicted seconds of one step (`tokens` as in `record`); 1.0 (any unit) before anything was measured."""
        if self._scale is None:  # nothing measured yet
            own = self.own[self.drafters.index(drafter)] if drafter is not None and k else 0.0
            return 1.0 * (1 + (self.prior_marginal + own) * k)
        theta = self._theta if self._theta is not None else self.theta()
        plain = max(theta[0] + theta[1] * batch, 0.05 * self._scale * (1 + batch / self.prior_rows))
        if drafter is None or not k:
            return plain
        # The speculative terms of `_features` . theta, written out: `choose` predicts ~17 arms a step, and the sum
        # over all features took 2 us a call against 1 (a GPU step lasts a few ms).
        i = self._index[drafter]
        verified = k * batch if tokens is None else tokens
        extra = k * theta[2] + verified * theta[3] + k * theta[i] + k * batch * theta[i + 1]
        return plain + max(extra, 0.0)
