"""Draft model: a small causal LM sharing the target's tokenizer, with its own KV cache in the same slots.

A sequence's draft cache holds positions [0, seq.draft_cached). Each proposal first catches up on the
tokens the draft has not seen (after a prefill, after SD was off, after accepted tokens) in one extend pass,
then decodes k - 1 more tokens. After verification the valid draft prefix is cut back to what was accepted,
which is a length change only.
"""

from __future__ import annotations

import torch

from service.config import ModelConfig
from service.engine.batch_tensors import DraftProposal, SamplingBatch
from service.engine.cached_model import CachedModel
from service.engine.drafters.base import Drafter, clock
from service.engine.kv_cache import KVCache
from service.engine.sampler import draw_draft
from service.engine.types import Sequence, SlotCopy
from service.models.llama import CausalLM


class DraftModelDrafter(Drafter):
    name = "draft"
    weights_kind = "draft_model"

    def __init__(self, model: CausalLM, target_cfg: ModelConfig, num_slots: int, max_positions: int,
                 device: torch.device, version: str = "0", compiled: bool = False) -> None:
        dtype = next(model.parameters()).dtype
        cache = KVCache(model.config, num_slots, max_positions, dtype, device)
        # The draft model with its own KV cache; its k - 1 decode forwards per proposal are graphed (GPU) or
        # compiled (CPU) like the target's where the target's are.
        self.cached = CachedModel(model, cache, device, compiled)
        self.device = device
        self.version = version
        self.target_vocab = target_cfg.vocab_size
        # What the strategy assumes a draft position costs until it measures one (base.py)
        self.own_cost = model.config.macs_per_token / target_cfg.macs_per_token
        self._stale = False  # the weights changed since the last proposal
        self._current: set[int] = set()  # sequences prefilled since then: their cache is the new weights'

    def weights(self) -> CausalLM:
        return self.cached.model

    def swap_weights(self, model: CausalLM, version: str) -> None:
        """Serve a new drafter from the next proposal on; every sequence admitted before catches up again."""
        self.cached.model = model
        self.version = version
        self._stale = True
        self._current.clear()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (checkpoints often pad vocabularies differently)."""
        logits = self.cached.model.logits(hidden)
        V, Vd = self.target_vocab, logits.shape[-1]
        if Vd >= V:
            return logits[..., :V]
        return torch.nn.functional.pad(logits, (0, V - Vd), value=float("-inf"))

    def prefill(self, slot_lo: int, prompts: list[list[int]], seqs: list[Sequence]) -> None:
        # The prompts enter the draft cache with the target's prefill, one row per distinct prompt (the forks
        # copy them like the target's): the first proposal then catches up on the output alone, not on every
        # sample's whole prompt (0.15 s of a 0.8 s GRPO rollout on a CPU).
        self.cached.extend(slot_lo, [0] * len(prompts), prompts)
        for s in seqs:
            s.draft_cached = len(s.prompt_token_ids)
            if self._stale:
                self._current.add(s.seq_id)

    def observe(self, seq: Sequence) -> None:
        if seq.is_finished:  # a push may be followed by no proposal for long: forget finished samples meanwhile
            self._current.discard(seq.seq_id)

    def _fed_from(self, s: Sequence) -> int:
        """The first position the next proposal feeds for s: its draft cache's length, 0 after a push (but for
        samples prefilled with the new weights)."""
        if self._stale and s.seq_id not in self._current:
            return 0
        return min(s.draft_cached, s.num_tokens - 1)

    def catch_up(self, seqs: list[Sequence]) -> int:
        return _beyond_own_step(seqs, [self._fed_from(s) for s in seqs])

    def propose(self, seqs: list[Sequence], k: int, sb: SamplingBatch) -> DraftProposal:
        B = len(seqs)
        # Catch up: feed every token the draft cache lacks, ending with the sequence's last token.
        starts = [self._fed_from(s) for s in seqs]
        missed = _beyond_own_step(seqs, starts)
        for s, st in zip(seqs, starts, strict=True):
            s.draft_cached = st  # after a push, every row's cache restarts (though no step may follow)
        self._stale = False
        self._current.clear()
        t0 = clock(self.device) if missed else 0.0
        fed = [s.tokens_from(st) for s, st in zip(seqs, starts, strict=True)]
        hidden, last = self.cached.extend(0, starts, fed)
        # Timed only when it caught up (a host sync on a GPU); the pass's seconds shared out by tokens fed.
        caught_up = (missed, (clock(self.device) - t0) * missed / sum(map(len, fed))) if missed else (0, 0.0)
        logits = self._logits(hidden[last])  # [B, V]
        tokens, probs = [], []
        positions = [s.num_tokens for s in seqs]
        for j in range(k):
            if j:
                hidden = self.cached.forward_rows(tokens[-1][:, None], [p + j - 1 for p in positions])[0]
                logits = self._logits(hidden[:, 0])
            tok, q = draw_draft(logits, sb, j, tokens)
            tokens.append(tok)
            probs.append(q)
        return DraftProposal(
            tokens=torch.stack(tokens, dim=1),
            lengths=torch.full((B,), k, dtype=torch.int64, device=self.device),
            probs=torch.stack(probs, dim=1),
            row_lengths=[k] * B,
            caught_up=caught_up,
        )

    def after_step(self, seqs: list[Sequence], prev_num_tokens: list[int], num_accepted: list[int], k: int) -> None:
        # Valid draft positions: everything before the last token, plus the accepted drafts it computed.
        for s, t, a in zip(seqs, prev_num_tokens, num_accepted, strict=True):
            s.draft_cached = t + min(k - 1, a)

    def apply_copies(self, copies: list[SlotCopy]) -> None:
        self.cached.cache.copy_slots(copies)


def _beyond_own_step(seqs: list[Sequence], starts: list[int]) -> int:
    """Tokens fed from `starts` beyond what follows the drafter's own step: a row's last token, and the bonus
    when every draft was accepted."""
    return sum(max(s.num_tokens - st - 2, 0) for s, st in zip(seqs, starts, strict=True))
