"""A round's measure of the served and the trained drafter, and what the trainer does with it.

The measure runs on held-out rollouts of the newest policy versions (pool.py), each version apart: the push
decision reads them all together (token-weighted), the freshness alarm the current version's alone, once it
has at least half of `min_heldout` of them.

A trained drafter that measures worse than the one served (by more than `push_margin`) is not pushed, and it
is not trained on from where it went: the student starts again from the served weights with fresh optimizer
moments and half the learning rate (down to `lr / MAX_LR_CUTS`). Measured on bench/e2e.py's GRPO run (demo
draft model, already accepting ~4.3 of 5 tokens per step at k = 4): at lr 1e-3 every measure found the trained
drafter worse (4.40 -> 4.00, 4.30 -> 3.68) and it never pushed; at 1e-4 every measure found it better
(+0.04-0.06) and each one pushed. So the default rate is 1e-4 for a drafter loaded from weights, and 1e-3 for
an EAGLE head initialised here (`--drafter eagle`), which starts far from any target; a random draft model
wants `--lr 1e-3` too (as the tests use). From there the halving finds a rate that works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_LR_CUTS = 32
TUNE_LR, FRESH_LR = 1e-4, 1e-3  # default rates: a drafter loaded from weights, a head initialised here


@dataclass(slots=True)
class Part:
    """One policy version's share of a measure."""
    version: str
    rollouts: int
    lengths: list[float]  # expected tokens per step of the served drafter, then the trained one
    positions: int  # start positions they are the mean of


@dataclass(slots=True)
class Measurement:
    round: int
    policy_version: str  # the newest version measured on
    served_version: str
    before: float  # served drafter, expected tokens per step on held-out recent rollouts
    after: float  # trained drafter, same rollouts
    heldout: int
    pushed: bool = False
    restarted: bool = False  # the trained drafter did worse: training starts again from the served one


def overall(parts: list[Part]) -> tuple[float, float]:
    """The served and the trained drafter's expected tokens per step over all parts (token-weighted)."""
    positions = sum(p.positions for p in parts) or 1
    before, after = (sum(p.lengths[i] * p.positions for p in parts) / positions for i in (0, 1))
    return before, after


def vars_of(m: Measurement) -> dict[str, Any]:
    return {f: getattr(m, f) for f in Measurement.__dataclass_fields__}
