"""The drafter interface: propose k tokens per running sequence; keep whatever state follows the batch."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch
from torch import nn

from service.engine.batch_tensors import DraftProposal, SamplingBatch
from service.engine.types import Sequence, SlotCopy


class Drafter(ABC):
    """A source of draft tokens. `propose` must not change what the target sees; verification is exact
    whatever a drafter proposes, so a bad drafter costs speed, never correctness."""

    name: str = "drafter"
    version: str = "0"
    # A draft position's own work over a target position's (multiply-adds), what the strategy assumes until it
    # measures the drafter: 0 for one that drafts on the host (a suffix table)
    own_cost: float = 0.0
    # "draft_model" or "eagle" for a drafter with weights a trainer pushes (`weights`, `swap_weights`); None: none
    weights_kind: str | None = None

    @abstractmethod
    def propose(self, seqs: list[Sequence], k: int, sb: SamplingBatch) -> DraftProposal:
        """Draft tokens [B, k] for sequences in slot order, with their distributions (None = one-hot)."""

    def lookahead(self, seqs: list[Sequence], k: int) -> list[list[int]] | None:
        """The drafts (up to k) `propose` would give each row, where the drafter knows them on the host before
        the step (a suffix table); None where only proposing tells (a draft model)."""
        return None

    def catch_up(self, seqs: list[Sequence]) -> int:
        """How many tokens `propose` would feed before drafting beyond what follows this drafter's own step (a
        draft model after other arms ran: the tokens it missed). 0 for one that keeps up with every step (a
        suffix table). `propose` reports them with their seconds (`DraftProposal.caught_up`)."""
        return 0

    def prefill(self, slot_lo: int, prompts: list[list[int]], seqs: list[Sequence]) -> None:
        """Called with the target's prefill: rows slot_lo.. hold the distinct prompts (`seqs`: every admitted
        sample; the target's fork copies then reach the drafter through `apply_copies`)."""

    def after_step(self, seqs: list[Sequence], prev_num_tokens: list[int], num_accepted: list[int], k: int) -> None:
        """Called after a speculative step with each row's accepted draft count."""

    def observe(self, seq: Sequence) -> None:
        """Called whenever a sequence gained tokens (any step kind) or finished."""

    def observe_target_hidden(self, write_slots: torch.Tensor, write_pos: torch.Tensor, hidden: torch.Tensor) -> None:
        """The target's final hidden states of every target forward, one row [N, H] per token computed, with the
        cache slot and position of each ([N] each; N = B * Q unless the forward was packed)."""

    def apply_copies(self, copies: list[SlotCopy]) -> None:
        """Follow the target cache's slot moves and forks."""

    def weights(self) -> nn.Module | None:
        """The module a push replaces (of kind `weights_kind`), or None for a drafter without weights."""
        return None

    def swap_weights(self, module: nn.Module, version: str) -> None:
        """Serve `module` from the next proposal on (between steps)."""
        raise ValueError(f"drafter {self.name!r} has no weights to swap")


def clock(device: torch.device) -> float:
    """Wall seconds once the device's queued work is done (a host sync on a GPU): for timing one pass."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
