"""Lossless speculative verification, vectorised over the batch.

For each row: draft tokens x_1..x_k were drawn from q_1..q_k (one-hot for deterministic drafters), the
target gave p_1..p_{k+1} (processed exactly as in plain decoding; a penalised row's p_j counts the drafts before
position j, `Penalties.at_positions`). Accept x_j with probability
min(1, p_j(x_j) / q_j(x_j)); at the first rejection j draw from normalize(max(0, p_j - q_j)); if all k are
accepted draw a bonus token from p_{k+1}. Positions past a row's draft length count as rejections with
q = 0, which makes the "residual" simply p: the row falls back to plain sampling there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.sampler import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    SampleResult,
    SamplingBatch,
    finish_sample,
    process_logits,
    sample_from,
    uniforms,
)


@dataclass(slots=True)
class DraftProposal:
    tokens: torch.Tensor  # [B, k] long
    lengths: torch.Tensor  # [B] long, valid drafts per row (<= k)
    probs: torch.Tensor | None  # [B, k, V] processed draft distribution; None = deterministic (one-hot)
    row_lengths: list[int] | None = None  # `lengths` on the host, where the drafter knows them there (no sync)
    one_hot_rows: torch.Tensor | None = None  # [B] bool: rows drafted deterministically though probs is given
    caught_up: tuple[int, float] = (0, 0.0)  # tokens fed to catch up before drafting (`Drafter.catch_up`), seconds

    @property
    def longest(self) -> int | None:
        """The most drafts any row has, where known on the host."""
        return None if self.row_lengths is None else max(self.row_lengths, default=0)

    def cut(self, k: int) -> DraftProposal:
        """The first k draft positions: what a verify pass needs when no row proposed more."""
        probs = None if self.probs is None else self.probs[:, :k]
        rows = None if self.row_lengths is None else [min(n, k) for n in self.row_lengths]
        return DraftProposal(self.tokens[:, :k], self.lengths.clamp(max=k), probs, rows, self.one_hot_rows,
                             self.caught_up)

    def limit(self, room: list[int]) -> DraftProposal:
        """Each row's drafts cut to its `room`: the tokens it may still emit, less one (the bonus or correction
        token). A row ends at its token budget, so a draft past its room would never be emitted, only verified.
        Lossless: the room is known before the step, and a position past a row's drafts is a rejection with
        q = 0 (the row samples from p there), so the tokens it emits are distributed as before."""
        k = self.tokens.shape[1]
        if min(room, default=k) >= k:
            return self
        cap = torch.tensor(room, dtype=self.lengths.dtype, device=self.lengths.device)
        rows = None if self.row_lengths is None else [min(n, r) for n, r in zip(self.row_lengths, room, strict=True)]
        return DraftProposal(self.tokens, torch.minimum(self.lengths, cap), self.probs, rows, self.one_hot_rows,
                             self.caught_up)

    def take_rows(self, host: DraftProposal, min_drafts: int) -> tuple[DraftProposal, torch.Tensor]:
        """Rows the deterministic drafter `host` (same k, probs None) has at least `min_drafts` drafts for take
        its drafts; the others keep these. Returns the joint proposal and those rows ([B] bool). Lossless:
        each row's drafts come from one proposal, chosen before the step."""
        if host.probs is not None or host.tokens.shape != self.tokens.shape:
            raise ValueError("a host drafter's proposal must be deterministic and as deep as the one it joins")
        use = host.lengths >= min_drafts  # [B]
        rows = None
        if host.row_lengths is not None and self.row_lengths is not None:
            rows = [h if h >= min_drafts else n for h, n in zip(host.row_lengths, self.row_lengths, strict=True)]
        one_hot = use if self.one_hot_rows is None else use | self.one_hot_rows
        joint = DraftProposal(torch.where(use[:, None], host.tokens, self.tokens),
                              torch.where(use, host.lengths, self.lengths), self.probs, rows, one_hot, self.caught_up)
        return joint, use


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
