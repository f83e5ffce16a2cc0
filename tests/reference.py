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


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], frequency_penalty: float = 0.0,
              presence_penalty: float = 0.0, repetition_penalty: float = 1.0) -> torch.Tensor:
    """One row of logits [V] after vLLM's penalties, token by token (float32, as the engine computes them):
    repetition on every token of the prompt and the output, then frequency times the token's count in the
    output, then presence once per token the output holds."""
    x = logits.float().clone()
    counts: dict[int, int] = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    r = torch.tensor(repetition_penalty, dtype=torch.float32)
    for t in set(prompt) | set(counts):
        if repetition_penalty != 1.0:
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in counts.items():
        x[t] = x[t] - torch.tensor(frequency_penalty, dtype=torch.float32) * c
        x[t] = x[t] - torch.tensor(presence_penalty, dtype=torch.float32)
    return x


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


def exact_joint(path, prompt, kw, length: int = 3, penalties: dict | None = None) -> np.ndarray:
    """P(t1, .., t_length) (2 or 3 tokens) by enumeration over a tiny vocabulary, with plain decoding's
    processing, from transformers' logits (with `penalties`: `penalised` by each prefix first)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    V = model.config.vocab_size

    def next_probs(prefixes):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        if penalties:
            logits = [penalised(row, prompt, list(p), **penalties) for row, p in zip(logits, prefixes, strict=True)]
        return [processed_probs(row, **kw) for row in logits]

    p1 = next_probs([()])[0]
    p2 = next_probs([(a,) for a in range(V)])
    joint = p1[:, None] * torch.stack(p2)
    if length == 2:
        return joint.reshape(-1).numpy()
    p3 = next_probs(list(itertools.product(range(V), repeat=2)))
    return (joint[:, :, None] * torch.stack(p3).view(V, V, V)).reshape(-1).numpy()
