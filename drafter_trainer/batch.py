"""Rollouts -> tensors: padded token ids, and one row per predicted output token with what it needs.

Row n predicts token ``ids[rows[n], cols[n] + 1]`` (an output token) from the prefix up to ``cols[n]``.
Each row carries the rollout's sampling settings (so the drafter's distribution is processed exactly as
the server processes it), the logprob the target gave the sampled token, the target's top-k logprobs when
the payload had them, whether the loaded target model matches the rollout's policy version, and a weight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from service.buffer.codec import BufferedRollout
from service.engine.batch_tensors import SamplingBatch

logger = logging.getLogger(__name__)
_warned = False


@dataclass(slots=True)
class Batch:
    ids: torch.Tensor  # [B, L]
    rows: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]
    targets: torch.Tensor  # [N] sampled token
    target_logprob: torch.Tensor  # [N] processed logprob of the sampled token under the target
    weights: torch.Tensor  # [N]
    sb: SamplingBatch  # per-row processing
    owner: torch.Tensor  # [N] index of the rollout in the batch
    top_ids: torch.Tensor | None  # [N, K] (0 where absent)
    top_lp: torch.Tensor | None  # [N, K] (-inf where absent)
    teacher_ok: torch.Tensor  # [N] bool: the loaded target model produced this rollout
    num_rollouts: int

    @property
    def size(self) -> int:
        return int(self.rows.numel())


def sampling_batch(temps: list[float], top_ps: list[float], top_ks: list[int], min_ps: list[float], vocab: int,
                   device: torch.device) -> SamplingBatch:
    """The rollouts' sampling parameters, for processing logits as the server did (no draws: seeds are unused)."""
    n = len(temps)
    return SamplingBatch.of(temps, top_ps, top_ks, min_ps, [0] * n, [0] * n, vocab, device)


def usable(r: BufferedRollout, max_seq_len: int, min_col: int = 0) -> bool:
    """A rollout with at least one output token the drafter can be scored on."""
    P = len(r.prompt_token_ids)
    T = min(len(r.output_token_ids), max_seq_len - P)
    last_col = P + T - 2  # the last row predicts from this position
    return T > 0 and last_col >= min_col


def micro_batches(rollouts: list[BufferedRollout], max_tokens: int, max_seq_len: int) -> list[range]:
    """Index ranges of consecutive rollouts holding at most `max_tokens` tokens each (prompt and output, cut
    as `build_batch` cuts them; a longer rollout is a range of its own)."""
    groups: list[range] = []
    start, tokens = 0, 0
    for i, r in enumerate(rollouts):
        n = min(len(r.prompt_token_ids) + len(r.output_token_ids), max_seq_len)
        if i > start and tokens + n > max_tokens:
            groups.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(rollouts):
        groups.append(range(start, len(rollouts)))
    return groups


def build_batch(rollouts: list[BufferedRollout], weights: list[float], teacher_version: str | None, vocab: int,
                max_seq_len: int, device: torch.device, min_col: int = 0) -> Batch:
    """`min_col` > 0 drops rows predicted from positions before it (an EAGLE head needs one position of
    target features before its first prediction)."""
    global _warned
    seqs, rows, cols, targets, tlp, w, owner, ok = [], [], [], [], [], [], [], []
    temps, tps, tks, mps, tops = [], [], [], [], []
    for b, (r, wr) in enumerate(zip(rollouts, weights, strict=True)):
        P = len(r.prompt_token_ids)
        T = min(len(r.output_token_ids), max_seq_len - P)
        seqs.append(r.prompt_token_ids + r.output_token_ids[:T])
        if r.temperature is None and not _warned:
            _warned = True
            logger.warning("rollouts carry no sampling params: assuming temperature 1, no top-k/top-p/min-p")
        matches = teacher_version is not None and all(v == teacher_version for v in r.policy_versions)
        for t in range(T):
            col = P - 1 + t
            if col < min_col:
                continue
            rows.append(b)
            cols.append(col)
            targets.append(r.output_token_ids[t])
            tlp.append(r.logprobs[t])
            w.append(wr)
            owner.append(b)
            ok.append(matches)
            temps.append(1.0 if r.temperature is None else r.temperature)
            tps.append(r.top_p)
            tks.append(r.top_k)
            mps.append(r.min_p)
            k = r.top_count
            tops.append((r.top_ids[t * k : (t + 1) * k], r.top_values[t * k : (t + 1) * k]) if k else None)
    L = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (L - len(s)) for s in seqs], dtype=torch.int64, device=device)
    i64 = {"dtype": torch.int64, "device": device}
    top_ids = top_lp = None
    K = max((len(t[0]) for t in tops if t is not None), default=0)
    if K:
        top_ids = torch.zeros(len(tops), K, **i64)
        top_lp = torch.full((len(tops), K), float("-inf"), device=device)
        for n, t in enumerate(tops):
            if t is not None:
                top_ids[n, : len(t[0])] = torch.tensor(t[0], **i64)
                top_lp[n, : len(t[1])] = torch.tensor(t[1], device=device)
    return Batch(
        ids=ids, rows=torch.tensor(rows, **i64), cols=torch.tensor(cols, **i64), targets=torch.tensor(targets, **i64),
        target_logprob=torch.tensor(tlp, dtype=torch.float32, device=device),
        weights=torch.tensor(w, dtype=torch.float32, device=device),
        sb=sampling_batch(temps, tps, tks, mps, vocab, device), owner=torch.tensor(owner, **i64),
        top_ids=top_ids, top_lp=top_lp, teacher_ok=torch.tensor(ok, dtype=torch.bool, device=device),
        num_rollouts=len(rollouts),
    )
