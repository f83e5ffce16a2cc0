"""EAGLE-style draft head: one decoder layer over [token embedding ‖ target feature], sharing the target's
embedding and LM head.

Feature f_t is the target's final (normed) hidden state at position t. Head position t reads (f_t, x_{t+1})
and predicts f_{t+1}, whose logits (through the target's LM head) draft x_{t+2}. Drafting continues from the
head's own predicted features. Target features of every position are kept in a per-slot store written by each
target forward, so the head catches up after a prefill or a plain stretch in one extend pass, like a draft
model. After verification the head's cache is cut back to positions that used real features, so each proposal
feeds the tokens the last step emitted; what it feeds beyond those (a row's prompt on its first proposal, the
tokens of steps other arms ran) is its catch-up, told to the strategy before the step (`catch_up`) and timed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from service.config import ModelConfig
from service.engine.batch_tensors import DraftProposal, SamplingBatch, int_tensor, padded_ids
from service.engine.cached_model import CachedModel
from service.engine.drafters.base import Drafter, clock
from service.engine.kv_cache import KVCache
from service.engine.sampler import draw_draft
from service.engine.types import Sequence, SlotCopy
from service.models.llama import AttnMeta, CausalLM, DecoderLayer, RMSNorm
from service.models.packed import Linear


class EagleHead(nn.Module):
    def __init__(self, target_cfg: ModelConfig) -> None:
        super().__init__()
        self.config = replace(target_cfg, num_layers=1)
        H = target_cfg.hidden_size
        self.fc = Linear(2 * H, H, bias=False)
        self.layer = DecoderLayer(self.config, 0)
        self.norm = RMSNorm(H, target_cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, meta: AttnMeta,
                k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None) -> torch.Tensor:
        """embeds, features [B, Q, H] -> predicted next features [B, Q, H]. No caches with a causal_meta."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        return self.norm(self.layer(x, meta, k_cache, v_cache))


def init_head(target_cfg: ModelConfig, seed: int = 0) -> EagleHead:
    """A freshly initialised head (what the distillation sidecar starts from)."""
    gen = torch.Generator().manual_seed(seed)
    head = EagleHead(target_cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return head


def load_head(path: Path, target_cfg: ModelConfig) -> EagleHead:
    head = EagleHead(target_cfg)
    tensors = load_file(str(Path(path) / "model.safetensors"))
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"EAGLE head weights at {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return head


class EagleDrafter(Drafter):
    name = "eagle"
    weights_kind = "eagle"

    def __init__(self, head: EagleHead, target: CachedModel, num_slots: int, device: torch.device,
                 version: str = "0") -> None:
        self.target = target  # the runner's target: its current model's embedding and LM head are used
        dtype = target.dtype
        self.head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
        cache = KVCache(head.config, num_slots, target.cache.max_positions, dtype, device)
        self.cached = CachedModel(self.head, cache, device)
        H = target.cfg.hidden_size
        self.features = torch.zeros(num_slots, target.cache.max_positions, H, dtype=dtype, device=device)
        self.cached_positions: dict[int, int] = {}  # seq_id -> head positions with real features
        self.own_step: dict[int, int] = {}  # seq_id -> its tokens after the last step the head drafted for
        self.device = device
        self.version = version
        # A draft position: the fc over [embedding, feature], one decoder layer and the target's LM head
        self.own_cost = (2 * H * H + head.config.layer_macs + H * target.cfg.vocab_size) / target.cfg.macs_per_token

    def weights(self) -> EagleHead:
        return self.head

    def swap_weights(self, head: EagleHead, version: str) -> None:
        self.head = head.to(device=self.device, dtype=self.target.dtype).eval().requires_grad_(False)
        self.cached.model = self.head
        self.version = version
        self.cached_positions.clear()  # every sequence catches up on the new head
        self.own_step.clear()

    def observe_target_hidden(self, write_slots: torch.Tensor, write_pos: torch.Tensor, hidden: torch.Tensor) -> None:
        self.features[write_slots, write_pos] = hidden.reshape(-1, hidden.shape[-1])

    def apply_copies(self, copies: list[SlotCopy]) -> None:
        self.cached.cache.copy_slots(copies)
        for c in copies:
            if c.length > 0 and c.src != c.dst:
                self.features[c.dst, : c.length] = self.features[c.src, : c.length]

    def observe(self, seq: Sequence) -> None:
        if seq.is_finished:
            self.cached_positions.pop(seq.seq_id, None)
            self.own_step.pop(seq.seq_id, None)

    def _start(self, s: Sequence) -> int:
        """The first head position the next proposal feeds for s (inputs (f_t, x_{t+1}))."""
        return min(self.cached_positions.get(s.seq_id, 0), s.num_tokens - 2)

    def _beyond_own_step(self, s: Sequence, start: int) -> int:
        """Positions the next proposal feeds for s (from `start`) beyond the tokens its own last step emitted."""
        own = self.own_step.get(s.seq_id)
        return max(s.num_tokens - own, 0) if own is not None else s.num_tokens - 1 - start

    def catch_up(self, seqs: list[Sequence]) -> int:
        return sum(self._beyond_own_step(s, self._start(s)) for s in seqs)

    def after_step(self, seqs: list[Sequence], prev_num_tokens: list[int], num_accepted: list[int], k: int) -> None:
        for s, t, a in zip(seqs, prev_num_tokens, num_accepted, strict=True):
            self.own_step[s.seq_id] = t + a + 1  # the accepted drafts and the token sampled after them

    def _draft_logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.target.model.logits(feature)

    def propose(self, seqs: list[Sequence], k: int, sb: SamplingBatch) -> DraftProposal:
        B, dev = len(seqs), self.device
        target = self.target.model
        # Catch up on head positions [start, T - 1): inputs (f_t, x_{t+1}); f_t is known for t < T - 1.
        starts = [self._start(s) for s in seqs]
        missed = sum(self._beyond_own_step(s, st) for s, st in zip(seqs, starts, strict=True))
        t0 = clock(dev) if missed else 0.0
        tokens = [s.tokens_from(st + 1) for s, st in zip(seqs, starts, strict=True)]
        q_lens = [len(t) for t in tokens]
        ids = padded_ids(tokens, dev)
        meta, pos = self.cached.build_meta(0, starts, q_lens)
        feats = self.features[torch.arange(B, device=dev)[:, None], pos]  # [B, Q, H]
        out = self.head(target.embed_tokens(ids), feats, meta, self.cached.cache.k, self.cached.cache.v)
        last = int_tensor([n - 1 for n in q_lens], dev)
        feature = out[torch.arange(B, device=dev), last]  # predicted f_{T-1}: [B, H]
        # Timed only when it caught up (a host sync on a GPU); the pass's seconds shared out by positions fed.
        caught_up = (missed, (clock(dev) - t0) * missed / sum(q_lens)) if missed else (0, 0.0)
        draft_tokens, draft_probs = [], []
        for j in range(k):
            if j:
                meta, _ = self.cached.build_meta(0, [s.num_tokens - 2 + j for s in seqs], [1] * B)
                emb = target.embed_tokens(draft_tokens[-1])[:, None]
                feature = self.head(emb, feature[:, None], meta, self.cached.cache.k, self.cached.cache.v)[:, 0]
            tok, q = draw_draft(self._draft_logits(feature), sb, j, draft_tokens)
            draft_tokens.append(tok)
            draft_probs.append(q)
        for s in seqs:
            self.cached_positions[s.seq_id] = s.num_tokens - 1
        return DraftProposal(torch.stack(draft_tokens, 1), torch.full((B,), k, dtype=torch.int64, device=dev),
                             torch.stack(draft_probs, 1), [k] * B, caught_up=caught_up)


def build_eagle(path: str | None, target: CachedModel, num_slots: int, device: torch.device,
                seed: int) -> EagleDrafter:
    """A fresh head (no path: `--drafter eagle`) or the head weights from path/model.safetensors."""
    head = load_head(Path(path), target.cfg) if path else init_head(target.cfg, seed)
    return EagleDrafter(head, target, num_slots, device)


__all__ = ["CausalLM", "EagleDrafter", "EagleHead", "build_eagle", "init_head", "load_head"]
