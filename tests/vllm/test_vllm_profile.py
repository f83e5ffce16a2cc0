"""The start-up profile's arithmetic (no timing): a striped table gives every (bucket, k) its own batch size, and
the chosen table follows tokens per second from scripted step costs and acceptance."""

from __future__ import annotations

import random

import pytest

from service.vllm.config import check_table
from service.vllm.profile import Profile, bucket_sizes, candidate_ks, striped_table, table_from


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 64, 256])
def test_striped_table_covers_every_batch_size_once(max_num_seqs):
    ks = candidate_ks(4)
    assert ks == [0, 1, 2, 4]
    rows, points = striped_table(bucket_sizes(max_num_seqs, len(ks)), ks, max_num_seqs)
    check_table(rows, 4)  # consecutive, starting at 1
    assert rows[0][0] == 1 and rows[-1][1] == max_num_seqs
    lookup = {b: k for lo, hi, k in rows for b in range(lo, hi + 1)}
    assert all(lookup[b] == k for b, k in points) and len({b for b, _ in points}) == len(points)
    assert {k for _, k in points} == set(ks[:max_num_seqs])


def scripted(verify_cost: float, draft_cost: float, acceptance: tuple[float, ...]) -> Profile:
    """Step seconds = fixed cost + per-token verify cost + per-draft-position cost, at buckets 1, 8, 64."""
    return Profile({(b, k): 1e-3 + verify_cost * b * (k + 1) + draft_cost * k * (1 + b / 16)
                    for b in (1, 8, 64) for k in (0, 1, 2, 4)}, acceptance)


def test_table_goes_deep_in_the_tail_and_off_when_the_batch_is_full():
    profile = scripted(verify_cost=1.5e-4, draft_cost=1e-4, acceptance=(0.9, 0.8, 0.7, 0.6))
    rows = table_from(profile, [0, 1, 2, 4], 64)
    check_table(rows, 4)
    k_at = {b: k for lo, hi, k in rows for b in range(lo, hi + 1)}
    assert k_at[1] == 4 and k_at[64] == 0
    assert all(k_at[b] >= k_at[b + 1] for b in range(1, 64))  # never deeper as the batch grows
    for b in (1, 20, 64):  # the chosen k is the best measured trade-off at that size
        model = profile.cost_model()
        best = max((profile.tokens_per_step(k) / model.seconds(b, k), k) for k in (0, 1, 2, 4))
        assert k_at[b] == best[1]


def test_no_speculation_where_drafts_are_rejected():
    rows = table_from(scripted(verify_cost=2e-5, draft_cost=1e-4, acceptance=(0.0, 0.0, 0.0, 0.0)), [0, 1, 2, 4], 64)
    assert rows == [(1, 64, 0)]


def test_profile_round_trips_through_its_cache_format():
    profile = scripted(1e-5, 1e-4, (0.5, 0.25, 0.1, 0.0))
    assert Profile.from_json(profile.to_json()) == profile


def test_cost_model_predicts_unmeasured_sizes_and_depths():
    verify, draft = 1.5e-4, 1e-4
    model = scripted(verify, draft, (0.5,) * 4).cost_model()
    for b, k in ((4, 2), (20, 3), (200, 4)):  # between buckets, an unmeasured k, beyond the largest bucket
        assert model.seconds(b, k) == pytest.approx(1e-3 + verify * b * (k + 1) + draft * k * (1 + b / 16))


def test_noisy_measurements_still_give_a_monotone_table():
    """Each point off by up to 10% (a few dozen steps per point): one model over all points keeps the table
    deep in the tail, never deeper as the batch grows, and within 10% of the best k's true throughput at every
    batch size (a per-point argmax flipped k between neighbouring buckets on the vLLM bench)."""
    rng = random.Random(0)
    exact = scripted(verify_cost=1.5e-4, draft_cost=1e-4, acceptance=(0.9, 0.8, 0.7, 0.6))
    truth = exact.cost_model()

    def rate(b: int, k: int) -> float:
        return exact.tokens_per_step(k) / truth.seconds(b, k)

    for _ in range(50):
        noisy = Profile({p: t * rng.uniform(0.9, 1.1) for p, t in exact.step_seconds.items()}, exact.acceptance)
        k_at = {b: k for lo, hi, k in table_from(noisy, [0, 1, 2, 4], 64) for b in range(lo, hi + 1)}
        assert k_at[1] == 4
        assert all(k_at[b] >= k_at[b + 1] for b in range(1, 64))
        assert all(rate(b, k_at[b]) >= 0.9 * max(rate(b, k) for k in (0, 1, 2, 4)) for b in range(1, 65))


def test_one_batch_size_is_enough_to_choose():
    """max_num_seqs = 1: every point at b = 1, the fit is underdetermined and still picks the best k there."""
    profile = Profile({(1, k): 1e-3 + k * 2e-4 for k in (0, 1, 2, 4)}, (0.9, 0.8, 0.7, 0.6))
    assert table_from(profile, [0, 1, 2, 4], 1) == [(1, 1, 4)]


def test_drafts_never_look_free():
    """A profile whose per-draft cost falls with the batch (noise on a tiny model, where every step costs about
    the same): the fit must not let drafts become free at large batches, or an almost never accepted drafter
    would be run deepest where the batch is full."""
    tilted = {(b, k): 1e-3 + k * (1.2e-4 - 4e-7 * b) for b in (1, 8, 64, 250) for k in (0, 1, 2, 3)}
    profile = Profile(tilted, (0.03, 0.001, 0.0))
    model = profile.cost_model()
    assert model.v >= 0 and model.c >= 0
    assert all(model.seconds(b, 1) > model.seconds(b, 0) for b in (1, 100, 256))
    assert table_from(profile, [0, 1, 2, 3], 256) == [(1, 256, 0)]
