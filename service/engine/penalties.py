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

from service.engine.sequence import Sequence


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

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> Penalties | None:
        """The penalties of these sequences (None where no row has one), counting their output so far."""
        params = [s.params for s in seqs]
        if not any(p.penalised for p in params):
            return None
        values = torch.tensor([[p.frequency_penalty, p.presence_penalty, p.repetition_penalty] for p in params],
                              dtype=torch.float32, device=device)
        in_prompt = None
        if any(p.repetition_penalty != 1 for p in params):
            in_prompt = torch.zeros(len(seqs), vocab_size, dtype=torch.bool, device=device)
            rows, ids = _flat([s.prompt_token_ids if s.params.repetition_penalty != 1 else [] for s in seqs], device)
            in_prompt[rows, ids] = True
        counts = torch.zeros(len(seqs), vocab_size, dtype=torch.float32, device=device)
        pen = cls(values[:, 0], values[:, 1], values[:, 2], counts, in_prompt, [0] * len(seqs))
        return pen.advanced(seqs)

    def advanced(self, seqs: list[Sequence]) -> Penalties:
        """These penalties for the same rows after they gained tokens: only the new tokens are counted (a new
        counts tensor; this one is left as it was)."""
        if any(len(s.output_token_ids) < c for s, c in zip(seqs, self.counted, strict=True)):
            return Penalties.build(seqs, self.counts.shape[1], self.counts.device)  # type: ignore[return-value]
        new = [s.output_token_ids[c:] if s.params.penalised else [] for s, c in zip(seqs, self.counted, strict=True)]
        counted = [len(s.output_token_ids) for s in seqs]
        if not any(new):
            return Penalties(self.frequency, self.presence, self.repetition, self.counts, self.in_prompt, counted)
        rows, ids = _flat(new, self.counts.device)
        counts = self.counts.index_put((rows, ids), torch.ones(len(ids), device=self.counts.device), accumulate=True)
        return Penalties(self.frequency, self.presence, self.repetition, counts, self.in_prompt, counted)

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


def _flat(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) int64 tensors of every token in `rows`."""
    index = [i for i, toks in enumerate(rows) for _ in toks]
    ids = [t for toks in rows for t in toks]
    return (torch.tensor(index, dtype=torch.int64, device=device), torch.tensor(ids, dtype=torch.int64, device=device))
