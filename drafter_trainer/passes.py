"""The trainer's forward passes over rollouts, in micro-batches with the gate checked between them.

A training step or a held-out measure over a few thousand tokens runs for a second or more on a CPU. The gate
is checked before a round's every step, but a step under way ran to its end: when a rollout began during it,
the in-process trainer held cores the rollout needed (bench/e2e.py, adaptive with the trainer on: training
overlapped 581 engine steps in one run). Cut into pieces of at most `micro_tokens` tokens, a step or a measure
asks the gate before each piece; when it has closed, the work is dropped (`GateClosed`) and runs again at the
next opening. A step's pieces add their gradients up to the whole batch's: each piece's loss is scaled by its
share of the batch's rows, which is how the whole batch's loss is normalised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from drafter_trainer.batch import Batch, build_batch, micro_batches
from drafter_trainer.config import TrainerConfig
from drafter_trainer.objective import acceptance, distill_loss, expected_lengths
from drafter_trainer.students import Student
from drafter_trainer.teacher import Teacher
from service.buffer.codec import BufferedRollout


class GateClosed(Exception):
    """The gate closed between two pieces: the step or measure is dropped."""


class Passes:
    def __init__(self, cfg: TrainerConfig, student: Student, teacher: Teacher,
                 still_open: Callable[[], bool]) -> None:
        self.cfg, self.student, self.teacher, self.still_open = cfg, student, teacher, still_open

    def batches(self, rollouts: list[BufferedRollout], weights: list[float]) -> list[Batch]:
        """The rollouts as micro-batches of at most `micro_tokens` tokens, each with rows to score."""
        out = []
        for group in micro_batches(rollouts, self.cfg.micro_tokens, self.cfg.max_seq_len):
            batch = build_batch([rollouts[i] for i in group], [weights[i] for i in group], self.teacher.version,
                                self.student.vocab, self.cfg.max_seq_len, self.student.device, self.student.min_col)
            if batch.size:
                out.append(batch)
        return out

    def taught(self, batches: list[Batch]) -> Iterator[tuple[Batch, Any, Any]]:
        """Each piece with the teacher's hidden states and processed logprobs (None where it has none), pieces
        with nothing to learn from left out. The gate is asked before every piece but the first (the caller has
        just asked): GateClosed when it has closed."""
        for i, batch in enumerate(batches):
            if i and not self.still_open():
                raise GateClosed
            hidden = teacher_lp = None
            if self.teacher.model is not None and (self.student.needs_target or bool(batch.teacher_ok.any())):
                hidden = self.teacher.hidden(batch.ids)
                teacher_lp = self.teacher.logprobs(hidden, batch)
            if self.student.needs_target:
                if hidden is None:
                    continue
                batch.weights = batch.weights * batch.teacher_ok
            yield batch, hidden, teacher_lp

    def step(self, optim: torch.optim.Optimizer, rollouts: list[BufferedRollout],
             weights: list[float]) -> float | None:
        """One optimiser step of the student over the rollouts (None: no row to learn from)."""
        batches = self.batches(rollouts, weights)
        total = sum(b.size for b in batches)
        module = self.student.module
        sums: torch.Tensor | None = None  # [2] the step's loss and the weight of its rows, kept on the device
        optim.zero_grad(set_to_none=True)
        try:
            for batch, hidden, teacher_lp in self.taught(batches):
                logits = self.student.logits(module, batch, hidden, self.teacher.model)
                loss = distill_loss(logits, batch, teacher_lp) * (batch.size / total)
                loss.backward()  # a piece whose rows all weigh 0 adds 0 to the loss and the gradients
                piece = torch.stack([loss.detach(), batch.weights.sum()])
                sums = piece if sums is None else sums + piece
        except GateClosed:
            optim.zero_grad(set_to_none=True)
            raise
        if sums is None:
            return None
        loss_sum, weight = sums.tolist()  # the step's one host sync
        if weight == 0:
            return None
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optim.step()
        return loss_sum

    @torch.no_grad()
    def measure(self, modules: list[torch.nn.Module], rollouts: list[BufferedRollout]) -> tuple[list[float], int]:
        """Expected tokens per verify step (k drafts) of each module on the same rollouts, and the number of
        start positions each is the mean of."""
        lengths: list[list[torch.Tensor]] = [[] for _ in modules]
        training = [m.training for m in modules]
        try:
            for m in modules:
                m.eval()
            for batch, hidden, teacher_lp in self.taught(self.batches(rollouts, [1.0] * len(rollouts))):
                keep = batch.weights > 0
                for j, module in enumerate(modules):
                    beta = acceptance(self.student.logits(module, batch, hidden, self.teacher.model), batch,
                                      teacher_lp)
                    lengths[j].append(expected_lengths(beta[keep], batch.owner[keep], self.cfg.k))
        finally:
            for m, was in zip(modules, training, strict=True):
                m.train(was)
        positions = sum(t.numel() for t in lengths[0]) if modules else 0
        return [float(torch.cat(ls).mean()) if positions else 1.0 for ls in lengths], positions
