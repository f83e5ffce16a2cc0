"""The trainer's own copy of the policy: our decoder with autograd, its tokenizer, and the GRPO loss.

The policy is loaded from a Hugging Face folder (the one the server started from) and trained with a
cache-free causal forward. `hf_weights()` gives the Hugging Face tensor names the server's pushes take.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from service.models.llama import causal_meta
from service.models.loader import hf_state_dict, load_model
from service.models.rope import Rope
from service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Rollout:
    """One sample as the trainer uses it."""

    prompt_ids: list[int]
    output_ids: list[int]
    old_logprobs: list[float]  # what the server returned: log-probabilities the tokens were drawn with
    advantage: float


@dataclass(slots=True)
class UpdateStats:
    loss: float
    tokens: int
    trained_samples: int
    logprob_max_abs_diff: float  # trainer vs server logprobs of the same tokens, before the update
    grad_norm: float
    forward_tokens: int = 0  # rows x padded width over the micro-batches: the positions the forward and backward ran


class Policy:
    def __init__(self, model_dir: str | Path, lr: float, max_positions: int = 2048, weight_decay: float = 0.0) -> None:
        self.model_dir = Path(model_dir)
        tok = Tokenizer.from_dir(self.model_dir)
        if tok is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json")
        self.tokenizer = tok
        self.model = load_model(self.model_dir, torch.float32, torch.device("cpu")).train().requires_grad_(True)
        self.rope = Rope(self.model.config, max_positions, torch.device("cpu"), torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=weight_decay)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        return hf_state_dict(self.model)

    def _token_logprobs(self, rows: list[Rollout], temperature: float) -> list[torch.Tensor]:
        """Log-probabilities of each row's output tokens under the current weights (with autograd)."""
        seqs = [r.prompt_ids + r.output_ids for r in rows]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        B, T = ids.shape
        hidden = self.model(ids[:, :-1], causal_meta(self.rope.cos, self.rope.sin, B, T - 1), None, None)
        out = []
        for i, r in enumerate(rows):
            lo, n = len(r.prompt_ids) - 1, len(r.output_ids)
            logits = self.model.logits(hidden[i, lo : lo + n]) / max(temperature, 1e-6)
            lp = F.log_softmax(logits, dim=-1).gather(-1, torch.tensor(r.output_ids)[:, None]).squeeze(-1)
            out.append(lp)
        return out

    def update(self, rollouts: list[Rollout], temperature: float, clip: float, micro_tokens: int,
               max_grad_norm: float = 1.0) -> UpdateStats:
        """One GRPO step: token-level clipped surrogate  -min(rho A, clip(rho) A), summed over every output token
        of the batch and divided by the batch's output token count (samples with A = 0 add no gradient and
        are skipped). rho = pi / pi_old with pi_old the server's logprobs: a check that they agree, too."""
        total_tokens = max(1, sum(len(r.output_ids) for r in rollouts))
        rows = sorted((r for r in rollouts if r.advantage != 0.0 and r.output_ids),
                      key=lambda r: len(r.prompt_ids) + len(r.output_ids))
        self.opt.zero_grad(set_to_none=True)
        loss_sum, max_diff, forward_tokens = 0.0, 0.0, 0
        for chunk in _micro_batches(rows, micro_tokens):
            forward_tokens += len(chunk) * max(len(r.prompt_ids) + len(r.output_ids) for r in chunk)
            logps = self._token_logprobs(chunk, temperature)
            loss = torch.zeros(())
            for r, lp in zip(chunk, logps, strict=True):
                old = torch.tensor(r.old_logprobs, dtype=torch.float32)
                max_diff = max(max_diff, float((lp.detach() - old).abs().max()))
                ratio = (lp - old).exp()
                surrogate = torch.minimum(ratio * r.advantage, ratio.clamp(1 - clip, 1 + clip) * r.advantage)
                loss = loss - surrogate.sum() / total_tokens
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)) if rows else 0.0
        if rows:
            self.opt.step()
        return UpdateStats(loss_sum, total_tokens, len(rows), max_diff, grad_norm, forward_tokens)


def _micro_batches(rows: list[Rollout], micro_tokens: int) -> list[list[Rollout]]:
    """Consecutive rows (sorted by length) grouped so that rows x padded width stays under micro_tokens."""
    out: list[list[Rollout]] = []
    cur: list[Rollout] = []
    for r in rows:
        width = len(r.prompt_ids) + len(r.output_ids)
        if cur and (len(cur) + 1) * width > micro_tokens:
            out.append(cur)
            cur = []
        cur.append(r)
    if cur:
        out.append(cur)
    return out


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO advantages of one group: (r - mean) / std; all zero when every sample got the same reward."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    if std < eps:
        return [0.0] * n
    return [(r - mean) / std for r in rewards]
