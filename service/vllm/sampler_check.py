"""The start-up self-check of speculative sampling: the rejection sampler a worker serves with, against the law.

Each worker builds a verification batch with known target logits and draft distributions (sampled rows at
temperature 1, at 0.7 with top-p 0.9, at 0.8 with top-k 5, and greedy rows, mixed), draws a few thousand
verifications from its own sampler (vLLM's V1 `RejectionSampler`, or MRv2's `rejection_sample` kernels) with
a fixed seed, and compares them with the exact law:
- the first token of every sampled row follows the target's processed distribution, and so does the second
  among rows that accepted their first draft (chi-square, bins of expected count >= 5);
- no token outside the processed distribution's support; greedy rows return the target's argmax at every
  position;
- returned logprobs (and the top-3) equal the processed distribution's, within 1e-4.
With the seed fixed the verdict is deterministic; the p-value bound (1e-5) is one an exact sampler passes on
all but a negligible share of seeds, while the faults this guards against give p ~ 0. Both draft kinds are
run: probabilistic draft distributions (draft models) and one-hot drafts (n-gram). Costs well under a second.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

P_MIN = 1e-5
LOGPROB_TOL = 1e-4
SEED = 20260
VOCAB = 24
DEPTH = 3  # drafts per row
ROWS = 2048  # rows per sampled case and draft kind: the draws behind each chi-square test
GREEDY_ROWS = 256
TOP_N = 3


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    temperature: float  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0


CASES = (Case("T=1", 1.0), Case("T=0.7 top_p=0.9", 0.7, top_p=0.9), Case("T=0.8 top_k=5", 0.8, top_k=5),
         Case("greedy", 0.0))


@dataclass(slots=True)
class Batch:
    """One verification batch: B rows of DEPTH drafts (row-major by case)."""

    target_logits: torch.Tensor  # [B, DEPTH + 1, V] float32 (the last position is the bonus)
    draft_tokens: torch.Tensor  # [B, DEPTH] int64
    draft_probs: torch.Tensor | None  # [B, DEPTH, V] float32; None: one-hot drafts (n-gram)
    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int32 (VOCAB = none)
    case_of_row: list[int]


@dataclass(slots=True)
class Verified:
    tokens: torch.Tensor  # [B, DEPTH + 1] int64, -1 after the first rejection
    logprobs: torch.Tensor | None  # [B, DEPTH + 1] float (of `tokens`); None: not this sampler's output
    top_logprobs: torch.Tensor | None  # [B, DEPTH + 1, TOP_N] float, best first


Verifier = Callable[[Batch], Verified]


def processed(logits: torch.Tensor, case: Case) -> torch.Tensor:
    """[..., V] logits -> the distribution vLLM samples from (float64): temperature, top-k, then top-p over
    what top-k kept (a token stays while the mass before it is below top_p). Greedy: the untempered softmax
    (what vLLM returns as processed logprobs for greedy rows)."""
    x = logits.double() / (case.temperature if case.temperature > 0 else 1.0)
    if case.temperature > 0 and 0 < case.top_k < x.shape[-1]:
        kth = x.topk(case.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    p = x.softmax(-1)
    if case.temperature > 0 and case.top_p < 1:
        sorted_p, order = p.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        drop = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, before >= case.top_p)
        p = p.masked_fill(drop, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def make_batch(probabilistic: bool, gen: torch.Generator) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """A batch, the target's processed distributions per case [C, DEPTH + 1, V] and the per-case logits."""
    logits = torch.randn(len(CASES), DEPTH + 1, VOCAB, generator=gen, dtype=torch.float64) * 1.6
    # draft distributions near the target's (acceptance well inside (0, 1)), different per case and position
    q = (logits[:, :DEPTH] + torch.randn(len(CASES), DEPTH, VOCAB, generator=gen, dtype=torch.float64)).softmax(-1)
    rows = [ROWS if c.temperature > 0 else GREEDY_ROWS for c in CASES]
    case_of_row = [i for i, n in enumerate(rows) for _ in range(n)]
    idx = torch.tensor(case_of_row)
    drafts = torch.multinomial(q[idx].reshape(-1, VOCAB), 1, generator=gen).view(len(idx), DEPTH)
    probs = torch.stack([processed(logits[i], c) for i, c in enumerate(CASES)])
    batch = Batch(
        target_logits=logits[idx].float().contiguous(), draft_tokens=drafts,
        draft_probs=q[idx].float().contiguous() if probabilistic else None,
        temperature=torch.tensor([CASES[i].temperature for i in case_of_row], dtype=torch.float32),
        top_p=torch.tensor([CASES[i].top_p for i in case_of_row], dtype=torch.float32),
        top_k=torch.tensor([CASES[i].top_k or VOCAB for i in case_of_row], dtype=torch.int32),
        case_of_row=case_of_row)
    return batch, probs, logits


def chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of `tokens` (ints) drawn from `probs` [V]: bins of expected count >= 5, the rest pooled."""
    n = tokens.numel()
    if n == 0:
        return 0.0
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * n
    big = expected >= 5
    obs = [*observed[big].tolist(), float(observed[~big].sum())]
    exp = [*expected[big].tolist(), float(expected[~big].sum())]
    if exp[-1] < 5:  # pool the rest into the smallest bin
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    if len(exp) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _logprob_faults(logprobs: torch.Tensor, top_logprobs: torch.Tensor, p_tok: torch.Tensor,
                    p_rows: torch.Tensor, present: torch.Tensor, kind: str, figures: dict[str, float]) -> list[str]:
    faults: list[str] = []
    want_lp = p_tok.log()
    lp_err = (logprobs.cpu().double() - want_lp).abs()[present]
    worst = float(lp_err.max()) if lp_err.numel() else 0.0
    figures["logprob error"] = worst
    if not worst <= LOGPROB_TOL:  # NaN fails too
        faults.append(f"{kind}: a logprob off by {worst:.3g}")
    top_want = p_rows.log().sort(-1, descending=True).values[..., :TOP_N]
    top_got = top_logprobs.cpu().double()
    finite = torch.isfinite(top_want)
    top_err = (top_got - top_want).abs()[present.unsqueeze(-1).expand_as(finite) & finite]
    infinite_ok = bool((top_got[present.unsqueeze(-1).expand_as(finite) & ~finite] == -math.inf).all())
    if (top_err.numel() and not float(top_err.max()) <= LOGPROB_TOL) or not infinite_ok:
        faults.append(f"{kind}: top-{TOP_N} logprobs are not the processed distribution's")
    return faults


def judge(batch: Batch, probs: torch.Tensor, logits: torch.Tensor, got: Verified, kind: str) -> tuple[list[str],
                                                                                                      dict]:
    """Faults found (empty = exact) and the figures behind the verdict."""
    faults: list[str] = []
    figures: dict[str, float] = {}
    tokens = got.tokens.cpu().long()
    idx = torch.tensor(batch.case_of_row)
    present = tokens >= 0
    if not bool(present[:, 0].all()):
        faults.append(f"{kind}: a row returned no first token")
        return faults, figures
    safe = tokens.clamp(min=0)
    p_rows = probs[idx]  # [B, DEPTH + 1, V]
    p_tok = p_rows.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    if bool((present & (p_tok <= 0)).any()):
        faults.append(f"{kind}: a token outside its distribution's support")
    if got.logprobs is not None and got.top_logprobs is not None:
        faults += _logprob_faults(got.logprobs, got.top_logprobs, p_tok, p_rows, present, kind, figures)
    for c, case in enumerate(CASES):
        rows = idx == c
        if case.temperature == 0:
            argmax = logits[c].argmax(-1)
            wrong = (present[rows] & (tokens[rows] != argmax)).sum()
            if int(wrong):
                faults.append(f"{kind} {case.name}: {int(wrong)} tokens are not the target's argmax")
            continue
        first = chi_square_p(tokens[rows, 0], probs[c, 0])
        accepted = rows & (tokens[:, 0] == batch.draft_tokens[:, 0])
        second = chi_square_p(tokens[accepted, 1], probs[c, 1])
        figures[f"{case.name} p1"], figures[f"{case.name} p2"] = first, second
        figures[f"{case.name} accepted"] = float(accepted.sum()) / float(rows.sum())
        if not (first > P_MIN and second > P_MIN):
            faults.append(f"{kind} {case.name}: chi-square p = {first:.3g} (first token), {second:.3g} "
                          f"(second, {int(accepted.sum())} rows)")
    return faults, figures


def run_check(verify: Verifier, device: str | torch.device = "cpu") -> dict:
    """Drive `verify` on both draft kinds with a fixed seed, the global RNG state saved and restored (vLLM
    draws its verification randomness from it). {'passed', 'faults', 'figures', 'seconds'}."""
    start = time.perf_counter()
    faults: list[str] = []
    figures: dict[str, float] = {}
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(SEED)
        gen = torch.Generator().manual_seed(SEED)
        for probabilistic, kind in ((True, "draft model"), (False, "n-gram")):
            batch, probs, logits = make_batch(probabilistic, gen)
            try:
                got = verify(batch)
            except Exception as exc:  # the sampler cannot run this batch: not exact either
                faults.append(f"{kind}: the sampler raised {type(exc).__name__}: {exc}")
                continue
            found, figs = judge(batch, probs, logits, got, kind)
            faults += found
            figures.update({f"{kind} {k}": v for k, v in figs.items()})
    return {"passed": not faults, "faults": faults, "figures": figures,
            "seconds": round(time.perf_counter() - start, 3)}
