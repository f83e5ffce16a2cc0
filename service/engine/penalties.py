"""Frequency, presence and repetition penalties on the logits, vectorised over rows and draft positions.

A penalised row's distribution depends on the tokens sampled before the position (vLLM's and OpenAI's
definitions, `SamplingParams`): frequency and presence count the output, repetition the prompt and the output.
Under speculative decoding the target's distribution at verify position j counts the output before the step
plus the drafts x_1..x_j, so each position is penalised with its own counts (`at_positions`); verification
against those probabilities keeps the output exactly what the penalised target alone samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Penalties:
    """Per-row penalties [N] and the counts they read: output token counts [N, V] (float32, exact integers)
    and a mask of the prompt's tokens [N, V] (None: no row has a repetition penalty)."""

    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    counts: torch.Tensor
    in_prompt: torch.Tensor | None
    counted: list[int]  # per row, the output tokens `counts` holds

    def apply(self, logits: torch.Tensor, drafted: torch.Tensor | None = None) -> torch.Tensor:
        """Penalised logits [N, V] (a new tensor) at the rows' next position, after the tokens `drafted` [N, j]
        of this step (a drafter's own proposal so far; None: none)."""
        counts = self.counts
        if drafted is not None and drafted.shape[1]:
            counts = counts.scatter_add(-1, drafted, torch.ones(drafted.shape, device=counts.device))
        return self._penalise(logits, counts, self.in_prompt)

    def at_positions(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Penalised verify logits [B, k + 1, V] for drafts [B, k]: position j counts the output before the step
        and drafts x_1..x_j (positions past a row's accepted drafts are never read)."""
        B, K1, V = logits.shape
        k = K1 - 1
        counts = self.counts[:, None].expand(B, K1, V).clone()
        if k:
            before = torch.arange(k, device=logits.device)[None, :] < torch.arange(K1, device=logits.device)[:, None]
            counts.scatter_add_(-1, drafts[:, None, :].expand(B, K1, k), before.to(counts.dtype).expand(B, K1, k))
        in_prompt = None if self.in_prompt is None else self.in_prompt[:, None]
        return self._penalise(logits, counts, in_prompt)

    def _penalise(self, logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor | None) -> torch.Tensor:
        """vLLM's order: repetition, then frequency, then presence. At a row's neutral values (0, 0, 1) every
        operation leaves its logits exactly as they were."""
        col = lambda t: t[(..., *(None,) * (logits.dim() - 1))]
        seen = counts > 0
        if in_prompt is not None:
            r = col(self.repetition)
            scaled = torch.where(logits > 0, logits / r, logits * r)
            logits = torch.where(seen | in_prompt, scaled, logits)
        return logits - col(self.frequency) * counts - col(self.presence) * seen
