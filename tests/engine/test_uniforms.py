"""The counter-based uniforms, against a plain-Python recompute of the documented hash, and verification's draws:
each row's uniforms are a function of (seed, output position, stream) alone, however they are batched."""

from __future__ import annotations

from dataclasses import replace

import torch

from service.engine.batch_tensors import DraftProposal, SamplingBatch
from service.engine.randomness import STREAM_ACCEPT, STREAM_SAMPLE, seed_keys, uniforms
from service.engine.sampler import draw_draft, process_logits, sample, verify

M32 = 0xFFFFFFFF


def mix32(x: int) -> int:
    x &= M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & M32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & M32
    return x ^ (x >> 16)


def reference(seed: int, counter: int, stream: int) -> float:
    """The uniform for (seed, counter, stream) as sampler.py documents it, in Python integers."""
    h = mix32((seed >> 32) + 0x9E3779B9)
    h = mix32(h ^ (seed & M32))
    h = mix32(h ^ (counter & M32))
    h = mix32(h ^ (counter >> 32) ^ ((stream * 0x85EBCA6B) & 0xFFFFFFFFFFFFFFFF))
    return ((h >> 8) + 0.5) / 2**24


def test_uniforms_match_the_hash_for_any_seed_counter_and_stream():
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**62), 2**62, (64,), generator=gen)
    seeds[:4] = torch.tensor([0, -1, 2**63 - 1, -(2**63)])
    counters = torch.randint(0, 2**40, (64, 5), generator=gen)  # past 2^32 too: both halves of a counter count
    keys = seed_keys(seeds)
    for stream in (0, 1, 2):
        got = uniforms(keys, counters, stream)
        want = [[reference(s, c, stream) for c in row] for s, row in zip(seeds.tolist(), counters.tolist(),
                                                                          strict=True)]
        assert torch.equal(got, torch.tensor(want, dtype=torch.float32))
        assert torch.equal(uniforms(keys, counters[:, 0], stream), got[:, 0])  # one column per row: the same
    streams = torch.tensor([0, 1, 2, 1, 0])  # a stream per column: as if each column were drawn on its own
    mixed = uniforms(keys, counters, streams)
    for j, stream in enumerate(streams.tolist()):
        assert torch.equal(mixed[:, j], uniforms(keys, counters[:, j], stream))


def batch(rows: int, vocab: int, filters: str) -> SamplingBatch:
    """Rows at temperatures around 1 with the filters named in `filters` ("k", "p", "m": top-k, top-p, min-p)."""
    gen = torch.Generator().manual_seed(rows)
    return SamplingBatch(
        temperature=torch.rand(rows, generator=gen) + 0.5, greedy=torch.zeros(rows, dtype=torch.bool),
        top_p=torch.full((rows,), 0.9 if "p" in filters else 1.0),
        top_k=torch.tensor([7, 3, vocab, 9, 7, 20][:rows] if "k" in filters else [vocab] * rows),
        min_p=torch.full((rows,), 0.02 if "m" in filters else 0.0),
        seed_keys=seed_keys(torch.randint(0, 2**62, (rows,), generator=gen)),
        counters=torch.randint(0, 500, (rows,), generator=gen), use_top_k="k" in filters,
        use_top_p="p" in filters, use_min_p="m" in filters, all_greedy=False, need_raw=False, num_top_logprobs=0,
    )


def test_a_row_without_drafts_emits_what_plain_sampling_would():
    """Verification with no drafts samples each row's first position from p with the row's own uniform for that
    output position: the token and logprob plain decoding gives, whatever the other rows drafted."""
    vocab, k = 41, 3
    for filters in ("", "k", "p", "m", "kpm"):
        sb = batch(6, vocab, filters)
        logits = torch.randn(6, k + 1, vocab, generator=torch.Generator().manual_seed(1)) * 3
        lengths = torch.tensor([0, 0, 0, 3, 1, 0])  # rows 0-2 and 5 drafted nothing
        tokens = torch.randint(0, vocab, (6, k), generator=torch.Generator().manual_seed(2))
        res = verify(logits, DraftProposal(tokens, lengths, None), sb)
        plain = sample(logits[:, 0].contiguous(), sb)
        for row in (0, 1, 2, 5):
            assert res.num_accepted[row] == 0
            assert res.tokens[row, 0] == plain.tokens[row]
            assert res.sample.logprobs[row * (k + 1)] == plain.logprobs[row]
        # [B, K, V] logits are processed with each row's parameters at every position, as [B * K, V] rows would be
        flat = process_logits(logits.reshape(-1, vocab), batch_rows(sb, k + 1))
        assert torch.equal(process_logits(logits, sb), flat.view(6, k + 1, vocab))


def batch_rows(sb: SamplingBatch, times: int) -> SamplingBatch:
    """Each row's parameters repeated `times` times (rows of [N, times, V] flattened)."""
    r = lambda t: t.repeat_interleave(times)
    return SamplingBatch(r(sb.temperature), r(sb.greedy), r(sb.top_p), r(sb.top_k), r(sb.min_p), r(sb.seed_keys),
                         r(sb.counters), sb.use_top_k, sb.use_top_p, sb.use_min_p, sb.all_greedy, sb.need_raw,
                         sb.num_top_logprobs)


def test_the_accept_and_sample_streams_differ():
    keys = seed_keys(torch.tensor([5]))
    counters = torch.tensor([[10]])
    assert not torch.equal(uniforms(keys, counters, STREAM_ACCEPT), uniforms(keys, counters, STREAM_SAMPLE))


def test_skipping_the_argmax_and_the_unit_division_changes_no_draw():
    """A batch at temperature 1 without greedy rows, as `SamplingBatch.build` flags it, samples, drafts and verifies
    exactly as with nothing skipped."""
    vocab, k = 53, 4
    gen = torch.Generator().manual_seed(7)
    skip = replace(batch(5, vocab, ""), temperature=torch.ones(5), any_greedy=False, unit_temperature=True)
    full = replace(skip, any_greedy=True, unit_temperature=False)
    logits = torch.randn(5, k + 1, vocab, generator=gen) * 3
    probs = torch.softmax(torch.randn(5, k, vocab, generator=gen), -1)
    draft = DraftProposal(torch.randint(0, vocab, (5, k), generator=gen), torch.tensor([4, 0, 2, 4, 1]), probs)
    a, b = verify(logits, draft, skip), verify(logits, draft, full)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.sample.logprobs, b.sample.logprobs)
    assert torch.equal(sample(logits[:, 0], skip).tokens, sample(logits[:, 0], full).tokens)
    for x, y in zip(draw_draft(logits[:, 1], skip, 1), draw_draft(logits[:, 1], full, 1), strict=True):
        assert torch.equal(x, y)
