"""What the trainer minimises and how it measures itself.

Loss per predicted token, weighted (reward x recency), with q_T = softmax(drafter logits / temperature):
  - the loaded target model matches the rollout's policy version: KL(p || q_T), p the target's processed
    distribution (exactly what the server samples from);
  - else the payload has the target's top-k logprobs: cross-entropy of q_T against p renormalised on top-k;
  - else cross-entropy on the sampled token, an unbiased sample of the cross-entropy H(p, q_T) because the
    token was drawn from p.

Acceptance at one position, for the drafter's processed q (as the server drafts): beta = sum_x min(p, q).
With the target's full p that is computed exactly; without it, the sampled token x ~ p gives the unbiased
estimate min(1, q(x) / p(x)), since E_{x~p}[min(1, q/p)] = sum_x min(p, q), using the logprob the server
returned for x. Greedy rows accept iff the drafter's argmax is the target's (sampled) token.
Expected tokens per verify step with k drafts from position t: sum_{j=0..k} prod_{i<j} beta_{t+i},
averaged over the start positions that have k positions after them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafter_trainer.batch import Batch
from service.engine.sampler import process_logits


def distill_loss(logits: torch.Tensor, batch: Batch, teacher_lp: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V] of the drafter; teacher_lp [N, V] processed target logprobs (rows where teacher_ok)."""
    lq = F.log_softmax(logits / batch.sb.temperature[:, None], dim=-1)
    per_token = -lq.gather(-1, batch.targets[:, None]).squeeze(-1)
    if batch.top_ids is not None and batch.top_lp is not None:
        has_top = torch.isfinite(batch.top_lp[:, 0])
        p_top = batch.top_lp.softmax(-1).nan_to_num(0.0)
        ce_top = -(p_top * lq.gather(-1, batch.top_ids)).sum(-1)
        per_token = torch.where(has_top, ce_top, per_token)
    if teacher_lp is not None:
        p = teacher_lp.exp()
        kl = torch.where(p > 0, p * (teacher_lp - lq), 0.0).sum(-1)  # tokens the target excludes add 0
        per_token = torch.where(batch.teacher_ok, kl, per_token)
    # Normalised by rows, not by the weights: a batch of old-policy rollouts keeps its smaller say.
    return (batch.weights * per_token).sum() / max(batch.size, 1)


@torch.no_grad()
def acceptance(logits: torch.Tensor, batch: Batch, teacher_lp: torch.Tensor | None) -> torch.Tensor:
    """Per-row acceptance probability beta [N] of the drafter whose logits are given."""
    lq = process_logits(logits.float(), batch.sb)
    q_x = lq.gather(-1, batch.targets[:, None]).squeeze(-1)
    beta = (q_x - batch.target_logprob).clamp(max=0.0).exp()  # sampled estimate
    if teacher_lp is not None:
        exact = torch.minimum(teacher_lp.exp(), lq.exp()).sum(-1)
        beta = torch.where(batch.teacher_ok, exact, beta)
    greedy_hit = (logits.argmax(-1) == batch.targets).float()
    return torch.where(batch.sb.greedy, greedy_hit, beta)


def expected_lengths(beta: torch.Tensor, owner: torch.Tensor, k: int) -> torch.Tensor:
    """Expected tokens per step [S] at each usable start position, from per-row beta [N] grouped by owner
    (rows of one rollout are consecutive and in order)."""
    out = []
    for b in owner.unique_consecutive():
        seq = beta[owner == b]
        T = seq.numel()
        padded = torch.cat([seq, seq.new_zeros(k)])
        windows = padded.unfold(0, k, 1)[: max(T - k + 1, 1)]  # [S, k] starts with k positions ahead
        out.append(1.0 + windows.cumprod(dim=1).sum(dim=1))
    return torch.cat(out) if out else beta.new_zeros(0)


def mean_beta_length(mean_beta: float, k: int) -> float:
    """Closed form with one acceptance rate: (1 - b^(k+1)) / (1 - b)."""
    b = min(max(mean_beta, 0.0), 0.999999)
    return (1 - b ** (k + 1)) / (1 - b)
