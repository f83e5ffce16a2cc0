"""Online speculation depth for the vLLM backend: live acceptance on top of the start-up profile's step costs.

Step cost per (batch size, k) is a property of the model, drafter and machine, so the start-up profile's cost model
holds while serving. Acceptance depends on the workload and the drafter's weights, and collapses after a policy
push without its drafter. So the serving engine re-estimates acceptance per draft position from every verified
draft (forgetting old drafts, shrunk towards the profile's rates) and rebuilds vLLM's batch size -> k table every
few steps (`OnlineScheduler` in service/vllm/scheduler.py, inside vLLM's engine-core process). A push resets
what was learnt. docs/design-notes.md has the details.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per step t(b, k) = a + c*b + k*(u + v*b), never below `floor` (the fastest measured step), and
    never cheaper with more drafts (a noisy fit of a flat profile can tilt u + v*b below 0 at some b)."""

    a: float
    c: float
    u: float
    v: float
    floor: float

    def seconds(self, batch: int, k: int) -> float:
        return max(self.a + self.c * batch, self.floor) + k * max(self.u + self.v * batch, 0.0)


def tokens_per_step(acceptance: list[float] | tuple[float, ...], k: int) -> float:
    return 1.0 + sum(acceptance[:k])


def best_depths(cost: CostModel, acceptance: list[float] | tuple[float, ...], ks: list[int],
                max_num_seqs: int) -> list[int]:
    """Dense lookup [0, k(1), ..., k(max_num_seqs)]: index b holds the k of most tokens per second at batch b
    (ties to the smaller k)."""
    lookup = [0]
    for b in range(1, max_num_seqs + 1):
        lookup.append(max(ks, key=lambda k: (tokens_per_step(acceptance, k) / cost.seconds(b, k), -k)))
    return lookup


def rows_of(lookup: list[int]) -> list[tuple[int, int, int]]:
    """A dense lookup as vLLM's table rows (lo, hi, k), consecutive equal k's merged."""
    rows: list[tuple[int, int, int]] = []
    for b, k in enumerate(lookup[1:], start=1):
        if rows and rows[-1][2] == k:
            rows[-1] = (rows[-1][0], b, k)
        else:
            rows.append((b, b, k))
    return rows


@dataclass(slots=True)
class OnlineDepth:
    cost: CostModel
    ks: list[int]
    max_num_seqs: int
    prior: tuple[float, ...]  # acceptance per position from the start-up profile
    prior_weight: float = 8.0  # the prior counts as this many drafts at every position
    decay: float = 0.98  # per verified draft: a memory of about 50 drafts
    refresh_every: int = 4  # steps between two rebuilds of the lookup
    probe_every: int = 64  # steps without any draft before one probe step
    accepted: list[float] = field(default_factory=list)  # per position, with 0..j-1 accepted: accepted
    drafted: list[float] = field(default_factory=list)  # ... and tried
    lookup: list[int] = field(default_factory=list)
    _steps: int = 0
    _since_draft: int = 0
    _new: int = 0  # drafts observed since the last step() call

    def __post_init__(self) -> None:
        if not self.ks or min(self.ks) < 0 or self.max_num_seqs < 1:
            raise ValueError(f"bad online depth settings: ks={self.ks}, max_num_seqs={self.max_num_seqs}")
        depth = max(self.ks)
        self.prior = tuple(self.prior[:depth]) + (0.0,) * (depth - len(self.prior))
        self.renew()

    def renew(self) -> None:
        """Forget the measured acceptance and start again from the profile's: the weights it was measured on
        changed (a push). Called when vLLM's scheduler resumes from a pause, which every push is inside."""
        depth = len(self.prior)
        self.accepted = [0.0] * depth
        self.drafted = [0.0] * depth
        self._since_draft = self._new = 0
        self.lookup = best_depths(self.cost, self.prior, self.ks, self.max_num_seqs)

    def to_json(self) -> dict[str, Any]:
        c = self.cost
        return {"cost": [c.a, c.c, c.u, c.v, c.floor], "ks": list(self.ks), "max_num_seqs": self.max_num_seqs,
                "prior": list(self.prior)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OnlineDepth:
        return cls(CostModel(*(float(x) for x in data["cost"])), [int(k) for k in data["ks"]],
                   int(data["max_num_seqs"]), tuple(float(a) for a in data["prior"]))

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified draft of one request: how many tokens it proposed, how many were accepted."""
        n = min(num_draft_tokens, len(self.drafted))
        if n <= 0:
            return
        for j in range(len(self.drafted)):
            self.drafted[j] *= self.decay
            self.accepted[j] *= self.decay
        for j in range(min(num_accepted + 1, n)):  # positions tried: every accepted one and the first rejected
            self.drafted[j] += 1.0
            self.accepted[j] += 1.0 if j < num_accepted else 0.0
        self._new += 1

    def acceptance(self) -> list[float]:
        """Live r_j = c_0 * ... * c_j. c_0 is shrunk towards the profile's first rate, each deeper c_j towards the
        live c_(j-1): a position the lookup seldom drafts to behaves like the one before it (the geometric
        model), so a drafter the profile underrated is tried deeper, and one that collapsed is left at every
        depth."""
        out: list[float] = []
        r, prior_c = 1.0, (self.prior[0] if self.prior else 0.0)
        for j in range(len(self.prior)):
            c = (self.accepted[j] + self.prior_weight * prior_c) / (self.drafted[j] + self.prior_weight)
            r, prior_c = r * c, c
            out.append(r)
        return out

    def step(self) -> list[int]:
        """The lookup for the step being scheduled (called once per step, before vLLM reads it)."""
        self._steps += 1
        self._since_draft = 0 if self._new else self._since_draft + 1
        self._new = 0
        if self._steps % self.refresh_every == 0:
            self.lookup = best_depths(self.cost, self.acceptance(), self.ks, self.max_num_seqs)
        if self._since_draft >= self.probe_every and any(self.ks):
            self._since_draft = 0
            probe = min(k for k in self.ks if k > 0)
            return [0] + [k or probe for k in self.lookup[1:]]
        return self.lookup
