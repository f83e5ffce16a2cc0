"""The start-up profile's arithmetic (no timing): a striped table gives every (bucket, k) its own batch size, and
the chosen table follows tokens per second from scripted step costs and acceptance."""

from __future__ import annotations

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
        best = max((profile.tokens_per_step(k) / profile.seconds(b, k), k) for k in (0, 1, 2, 4))
        assert k_at[b] == best[1]


def test_no_speculation_where_drafts_are_rejected():
    rows = table_from(scripted(verify_cost=2e-5, draft_cost=1e-4, acceptance=(0.0, 0.0, 0.0, 0.0)), [0, 1, 2, 4], 64)
    assert rows == [(1, 64, 0)]


def test_profile_round_trips_through_its_cache_format():
    profile = scripted(1e-5, 1e-4, (0.5, 0.25, 0.1, 0.0))
    assert Profile.from_json(profile.to_json()) == profile
    assert profile.seconds(4, 2) == pytest.approx((profile.seconds(1, 2) * 4 + profile.seconds(8, 2) * 3) / 7)
