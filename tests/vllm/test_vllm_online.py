"""Online speculation depth on vLLM (no timing, no vLLM): scripted acceptance drives `OnlineDepth` the way vLLM's
scheduler does (one `step()` per engine step, one `observe()` per verified draft), and the lookup follows it."""

from __future__ import annotations

import random

import pytest

from service.vllm.online import CostModel, OnlineDepth, best_depths, rows_of

KS = [0, 1, 2, 4]
# Step cost of a memory-bound verify (scripted): cheap drafts next to the fixed cost in the tail, expensive at 64.
COST = CostModel(a=1e-3, c=1.5e-4, u=1e-4, v=1.56e-4, floor=1e-3)


def run(depth: OnlineDepth, batch: int, steps: int, accept: float, rng: random.Random) -> list[int]:
    """`steps` engine steps at `batch` sequences, each draft position accepted with probability `accept`
    (independently, so all of 0..j with accept^(j+1)); returns the k scheduled at each step."""
    ks = []
    for _ in range(steps):
        k = depth.step()[batch]
        ks.append(k)
        for _ in range(batch if k else 0):
            n = 0
            while n < k and rng.random() < accept:
                n += 1
            depth.observe(k, n)
    return ks


def test_settings_round_trip_and_start_from_the_profile():
    depth = OnlineDepth(COST, KS, 64, (0.9, 0.8, 0.7, 0.6))
    again = OnlineDepth.from_json(depth.to_json())
    assert again.lookup == depth.lookup == best_depths(COST, (0.9, 0.8, 0.7, 0.6), KS, 64)
    assert depth.lookup[1] == 4 and depth.lookup[64] < 4
    with pytest.raises(ValueError):
        OnlineDepth(COST, [], 64, ())


def test_an_underestimated_drafter_gets_deeper_where_it_pays():
    """The profile measured acceptance 0.5 on synthetic prompts; the workload accepts 0.95: within 40 steps at
    batch 4 the lookup there is the one exact acceptance would give, and deeper than it started."""
    rng = random.Random(0)
    depth = OnlineDepth(COST, KS, 64, tuple(0.5 ** (j + 1) for j in range(4)))
    start = list(depth.lookup)
    assert start[4] > 0  # drafts flow at batch 4, so there is something to learn from
    run(depth, 4, 40, 0.95, rng)
    exact = best_depths(COST, [0.95 ** (j + 1) for j in range(4)], KS, 64)
    assert depth.lookup[4] == exact[4] > start[4]
    assert depth.acceptance()[0] == pytest.approx(0.95, abs=0.05)


def test_collapse_turns_speculation_off_and_a_probe_brings_it_back():
    """A policy push without its drafter: acceptance drops to 0. At a full batch k falls to 0 within a few steps;
    once the batch drains, the tail stops drafting too. The drafter is pushed and accepts again: a probe step
    sees it and the table deepens again."""
    rng = random.Random(1)
    depth = OnlineDepth(COST, KS, 64, (0.9, 0.8, 0.7, 0.6), probe_every=16)
    assert run(depth, 32, 1, 0.9, rng)[0] > 0
    collapse = run(depth, 32, 8, 0.0, rng)
    assert collapse.index(0) <= 3 and not any(collapse[3:])
    tail = run(depth, 2, 12, 0.0, rng)
    assert sum(1 for k in tail if k) <= 1 and depth.lookup[2] == 0 and depth.acceptance()[0] < 0.3  # a probe at most
    recovered = run(depth, 2, 60, 0.9, rng)
    first = next(i for i, k in enumerate(recovered) if k)
    assert first < 16  # the probe
    assert all(recovered[-5:]) and depth.lookup[1] >= 2 and depth.acceptance()[0] > 0.5


def test_a_push_restarts_from_the_profile():
    """Collapsed at one row (k = 0 there, a probe every 64 steps), a recovered drafter is drafted with in at most
    one step of 60 (a probe, one draft, against the collapsed counts); a push renews the counts, and the very
    next step drafts at the profile's k again."""
    rng = random.Random(3)
    depth = OnlineDepth(COST, KS, 64, (0.9, 0.8, 0.7, 0.6))
    start = list(depth.lookup)
    run(depth, 1, 40, 0.0, rng)
    assert depth.lookup[1] == 0 and sum(1 for k in run(depth, 1, 60, 0.9, rng) if k) <= 1
    depth.renew()
    assert depth.lookup == start and depth.acceptance() == pytest.approx([0.9 ** (j + 1) for j in range(4)])
    assert all(run(depth, 1, 20, 0.9, rng)) and depth.lookup[1] == start[1] > 0


def test_no_probe_while_drafts_flow():
    rng = random.Random(2)
    depth = OnlineDepth(COST, KS, 64, (0.9, 0.8, 0.7, 0.6), probe_every=4)
    for _ in range(50):
        lookup = depth.step()
        assert lookup is depth.lookup  # never a probe lookup: every step drafted
        depth.observe(4, rng.randint(0, 4))


def test_rows_of_merges_equal_depths():
    assert rows_of([0, 4, 4, 2, 2, 2, 0]) == [(1, 2, 4), (3, 5, 2), (6, 6, 0)]
