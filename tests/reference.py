"""Straightforward reference implementations the tests check the engine against."""

from __future__ import annotations

import itertools

import numpy as np
import torch


def processed_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """One row of float logits [V] -> the distribution a token is sampled from (float64)."""
    x = logits.double() / (temperature if temperature > 0 else 1.0)
    p = x.softmax(-1)
    keep = torch.ones_like(p, dtype=torch.bool)
    order = torch.argsort(p, descending=True)
    if 0 < top_k < len(p):
        keep[order[top_k:]] = False
    if top_p < 1.0:
        q = torch.where(keep, p, torch.zeros_like(p))
        q = q / q.sum()
        mass = 0.0
        for idx in order.tolist():
            if not keep[idx]:
                continue
            if mass >= top_p:
                keep[idx] = False
            mass += q[idx].item()
    if min_p > 0:
        q = torch.where(keep, p, torch.zeros_like(p))
        q = q / q.sum()
        keep &= q >= min_p * q.max()
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


def chi_square_pvalue(samples: list[int] | np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square of observed token counts against probs; bins with tiny expectation are pooled.
    Samples outside the support make the p-value 0."""
    from scipy.stats import chisquare

    samples = np.asarray(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * len(samples)
    big = expected >= 5
    obs = list(counts[big]) + ([counts[~big & (probs > 0)].sum()] if (~big & (probs > 0)).any() else [])
    exp = list(expected[big]) + ([expected[~big & (probs > 0)].sum()] if (~big & (probs > 0)).any() else [])
    if len(obs) < 2:
        return 1.0
    return float(chisquare(obs, exp).pvalue)


def exact_joint(path, prompt, kw, length: int = 3) -> np.ndarray:
    """P(t1, .., t_length) (2 or 3 tokens) by enumeration over a tiny vocabulary, with plain decoding's
    processing, from transformers' logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    V = model.config.vocab_size

    def next_probs(prefixes):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        return [processed_probs(row, **kw) for row in logits]

    p1 = next_probs([()])[0]
    p2 = next_probs([(a,) for a in range(V)])
    joint = p1[:, None] * torch.stack(p2)
    if length == 2:
        return joint.reshape(-1).numpy()
    p3 = next_probs(list(itertools.product(range(V), repeat=2)))
    return (joint[:, :, None] * torch.stack(p3).view(V, V, V)).reshape(-1).numpy()
