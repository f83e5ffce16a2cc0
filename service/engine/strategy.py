"""Adaptive speculation strategy: per step, pick (drafter, k) for the running batch. Torch-free.

The choice is a bandit over arms {plain} + drafters x ks, scored by predicted throughput
    batch * E[tokens per row] / step cost,   E = 1 + sum_{j<=k} alpha_1 * ... * alpha_j
where alpha_j is the rate at which the drafter's j-th draft is accepted once drafts 1..j-1 were. It is
Thompson sampling: each step draws the alphas from the drafter's posteriors and a cost from the cost
posterior, and runs the arm whose draw is best. Why this and not a greedy rule with a small exploration
rate (what we had, 9% behind the best fixed k): a rollout spends only a few dozen steps in each batch
bucket, so the strategy cannot afford to measure arms one by one and cannot afford to sit on an arm it
has wrongly written off either. Thompson sampling spends exploration in proportion to the chance an arm
is best: arms clearly worse are almost never run, near-ties (where a wrong pick costs little) are run
often, and it needs no tuned exploration rate.

What makes it fast to converge is sharing across arms:
- Cost: one online least-squares model of step cost for all arms and batch sizes (`StepCostModel`: target a +
  b*B, k * (u + v*B) for a verify pass k positions wider, shared by every drafter, plus k * (u_d + v_d*B) for
  the drafter's own work). Two measured arms of a drafter in any buckets predict all its ks in every bucket,
  and one drafter's steps price the verify passes of the others. Per (bucket, arm), a correction absorbs what
  a line misses; the cost draw's spread shrinks with the arm's measurements there, and one stalled step does not
  shut an arm out (speculative/arm_costs.py). Costs are what the engine measured, including the work between two
  steps.
- Catch-up: a draft model that did not run the last steps first feeds itself the tokens it missed. That is
  learned apart from the arm's cost, as seconds per token, and charged to the arms that would pay it, spread over
  the steps the switch is expected to last (speculative/catch_up.py says how and why).
- Acceptance: per drafter, one Beta posterior per draft position, of the rate at which a row that reached
  that position accepts it (a row that accepted a of k drafts tried positions 1..a+1 and accepted 1..a).
  One rate for every position (a geometric model) is right for a draft model but not for a suffix table,
  which either matches a row, and then nearly all its drafts are right, or proposes nothing: pooled into
  one rate, its 50% matches look like a 50% per-token rate, and deep drafts, which pay most on the tail,
  look worthless. A position never measured takes the rate drawn for the one before it as its prior, so
  the first k measured extrapolates to the rest. Every speculative step of any k feeds them (one step
  counts for at most `trials_per_step` rows, since a batch's rows are not independent). Each batch bucket keeps
  its own counts as well, shrunk towards the pooled rates (`bucket_trials` pseudo-trials): rows at full batch are
  early in their responses and the tail's deep in long ones, and in a GRPO run (bench/e2e.py) a suffix table's
  drafts were accepted at 0.78 at full batch and 0.25 in the tail, a draft model's at 0.83 and 0.6-0.7. Counts are
  discounted every step, so a drafter that has not run for a while becomes uncertain again and gets
  re-tried when it may have recovered. A drafter that proposes on the host (a suffix table) needs no re-try:
  on the steps that do not verify its drafts, they are set against the tokens the rows emitted, which tells
  what it would have had accepted (speculative/shadow.py says why that is its acceptance in distribution).
- Collapse: when the newest step (or, at small batches where one step holds few trials, the newest few)
  is far outside what its bucket expects, pooled over positions (a policy push made the drafter stale), the
  posterior restarts from those steps, so the strategy leaves a collapsed drafter after one step instead
  of after a slow decay. Not before the bucket has counts of its own: a tail where the drafter is poorer than
  at full batch is no collapse.
- Pushes: a drafter that serves new weights is another model, and what was measured of the old one does not
  hold for it: its acceptance restarts from the prior (`renew`), as at start-up, and a draw that picks it probes
  it. Why: a sidecar pushes a drafter distilled towards a policy that had left the old one behind, and that old
  one's collapsed counts only faded at the discount's pace: after a silent recovery, a scripted run re-used the
  drafter in 25-37 of the last 100 steps for some seeds.
Three rules keep exploration cheap: a new bucket starts with one plain step until two buckets have had one (a
plain step is never a costly mistake, and it separates the target's cost from the drafters' in the model;
after two, the line knows it, and a plain probe in every bucket was a third of the steps of a near-uniform
rollout's last few); a drafter whose acceptance is barely known (fewer than `probe_trials` trials at its first
position) is probed at the smallest k, which measures its acceptance as well as a deep k does at a fraction of
the price of a wrong guess; and no arm runs more than twice the deepest k its drafter has run, since the cost
of a deeper one is an extrapolation (a CPU verify of k + 1 positions at full batch costs nearly k + 1 decode
steps: a k = 6 guess there costs five steps).
A drafter's first step ever measures nothing: its model's first forwards.

Room: a row emits no more than its token budget leaves (max_tokens, max_model_len), so a draft past its tokens
left less one (its room) can only be verified, never emitted. The engine gives `choose` each row's room; an arm
is valued with each row's drafts within it, and the runner limits the drafts to it (`DraftProposal.limit`),
cutting a pass no row has room for in (none at all: a plain step). Why: valued as if every row drafted k, deep
arms looked best for the last steps of rows about to end, and their passes verified drafts no row could emit.

A drafter that proposes on the host (the suffix table) is asked before the choice: it says how many drafts it has
for each row (`proposals`). Such an arm is valued on what the step would verify: a row gets min(k, its proposal)
drafts, and the verify pass is cut to the longest proposal, so its cost is that of the shorter depth (the runner
cuts it; the cost is recorded for the depth that ran, `ran_k`); where the rows' drafts leave most of that pass
empty, the runner packs it (`packs`, speculative/passes.py) and the cost model counts the draft positions
computed, not the whole grid (`verify_tokens`: a table matching 8 rows of 64 adds 64 positions, not 512). Its
acceptance is the rate at which a proposed draft is accepted: a row the table has nothing for is no failure,
since the choice already knew it had nothing. Why: a table matches some rows and not others, and which ones
changes from step to step. Learned as one rate over all rows (what we had), it kept choosing the table for a last
tail sequence that had stopped matching, or wrote it off while half the batch matched.

A draft model's arm is also valued assisted by such a drafter (`Strategy.assist`): the draft model drafts k for
every row, and each row the table has enough drafts for (n or more, where min(k, n) of the table's drafts are
expected to yield more than the model's k) verifies the table's drafts instead. The table's drafts cost nothing
once the model's step runs, and the model keeps its cache current on every row. Why: a table covers some rows
well (repeats across a prompt's samples) and a draft model the rest; as separate arms the strategy had to pick
one of them for the whole batch, and each switch back to the model paid its catch-up. Each row's acceptance
goes to the drafter whose drafts it verified.

Host time: `choose` and `record` run between two forwards every step, and a one-row step of a small model lasts
about a millisecond, so per-row acceptance is tallied over distinct (accepted, drafted) pairs and a bucket's counts
are discounted when next read (same choices: tests/speculative/test_strategy_bookkeeping.py).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

from service.engine.speculative.arm_costs import ArmCosts
from service.engine.speculative.arms import PLAIN, Strategy, arm_of, bucket_of
from service.engine.speculative.catch_up import CatchUps
from service.engine.speculative.cost_model import StepCostModel
from service.engine.speculative.estimates import Acceptance
from service.engine.speculative.passes import cut_depth, verify_tokens
from service.engine.speculative.tokens import assisted_from, by_drafts, mean_from, mean_tokens


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
    fixed: Strategy | None = None  # set to pin one strategy (k = 0 pins plain decoding)
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
    _arms: tuple[tuple[tuple[str, ...], tuple[int, ...]], tuple[Strategy, ...]] | None = field(init=False, default=None)

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
    def arms(self) -> tuple[Strategy, ...]:
        key = (tuple(self.drafters), self.ks)
        if self._arms is None or self._arms[0] != key:  # built once: `choose` walks them every step
            self._arms = key, (PLAIN, *(Strategy(d, k) for d in self.drafters for k in self.ks))
        return self._arms[1]

    def acceptance(self, drafter: str, batch_size: int | None = None) -> list[float]:
        """Posterior mean acceptance per draft position (conditional on reaching it): pooled over batch sizes,
        or that of `batch_size`'s bucket."""
        bucket = bucket_of(batch_size) if batch_size else None
        return self.accept[drafter].rates(self.prior_alpha, self.prior_trials, bucket=bucket)

    def expected_tokens(self, s: Strategy, proposals: list[int] | None = None, batch_size: int | None = None) -> float:
        """Expected tokens per row; `proposals`: each row's proposal length, where the drafter knows it."""
        alpha = self.acceptance(s.drafter, batch_size) if s.k else None
        return mean_tokens(alpha, s.k, Counter(proposals) if proposals else None)

    def verified(self, s: Strategy, proposals: list[int] | None) -> Strategy:
        """The arm the runner runs for s: a verify pass cut to the longest proposal (none: plain), rounded up
        to a depth in `ks` where the runner replays captured CUDA graphs (`rounds_to_ks`)."""
        return s if not s.k or proposals is None else self._cut(s, max(proposals, default=0))

    def _cut(self, s: Strategy, longest: int) -> Strategy:
        """`verified` given the longest proposal."""
        if longest >= s.k:
            return s
        if not longest:
            return PLAIN
        return Strategy(s.drafter, cut_depth(longest, s.k, self.ks if self.rounds_to_ks else None))

    def predicted_cost(self, batch_size: int, s: Strategy, tokens: int | None = None) -> float:
        """Seconds of a step of arm s; `tokens`: the draft positions it verifies (default batch_size * k)."""
        return self.costs.predict(arm_of(batch_size, s), batch_size, tokens)

    def _tokens(self, s: Strategy, batch_size: int, rows: Counter[int] | None) -> int:
        """The draft positions arm s verifies, given its drafter's proposal length -> rows, where known."""
        if rows is None:
            return batch_size * s.k
        return verify_tokens(sum(c * min(s.k, n) for n, c in rows.items()), batch_size, s.k, self.pack_min_saved)

    def choose(self, batch_size: int, proposals: dict[str, list[int]] | None = None,
               room: list[int] | None = None, catch_up: dict[str, int] | None = None) -> Strategy:
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
        # (proposal, room) -> rows, per host drafter: what an assisted draft model's rows would verify
        hosts = {d: Counter(zip(n, room or [max(self.ks)] * len(n), strict=True))
                 for d, n in proposals.items() if n and d in alpha}
        longest = {d: max(n, default=0) for d, n in caps.items()}
        for arm in self.arms:
            s = arm if arm.drafter not in longest else self._cut(arm, longest[arm.drafter])
            if s in seen:
                continue  # a cut verify: the same step as a shallower arm
            seen.add(s)
            if s.k > 2 * self._deepest.get(s.drafter, self.ks[0]):
                continue  # deeper than twice the deepest measured k: its cost is an extrapolation
            width = self._tokens(s, batch_size, rows.get(s.drafter)) if s.k else 0
            cost = self.costs.draw((bucket, s.drafter, s.k), batch_size, width, self._rng)
            tokens = mean_from(tables[s.drafter], s.k, rows.get(s.drafter)) if s.k else 1.0
            if s.k and s.drafter not in proposals:  # a draft model: assisted by a host drafter where it pays
                for host, pairs in hosts.items():
                    more, n = assisted_from(tables[s.drafter], s.k, tables[host], pairs)
                    if n is not None and more > tokens:
                        tokens, s = more, Strategy(s.drafter, s.k, (host, n))
            if s.k and catch_up and catch_up.get(s.drafter):
                left = (steps_left or math.inf) / tokens  # at this arm's pace: its longest budget over a step's tokens
                cost += self.catch_ups.charge(s.drafter, catch_up[s.drafter], bucket, left)
            if tokens / cost > best_value:
                best, best_value = s, tokens / cost
        if best.k and self.barely_known(best.drafter):
            # A draw picked it because it may be good. Probe it at the smallest k, which measures its acceptance
            # as well and costs least if the draw was wrong.
            return Strategy(best.drafter, min(best.k, self.ks[0]))
        return best

    def barely_known(self, drafter: str) -> bool:
        """Its acceptance was never measured, or not for a long while: a choice of it is a probe."""
        return self.accept[drafter].trials[0] < self.probe_trials

    def _caps(self, proposals: dict[str, list[int]], room: list[int] | None) -> dict[str, list[int]]:
        """Per drafter, the most drafts each row would verify: its proposal (host drafters) within the row's
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

    def record(self, s: Strategy, batch_size: int, seconds: float | None, num_accepted: list[int] | None = None,
               ran_k: int | None = None, num_drafted: list[int] | None = None,
               assisted: list[bool] | None = None, caught_up: tuple[int, float] = (0, 0.0),
               shadow: dict[str, list[tuple[int, int]]] | None = None) -> None:
        """One step's measurement: its wall seconds (None: not a measure of its cost, e.g. it captured a CUDA
        graph), num_accepted and num_drafted (default: k) per row for speculative steps, `ran_k`, the depth
        verified when the runner cut the verify pass to the longest proposal, `assisted`, the rows that
        verified the drafts of `s.assist`'s host drafter, `caught_up`: the tokens the drafter fed to catch
        up before drafting (what `choose` was told) and their seconds, part of `seconds`, and `shadow`: per
        host drafter, (num_accepted, num_drafted) of the rows whose drafts this step did not verify, set
        against the tokens they emitted (speculative/shadow.py)."""
        drafter = s.drafter if s.k else None
        # A new bucket's plain probe does not end a stay.
        self.catch_ups.step(self.drafters, drafter, bucket_of(batch_size), not self.probes_plain(batch_size))
        tokens, catch_seconds = caught_up
        if drafter is not None:
            self.catch_ups.paid(drafter, tokens, catch_seconds)
        # A drafter's first step ever (first forwards of its model) is no measure of its arm.
        if seconds is not None and (drafter is None or drafter in self._deepest):
            ran = s if ran_k is None or ran_k == s.k else Strategy(s.drafter, ran_k) if ran_k else PLAIN
            width = batch_size * ran.k
            if ran.k and num_drafted:
                drafted = sum(min(n, ran.k) for n in num_drafted)
                width = verify_tokens(drafted, batch_size, ran.k, self.pack_min_saved)
            self.costs.record(arm_of(batch_size, ran), batch_size, seconds - catch_seconds, width)
        if drafter is not None:
            ran_with = [drafter] + ([s.assist[0]] if s.assist and assisted and any(assisted) else [])
            for d in ran_with:  # an assisting host's drafts were verified at k too
                self._deepest[d] = max(self._deepest.get(d, 0), s.k)
        if drafter is None:
            self._plain_buckets.add(bucket_of(batch_size))
        for a in self.accept.values():
            a.fade(self.discount)
        by_drafter: dict[str, list[tuple[int, int]]] = {}
        if drafter is not None and num_accepted:
            drafted = num_drafted or [s.k] * len(num_accepted)
            host = s.assist[0] if s.assist and assisted else None
            for i, row in enumerate(zip(num_accepted, drafted, strict=True)):
                by_drafter.setdefault(host if host is not None and assisted[i] else drafter, []).append(row)
        for d, rows in (shadow or {}).items():
            if d in self.accept:
                by_drafter.setdefault(d, []).extend(rows)
        for d, rows in by_drafter.items():
            self.accept[d].observe_rows(rows, self.trials_per_step, bucket_of(batch_size))
