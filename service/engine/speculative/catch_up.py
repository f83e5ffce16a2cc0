"""What a switch to a draft model costs before it drafts: the tokens it missed, fed to it first. Torch-free.

Before a step each drafter says how many tokens it would feed beyond its own steps (`Drafter.catch_up`), and the
step reports how long those took. The catch-up is kept out of the arm's cost (one costly catch-up would write the
arm off) and learned apart, as seconds per token, each catch-up weighing by its tokens.

It is charged to the arms that would pay it, spread over the steps the switch is expected to last (`horizon`):
the drafter's recent stays, or its absence where the batch has drained into another bucket, never more steps than
the batch has left at the arm's pace. docs/design-notes.md gives the reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.engine.speculative.estimates import Ewma, Ratio


@dataclass(slots=True)
class _LastRun:
    steps_ago: int = 0  # steps since the drafter last ran
    bucket: int | None = None  # the batch bucket it last ran in (None: never ran)
    began: dict[int, int] = field(default_factory=dict)  # per bucket, how long its last stay begun there lasted


@dataclass(slots=True)
class CatchUps:
    horizon_cap: float = 32.0  # a catch-up is spread over at most this many steps of the new arm
    rate: float = 0.3  # EWMA rate of the stays and the price
    stays: dict[str, Ewma] = field(default_factory=dict)  # steps a drafter ran in a row once switched to
    price: dict[str, Ratio] = field(default_factory=dict)  # seconds per token a drafter catches up on
    _last: dict[str, _LastRun] = field(default_factory=dict)
    _stay_of: str | None = None  # the drafter (None: plain) of the steps run in a row lately
    _run: int = 0  # how many
    _run_from: int = 0  # the bucket the first of them ran in

    def step(self, drafters: list[str], ran: str | None, bucket: int, ends_stay: bool) -> None:
        """A step ran drafter `ran` (None: plain) in `bucket`; `ends_stay`: False for a step that does not end
        a stay (a new bucket's plain probe)."""
        if ends_stay or ran is not None:
            stayed = self._stay_of
            if ran != stayed:
                if stayed is not None:
                    self.stays.setdefault(stayed, Ewma()).update(self._run, self.rate)
                    self._last[stayed].began[self._run_from] = self._run
                self._run, self._stay_of, self._run_from = 0, ran, bucket
            self._run += 1
        for d in drafters:
            last = self._last.get(d)
            if last is None:
                last = self._last[d] = _LastRun()
            last.steps_ago = 0 if d == ran else last.steps_ago + 1
            if d == ran:
                last.bucket = bucket

    def paid(self, drafter: str, tokens: int, seconds: float) -> None:
        """A step's drafter fed `tokens` to catch up, in `seconds`."""
        if tokens > 0:
            self.price.setdefault(drafter, Ratio()).update(seconds, tokens, self.rate)

    def charge(self, drafter: str, tokens: int, bucket: int, steps_left: float) -> float:
        """Seconds per step that a switch to `drafter` adds in `bucket`, where it would feed `tokens` and the
        batch has `steps_left` steps at the arm's pace. Unmeasured: nothing (the next step tells)."""
        price = self.price.get(drafter)
        per_token = (price.value if price is not None else None) or 0.0
        return per_token * tokens / min(self.horizon(drafter, bucket), max(steps_left, 1.0))

    def horizon(self, drafter: str, bucket: int) -> float:
        """Steps a switch's catch-up is spread over. A switch pays only if the stay pays it back. Spread over a
        fixed 32 steps, it looked cheap to Thompson draws among near-tied arms, which switched every few steps and
        paid a catch-up each time (5% of a near-uniform rollout). A drafter away for long from a bucket the batch
        has since left is charged over its absence: conditions changed, and if it wins now it is likely to stay;
        charged by its old short stays it would be locked out. Away as long in the same bucket, it lost there to
        arms near-tied with it, and a draw that picks it now is noise: charged over its absence, a near-uniform
        rollout switched back to the draft model after 30 steps of a suffix table at full batch and paid 0.6-1 s
        (7-10% of the run) to feed it 3,000 tokens, for a step or two. Where it was switched to in this bucket
        before (in this rollout or an earlier one), how long that stay lasted is what a switch here is expected to
        last, wherever the batch drained to meanwhile: in GRPO (bench/e2e.py) every step's batch drains through the
        same buckets, so each bucket looked newly entered, and a draft model that lost to the suffix table in all of
        them was re-tried in each, paying ~400 tokens of catch-up for a step or two; keyed by where its stays ended,
        the tail's 1-2 row buckets, which a batch leaves at every finished row, forgot each loss at once."""
        stay = self.stays.get(drafter)
        longest = stay.value if stay is not None and stay.value is not None else self.horizon_cap
        last = self._last.get(drafter)
        if last is not None and bucket in last.began:
            longest = last.began[bucket]
        elif last is not None and last.bucket not in (None, bucket):
            longest = max(longest, last.steps_ago)
        return min(max(longest, 1.0), self.horizon_cap)
