"""Static KV cache indexed by (slot, position): allocated once, sized from a memory budget.

Layout per layer: k, v = [num_slots, num_kv_heads, max_positions, head_dim]. A sequence's K/V for token
position t lives at [slot, :, t]; shortening a sequence (rejected drafts) is only a change of its length.
The last position of every slot is a scratch sink that padded query rows write into.
"""

from __future__ import annotations

import logging

import torch

from service.config import ModelConfig
from service.engine.types import SlotCopy

logger = logging.getLogger(__name__)


def slots_for_budget(cfg: ModelConfig, max_positions: int, dtype: torch.dtype, budget_bytes: float) -> int:
    per_slot = cfg.kv_bytes_per_token * max_positions * torch.empty((), dtype=dtype).element_size()
    return int(budget_bytes // per_slot)


class KVCache:
    def __init__(
        self, cfg: ModelConfig, num_slots: int, max_positions: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if num_slots < 1:
            raise ValueError("KV cache needs at least one slot: raise the memory budget or lower max_model_len")
        self.num_slots = num_slots
        self.max_positions = max_positions  # includes the scratch position at the end
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_positions, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        logger.info(
            "KV cache: %d slots x %d positions, %.1f MiB", num_slots, max_positions,
            2 * self.k.numel() * self.k.element_size() / 2**20,
        )

    @classmethod
    def scratch_like(cls, other: KVCache) -> KVCache:
        """A cache of `other`'s shape that nothing serves from, to compile forwards on while `other` serves
        (service/engine/background_compile.py). Allocated, not zeroed: on Linux a page of it takes memory only
        once written, and a warm-up writes a few positions per slot."""
        scratch = cls.__new__(cls)
        scratch.num_slots, scratch.max_positions = other.num_slots, other.max_positions
        scratch.k, scratch.v = torch.empty_like(other.k), torch.empty_like(other.v)
        return scratch

    @property
    def scratch_pos(self) -> int:
        return self.max_positions - 1

    def copy_slots(self, copies: list[SlotCopy]) -> None:
        """Apply slot copies in order (compaction moves, prompt forks for n > 1)."""
        for c in copies:
            if c.length > 0 and c.src != c.dst:
                self.k[:, c.dst, :, : c.length] = self.k[:, c.src, :, : c.length]
                self.v[:, c.dst, :, : c.length] = self.v[:, c.src, :, : c.length]
