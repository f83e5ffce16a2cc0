"""The adaptive strategy's per-step bookkeeping against its plain definitions (no torch)."""

from __future__ import annotations

import random

import pytest

from service.engine.speculative.estimates import Acceptance


def _eager_add(ref: dict[int, tuple[list[float], list[float]]], bucket: int, hits: list[int], trials: list[int],
               per_step: float) -> None:
    scale = min(1.0, per_step / max(trials[0], 1))
    own = ref.setdefault(bucket, ([0.0] * len(hits), [0.0] * len(hits)))
    for j, (h, t) in enumerate(zip(hits, trials, strict=True)):
        own[0][j] += h * scale
        own[1][j] += t * scale


@pytest.mark.parametrize("seed", [0, 1])
def test_bucket_counts_discounted_when_read_equal_counts_discounted_every_step(seed: int) -> None:
    rng = random.Random(seed)
    acc = Acceptance.empty(4, bucket_trials=1e9)  # a huge prior: no step looks like a collapse
    ref: dict[int, tuple[list[float], list[float]]] = {}
    keep = 0.99
    for step in range(400):
        if step == 250:
            keep = 0.9  # a new discount applies from its first fade on
        acc.fade(keep)
        for hits, trials in ref.values():
            hits[:] = [h * keep for h in hits]
            trials[:] = [t * keep for t in trials]
        if rng.random() < 0.7:
            bucket = rng.choice([1, 2, 8, 64])
            trials = [rng.randint(1, 70)]
            for _ in range(3):
                trials.append(rng.randint(0, trials[-1]))
            hits = [trials[j + 1] if j + 1 < 4 else rng.randint(0, trials[3]) for j in range(4)]
            acc.observe(hits, trials, 48.0, bucket)
            _eager_add(ref, bucket, hits, trials, 48.0)
        if step % 37 == 0:  # read some buckets now and then, as the strategy's choices do
            for bucket in sorted(ref)[: 1 + step % 3]:
                acc.rates(0.6, 2.0, bucket=bucket)
    assert sorted(acc.buckets) == sorted(ref)
    for bucket, (hits, trials) in ref.items():
        got_hits, got_trials = acc._bucket(bucket)
        assert got_hits == pytest.approx(hits, rel=1e-9, abs=1e-12)
        assert got_trials == pytest.approx(trials, rel=1e-9, abs=1e-12)


class _Recorder(Acceptance):
    __slots__ = ("seen",)

    def observe(self, hits: list[int], trials: list[int], trials_per_step: float, bucket: int = 0) -> None:
        self.seen = (hits, trials)


def test_per_row_counts_follow_their_definition() -> None:
    rng = random.Random(3)
    for _ in range(200):
        rows = []
        for _ in range(rng.randint(1, 64)):
            drafted = rng.randint(0, 8)
            rows.append((rng.randint(0, drafted), drafted))
        acc = _Recorder([0.0] * 8, [0.0] * 8)
        acc.seen = None
        acc.observe_rows(rows, 48.0, 4)
        depth = max(m for _, m in rows)
        # Draft j + 1: tried by rows that accepted j drafts and proposed more than j, accepted by those that
        # accepted more than j.
        hits = [sum(1 for n, _ in rows if n > j) for j in range(depth)]
        trials = [sum(1 for n, m in rows if n >= j and m > j) for j in range(depth)]
        assert acc.seen == ((hits, trials) if depth and trials[0] else None)
