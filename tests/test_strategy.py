"""The adaptive strategy on a scripted long-tail workload with a known cost model (no timing, no torch)."""

from __future__ import annotations

import random

from service.strategy import PLAIN, AdaptiveStrategy, Strategy, bucket_of


def step_cost(batch: int, k: int) -> float:
    """A GPU-like cost: a fixed launch/weight-read part, compute growing with batch * (k + 1), draft work."""
    return 1.0 + 0.1 * batch * (k + 1) + 0.05 * k


def accepted_counts(batch: int, k: int, alpha: float, rng: random.Random) -> list[int]:
    out = []
    for _ in range(batch):
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        out.append(a)
    return out


def run(strategy: AdaptiveStrategy, schedule: list[tuple[int, float]], seed: int = 0) -> list[Strategy]:
    rng = random.Random(seed)
    chosen = []
    for batch, alpha in schedule:
        s = strategy.choose(batch)
        acc = accepted_counts(batch, s.k, alpha, rng) if s.k else None
        strategy.record(s, batch, step_cost(batch, s.k), acc)
        chosen.append(s)
    return chosen


def test_plain_when_full_deep_in_the_tail_and_back_off_on_collapse():
    strategy = AdaptiveStrategy(["draft"], seed=1)
    # A rollout draining from 64 sequences to 1, then the drafter going stale (acceptance collapses).
    phases = [(64, 0.8, 150), (16, 0.8, 100), (4, 0.8, 100), (1, 0.8, 150), (1, 0.05, 150)]
    schedule = [(b, a) for b, a, n in phases for _ in range(n)]
    chosen = run(strategy, schedule)
    by_phase, i = [], 0
    for _, _, n in phases:
        by_phase.append(chosen[i + n // 3 : i + n])  # after a short warm-up per phase
        i += n
    full, _, _, tail, stale = by_phase
    assert sum(s.k <= 1 for s in full) >= 0.8 * len(full)  # off or shallow while the batch is full
    assert sum(s == PLAIN for s in full) >= 0.6 * len(full)
    mean_k = sum(s.k for s in tail) / len(tail)
    assert mean_k >= 3 and sum(s.k >= 3 for s in tail) >= 0.7 * len(tail)  # deep in the long tail
    assert sum(s == PLAIN for s in stale) >= 0.8 * len(stale)  # backs off when acceptance collapses


def test_recovers_when_acceptance_comes_back():
    strategy = AdaptiveStrategy(["draft"], seed=2)
    schedule = [(2, 0.05)] * 150 + [(2, 0.9)] * 300
    chosen = run(strategy, schedule)
    assert sum(s.k >= 3 for s in chosen[-100:]) >= 80  # exploration found the drafter useful again


def test_fixed_and_no_drafter():
    assert AdaptiveStrategy([]).choose(3) == PLAIN
    pinned = Strategy("suffix", 5)
    assert AdaptiveStrategy(["suffix"], fixed=pinned).choose(64) == pinned
    assert [bucket_of(b) for b in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]


def test_draft_cost_is_learned_per_drafter() -> None:
    s = AdaptiveStrategy(["suffix", "draft"], explore=0.0)
    s.record(PLAIN, 8, 1.0)
    for _ in range(5):
        s.record(Strategy("suffix", 2), 8, 1.1, [2] * 8)  # a model-free drafter: an extra position is cheap
        s.record(Strategy("draft", 2), 8, 3.0, [2] * 8)  # a draft model: each position costs a forward
    assert s.predicted_cost(8, Strategy("suffix", 6)) < 1.5 < 5.0 < s.predicted_cost(8, Strategy("draft", 6))
    assert s.choose(8).drafter == "suffix"  # same acceptance, far cheaper


def test_exploration_reaches_every_arm() -> None:
    s = AdaptiveStrategy(["suffix", "draft"], explore=0.5, seed=1)
    s.record(PLAIN, 4, 1.0)
    picked = {s.choose(4) for _ in range(2000)}
    assert picked == set(s.arms)
