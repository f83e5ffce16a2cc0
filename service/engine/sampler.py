"""Sampling and lossless speculative verification, vectorised over rows with per-row parameters.

Processing (the distribution a token is drawn from, and whose logprob we return): penalties
(engine/penalties.py) -> logits / temperature -> keep top_k -> keep the smallest set with mass >= top_p -> drop
p < min_p * p_max -> renormalise. Greedy rows (temperature 0) take the argmax of the penalised logits. Every
random draw is counter-based (engine/randomness.py).
Verification: drafts x_1..x_k were drawn from q_1..q_k (one-hot for deterministic drafters), the target gave
p_1..p_{k+1}, processed as in plain decoding (a penalised row's p_j counts the drafts before position j). Accept
x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection draw from normalize(max(0, p_j - q_j));
if all k are accepted draw a bonus token from p_{k+1}. A position past a row's drafts is a rejection with q = 0:
the residual is p, and the row samples as plain decoding does there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from service.engine.batch_tensors import DraftProposal, SamplingBatch
from service.engine.randomness import STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE, uniforms


def process_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """float32 logits [N, V] or [N, K, V] (row n's parameters for all K) -> processed logprobs, same shape
    (-inf outside the kept set)."""
    col = lambda t: t[(..., *(None,) * (logits.dim() - 1))]
    scaled = logits if sb.all_greedy or sb.unit_temperature else logits / col(sb.temperature)
    if sb.use_top_k or sb.use_top_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)
        drop = (rank >= col(sb.top_k)).expand(scaled.shape)  # [N, (K,) V] in sorted order
        if sb.use_top_p:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
            mass_before = probs.cumsum(-1) - probs
            drop = drop | (mass_before >= col(sb.top_p))
        unsorted = torch.zeros(scaled.shape, dtype=torch.bool, device=scaled.device).scatter_(-1, order, drop)
        scaled = scaled.masked_fill(unsorted, float("-inf"))
    if sb.use_min_p:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < col(sb.min_p) * probs.amax(-1, keepdim=True), float("-inf"))
    return scaled.log_softmax(-1)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (unnormalised is fine), u [N] in (0, 1) -> token ids [N]."""
    cdf = probs.cumsum(-1)
    target = u[:, None] * cdf[:, -1:]
    return (cdf < target).sum(-1).clamp_(max=probs.shape[-1] - 1)


@dataclass(slots=True)
class SampleResult:
    tokens: torch.Tensor  # [N] long
    logprobs: torch.Tensor  # [N] processed logprob of the token
    raw_logprobs: torch.Tensor | None  # [N]
    top_ids: torch.Tensor | None  # [N, K]
    top_values: torch.Tensor | None  # [N, K]


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleResult:
    """Draw one token per row from float32 logits [N, V]."""
    penalised = sb.penalised(logits)
    logprobs = process_logits(penalised, sb)
    if sb.all_greedy:
        tokens = penalised.argmax(-1)
    else:
        drawn = sample_from(logprobs.exp(), uniforms(sb.seed_keys, sb.counters, STREAM_SAMPLE))
        tokens = torch.where(sb.greedy, penalised.argmax(-1), drawn) if sb.any_greedy else drawn
    return finish_sample(tokens, logprobs, logits, sb)


def finish_sample(
    tokens: torch.Tensor, logprobs: torch.Tensor, logits: torch.Tensor, sb: SamplingBatch
) -> SampleResult:
    """Gather the returned logprobs for chosen tokens [N] from processed logprobs [N, V] (raw ones from the
    unprocessed `logits`: no penalties either)."""
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    raw = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1) if sb.need_raw else None
    top_ids = top_values = None
    if sb.num_top_logprobs:
        top_values, top_ids = logprobs.topk(min(sb.num_top_logprobs, logprobs.shape[-1]), dim=-1)
    return SampleResult(tokens, chosen, raw, top_ids, top_values)


def draw_draft(logits: torch.Tensor, sb: SamplingBatch, j: int,
               drafted: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft position j: draw a token [B] from the processed draft distribution q [B, V] (the draft's own
    random stream), penalised like the target's after the tokens `drafted` before it ([B] each). Greedy rows
    propose the argmax deterministically, so their q is one-hot. (Penalising the draft only raises acceptance:
    verification reads q, whatever it is.)"""
    if sb.penalties is not None:
        logits = sb.penalised(logits, torch.stack(drafted, 1) if drafted else None)
    q = process_logits(logits, replace(sb, counters=sb.counters + j) if j else sb).exp()
    drawn = sample_from(q, uniforms(sb.seed_keys, sb.counters + j, STREAM_DRAFT))
    if not sb.any_greedy:
        return drawn, q
    greedy_tok = logits.argmax(-1)
    tok = torch.where(sb.greedy, greedy_tok, drawn)
    q = torch.where(sb.greedy[:, None], torch.nn.functional.one_hot(greedy_tok, q.shape[-1]).to(q.dtype), q)
    return tok, q


@dataclass(slots=True)
class VerifyResult:
    tokens: torch.Tensor  # [B, k + 1]: accepted drafts, then the correction/bonus token, then padding
    num_accepted: torch.Tensor  # [B]; row b emits num_accepted[b] + 1 tokens
    sample: SampleResult  # logprobs etc. of tokens, flattened to [B * (k + 1)]


def verify(target_logits: torch.Tensor, draft: DraftProposal, sb: SamplingBatch) -> VerifyResult:
    """target_logits [B, k + 1, V] float32 from the verify pass over [last token, x_1..x_k]."""
    B, K1, V = target_logits.shape
    k = K1 - 1
    dev = target_logits.device
    penalised = target_logits if sb.penalties is None else sb.penalties.at_positions(target_logits, draft.tokens)
    target_logprobs = process_logits(penalised, sb)  # [B, k + 1, V]: each row's parameters at every position
    positions = torch.arange(k, device=dev)
    in_draft = positions[None, :] < draft.lengths[:, None]  # [B, k]
    x = draft.tokens
    p_x = target_logprobs[:, :k].gather(-1, x[..., None]).squeeze(-1).exp()  # [B, k]: p only where it is read
    one_hot = draft.one_hot_rows  # with probs: the rows drafted deterministically (None: none of them)
    if draft.probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft.probs.gather(-1, x[..., None]).squeeze(-1)
        if one_hot is not None:
            q_x = torch.where(one_hot[:, None], 1.0, q_x)
    # Every uniform the step may use, hashed in one pass: the acceptance tests' at draft positions 0..k-1, then the
    # final token's at positions 0..k (the one at num_accepted is used).
    offsets = torch.cat([positions, torch.arange(K1, device=dev)])  # [2k + 1]
    streams = torch.where(torch.arange(2 * k + 1, device=dev) < k, STREAM_ACCEPT, STREAM_SAMPLE)  # built on the device
    u_all = uniforms(sb.seed_keys, sb.counters[:, None] + offsets, streams)  # [B, 2k + 1]
    u = u_all[:, :k]
    accepted = (u * q_x <= p_x) & in_draft  # u <= p/q without dividing by q
    target_argmax = penalised.argmax(-1) if sb.any_greedy else None  # [B, k + 1]
    if target_argmax is not None:
        accepted = torch.where(sb.greedy[:, None], (x == target_argmax[:, :k]) & in_draft, accepted)
    num_accepted = accepted.to(torch.int64).cumprod(1).sum(1)  # [B]

    # The residual row at the first rejection (or p_{k+1} when everything was accepted).
    rows = torch.arange(B, device=dev)
    p_row = target_logprobs[rows, num_accepted].exp()  # [B, V]
    rejected_draft = num_accepted < draft.lengths  # a real draft token was rejected at num_accepted
    at = num_accepted.clamp(max=k - 1)
    if draft.probs is None:
        residual, rejected_one_hot = p_row.clone(), rejected_draft
    else:
        drawn = rejected_draft if one_hot is None else rejected_draft & ~one_hot
        residual = (p_row - draft.probs[rows, at] * drawn[:, None]).clamp_(min=0)
        rejected_one_hot = None if one_hot is None else rejected_draft & one_hot
    if rejected_one_hot is not None:  # a deterministic draft's q is one-hot: the residual is p without that token
        hit = x[rows, at]
        residual[rows, hit] = torch.where(rejected_one_hot, 0.0, residual[rows, hit])
    # p == q exactly leaves no residual mass; rejection then had probability 0, any fallback is fine.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_row, residual)
    next_token = sample_from(residual, u_all[rows, k + num_accepted])
    if target_argmax is not None:
        next_token = torch.where(sb.greedy, target_argmax[rows, num_accepted], next_token)

    tokens = torch.cat([x, x.new_zeros(B, 1)], dim=1)  # [B, k + 1]
    tokens[rows, num_accepted] = next_token
    flat = tokens.reshape(-1)
    result = finish_sample(flat, target_logprobs.reshape(B * K1, V), target_logits.reshape(B * K1, V), sb)
    return VerifyResult(tokens, num_accepted, result)
