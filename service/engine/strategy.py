"""Adaptive speculation strategy: per step, pick (drafter, k) for the running batch. Torch-free.

The choice is Thompson sampling over arms {plain} + drafters x ks, scored by predicted throughput
    batch * E[tokens per row] / step cost,   E = 1 + sum_{j<=k} alpha_1 * ... * alpha_j
where alpha_j is the rate at which draft j is accepted once drafts 1..j-1 were. Each step draws the alphas from
the drafter's per-position posteriors and a cost from the cost model, and runs the best draw: exploration goes
where an arm may be best, which a rollout's few dozen steps per batch bucket can afford.

Sharing makes it converge fast: one cost model for all arms and batch sizes (speculative/cost_model.py) with
per-bucket corrections (arm_costs.py); acceptance per drafter and position, pooled over buckets and shrunk per
bucket; catch-up priced apart (catch_up.py); lookahead drafters' drafts shadow-checked on steps that did not run them
(shadow.py). A step far outside expectation resets a posterior, and a drafter push renews its drafter's.
docs/speculative.md describes the algorithm; docs/design-notes.md the reasons behind each part.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

from service.engine.speculative.arm_costs import ArmCosts, arm_key, bucket_of
from service.engine.speculative.catch_up import CatchUps
from service.engine.speculative.cost_model import StepCostModel
from service.engine.speculative.estimates import Acceptance
from service.engine.speculative.passes import cut_depth, verify_tokens
from service.engine.speculative.tokens import assisted_from, by_drafts, mean_from
from service.engine.types import PLAIN, Arm


@dataclass(slots=True)
class AdaptiveStrategy:
    drafters: list[str]
    ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    prior_alpha: float = 0.6
    prior_trials: float = 2.0  # weight of prior_alpha, in trials
    discount: float = 0.995  # per step, on acceptance counts
    trials_per_step: float = 48.0  # one step counts for at most this many trials (rows are not independent)
    bucket_trials: float = 16.0  # a bucket's acceptance is its counts and the pooled rate worth this many trials
    probe_trials: float = 8.0  # a drafter with fewer trials at its first position is barely known: probed
    cost_spread: float = 0.05  # relative spread of an unmeasured arm's cost draw
    seed: int = 0
    fixed: Arm | None = None  # set to pin one strategy (k = 0 pins plain decoding)
    rounds_to_ks: bool = False  # the runner verifies a cut pass at the next depth in `ks` (CUDA graphs)
    pack_min_saved: int | None = None  # the runner packs verify passes (see `packs`); None: never
    # Per drafter, a draft position's own work over a target position's, as the engine knows it before measuring
    # (`Drafter.own_cost`; the cost model's prior): a drafter not named, 0
    own_costs: dict[str, float] = field(default_factory=dict)
    costs: ArmCosts = field(init=False)  # the cost line and each (bucket, arm)'s correction to it
    accept: dict[str, Acceptance] = field(init=False)
    catch_ups: CatchUps = field(default_factory=CatchUps)  # what a switch to a draft model costs before it drafts
    _plain_buckets: set[int] = field(default_factory=set)
    _deepest: dict[str, int] = field(default_factory=dict)  # deepest k measured, per drafter
    _rng: random.Random = field(init=False)
    _arms: tuple[tuple[tuple[str, ...], tuple[int, ...]], tuple[Arm, ...]] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self.forget_costs()
        self.accept = {d: Acceptance.empty(max(self.ks), self.bucket_trials) for d in self.drafters}

    def forget_costs(self) -> None:
        """Start measuring step costs afresh, as at start-up; acceptance stands. For when every step's seconds
        change at once: the engine's compiled forwards took over from eager ones (engine/background_compile.py)."""
        own = [self.own_costs.get(d, 0.0) for d in self.drafters]
        self.costs = ArmCosts(StepCostModel(list(self.drafters), own), self.cost_spread)
        self.catch_ups = CatchUps()
        self._plain_buckets.clear()
        self._deepest.clear()

    def depths(self) -> tuple[int, ...]:
        """The draft depths this strategy may run (what the engine captures or compiles verify forwards for)."""
        if self.fixed is not None:
            return (self.fixed.k,) if self.fixed.k else ()
        return self.ks if self.drafters else ()

    @property
    def arms(self) -> tuple[Arm, ...]:
        key = (tuple(self.drafters), self.ks)
        if self._arms is None or self._arms[0] != key:  # built once: `choose` walks them every step
            self._arms = key, (PLAIN, *(Arm(d, k) for d in self.drafters for k in self.ks))
        return self._arms[1]

    def acceptance(self, drafter: str, batch_size: int | None = None) -> list[float]:
        """Posterior mean acceptance per draft position (conditional on reaching it): pooled over batch sizes,
        or that of `batch_size`'s bucket."""
        bucket = bucket_of(batch_size) if batch_size else None
        return self.accept[drafter].rates(self.prior_alpha, self.prior_trials, bucket=bucket)

    def cut(self, s: Arm, longest: int) -> Arm:
        """The arm the runner runs for s when no row proposed more than `longest` drafts: a verify pass cut to
        the longest proposal (none: plain), rounded up to a depth in `ks` where the runner replays captured CUDA
        graphs (`rounds_to_ks`)."""
        if longest >= s.k:
            return s
        if not longest:
            return PLAIN
        return Arm(s.drafter, cut_depth(longest, s.k, self.ks if self.rounds_to_ks else None))

    def _tokens(self, s: Arm, batch_size: int, rows: Counter[int] | None) -> int:
        """The draft positions arm s verifies, given its drafter's proposal length -> rows, where known."""
        if rows is None:
            return batch_size * s.k
        return verify_tokens(sum(c * min(s.k, n) for n, c in rows.items()), batch_size, s.k, self.pack_min_saved)

    def choose(self, batch_size: int, proposals: dict[str, list[int]] | None = None,
               room: list[int] | None = None, catch_up: dict[str, int] | None = None) -> Arm:
        """The arm to run for this batch. `proposals`: for each drafter that proposes on the host, how many
        drafts it has for each row (see the module docstring); it may name a depth shorter than the arm's.
        `room`: per row, the most drafts it can still emit (its tokens left less one: see "Room" in the module
        docstring); the batch runs at most max(room) + 1 more plain steps, fewer at an arm's pace, and a
        switch's catch-up is spread over no more. `catch_up`: the tokens each drafter would feed to catch up
        before drafting (a drafter not named: none)."""
        if self.fixed is not None:
            return self.fixed
        if not self.drafters:
            return PLAIN
        if self.probes_plain(batch_size):
            return PLAIN  # measure the baseline first (see the module docstring)
        proposals = proposals or {}
        steps_left = max(room) + 1 if room else None
        if room is not None and min(room, default=0) >= max(self.ks):
            room = None  # binds no arm
        caps = self._caps(proposals, room)
        rows = {d: Counter(n) for d, n in caps.items() if n}  # drafts -> rows
        bucket = bucket_of(batch_size)
        alpha = {d: self.accept[d].rates(self.prior_alpha, self.prior_trials, self._rng, bucket)
                 for d in self.drafters}
        tables = {d: by_drafts(a, max(self.ks)) for d, a in alpha.items()}  # expected tokens by drafts per row
        best, best_value, seen = PLAIN, -1.0, set()
        # (proposal, room) -> rows, per lookahead drafter: what an assisted draft model's rows would verify
        assistants = {d: Counter(zip(n, room or [max(self.ks)] * len(n), strict=True))
                 for d, n in proposals.items() if n and d in alpha}
        longest = {d: max(n, default=0) for d, n in caps.items()}
        for arm in self.arms:
            s = arm if arm.drafter not in longest else self.cut(arm, longest[arm.drafter])
            if s in seen:
                continue  # a cut verify: the same step as a shallower arm
            seen.add(s)
            if s.k > 2 * self._deepest.get(s.drafter, self.ks[0]):
                continue  # deeper than twice the deepest measured k: its cost is an extrapolation
            width = self._tokens(s, batch_size, rows.get(s.drafter)) if s.k else 0
            cost = self.costs.draw((bucket, s.drafter, s.k), batch_size, width, self._rng)
            tokens = mean_from(tables[s.drafter], s.k, rows.get(s.drafter)) if s.k else 1.0
            if s.k and s.drafter not in proposals:  # a draft model: assisted by a lookahead drafter where it pays
                for assistant, pairs in assistants.items():
                    more, n = assisted_from(tables[s.drafter], s.k, tables[assistant], pairs)
                    if n is not None and more > tokens:
                        tokens, s = more, Arm(s.drafter, s.k, (assistant, n))
            if s.k and catch_up and catch_up.get(s.drafter):
                left = (steps_left or math.inf) / tokens  # at this arm's pace: its longest budget over a step's tokens
                cost += self.catch_ups.charge(s.drafter, catch_up[s.drafter], bucket, left)
            if tokens / cost > best_value:
                best, best_value = s, tokens / cost
        if best.k and self.barely_known(best.drafter):
            # A draw picked it because it may be good. Probe it at the smallest k, which measures its acceptance
            # as well and costs least if the draw was wrong.
            return Arm(best.drafter, min(best.k, self.ks[0]))
        return best

    def barely_known(self, drafter: str) -> bool:
        """Its acceptance was never measured, or not for a long while: a choice of it is a probe."""
        return self.accept[drafter].trials[0] < self.probe_trials

    def _caps(self, proposals: dict[str, list[int]], room: list[int] | None) -> dict[str, list[int]]:
        """Per drafter, the most drafts each row would verify: its proposal (lookahead drafters) within the row's
        room, the room alone for the others; without a room that binds, the proposals (other rows get k)."""
        if room is None:
            return proposals
        caps = {d: [min(n, r) for n, r in zip(p, room, strict=True)] for d, p in proposals.items()}
        return caps | {d: room for d in self.drafters if d not in proposals}

    def renew(self, drafter: str) -> None:
        """`drafter` serves new weights (a push): its acceptance restarts from the prior, as a new drafter's
        (see "Pushes" in the module docstring). Its costs stand: a push keeps the model's shapes."""
        if drafter in self.accept:
            self.accept[drafter] = Acceptance.empty(max(self.ks), self.bucket_trials)

    def probes_plain(self, batch_size: int) -> bool:
        return bucket_of(batch_size) not in self._plain_buckets and len(self._plain_buckets) < 2

    def record(self, s: Arm, batch_size: int, seconds: float | None, num_accepted: list[int] | None = None,
               ran_k: int | None = None, num_drafted: list[int] | None = None,
               assisted: list[bool] | None = None, caught_up: tuple[int, float] = (0, 0.0),
               shadow: dict[str, list[tuple[int, int]]] | None = None) -> None:
        """One step's measurement: its wall seconds (None: not a measure of its cost, e.g. it captured a CUDA
        graph), num_accepted and num_drafted (default: k) per row for speculative steps, `ran_k`, the depth
        verified when the runner cut the verify pass to the longest proposal, `assisted`, the rows that
        verified the drafts of `s.assist`'s lookahead drafter, `caught_up`: the tokens the drafter fed to catch
        up before drafting (what `choose` was told) and their seconds, part of `seconds`, and `shadow`: per
        lookahead drafter, (num_accepted, num_drafted) of the rows whose drafts this step did not verify, set
        against the tokens they emitted (speculative/shadow.py)."""
        drafter = s.drafter if s.k else None
        # A new bucket's plain probe does not end a stay.
        self.catch_ups.step(self.drafters, drafter, bucket_of(batch_size), not self.probes_plain(batch_size))
        tokens, catch_seconds = caught_up
        if drafter is not None:
            self.catch_ups.paid(drafter, tokens, catch_seconds)
        # A drafter's first step ever (first forwards of its model) is no measure of its arm.
        if seconds is not None and (drafter is None or drafter in self._deepest):
            ran = s if ran_k is None or ran_k == s.k else Arm(s.drafter, ran_k) if ran_k else PLAIN
            width = batch_size * ran.k
            if ran.k and num_drafted:
                drafted = sum(min(n, ran.k) for n in num_drafted)
                width = verify_tokens(drafted, batch_size, ran.k, self.pack_min_saved)
            self.costs.record(arm_key(batch_size, ran), batch_size, seconds - catch_seconds, width)
        if drafter is not None:
            ran_with = [drafter] + ([s.assist[0]] if s.assist and assisted and any(assisted) else [])
            for d in ran_with:  # an assisting drafter's drafts were verified at k too
                self._deepest[d] = max(self._deepest.get(d, 0), s.k)
        if drafter is None:
            self._plain_buckets.add(bucket_of(batch_size))
        for a in self.accept.values():
            a.fade(self.discount)
        by_drafter: dict[str, list[tuple[int, int]]] = {}
        if drafter is not None and num_accepted:
            drafted = num_drafted or [s.k] * len(num_accepted)
            assistant = s.assist[0] if s.assist and assisted else None
            for i, row in enumerate(zip(num_accepted, drafted, strict=True)):
                by_drafter.setdefault(assistant if assistant is not None and assisted[i] else drafter, []).append(row)
        for d, rows in (shadow or {}).items():
            if d in self.accept:
                by_drafter.setdefault(d, []).extend(rows)
        for d, rows in by_drafter.items():
            self.accept[d].observe_rows(rows, self.trials_per_step, bucket_of(batch_size))
