"""A decoder with its own static KV cache: builds each forward's attention metadata and runs it eagerly, compiled
(CPU) or as replayed CUDA graphs. The target's (service/engine/runner.py) and a draft model's or EAGLE head's
(service/engine/drafters/) forwards all go through one."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable

import torch

from service.engine.compiled import available as compiled_available
from service.engine.compiled import compiled_forward
from service.engine.graphs import StepGraphs
from service.engine.kv_cache import KVCache
from service.engine.sampler import int_tensor
from service.models import attention
from service.models.llama import AttnMeta, CausalLM
from service.models.packed import ensure_packed
from service.models.rope import Rope

logger = logging.getLogger(__name__)

PACK_MIN_MACS = 5e8  # a packed forward saves at least this many multiply-adds (a few ms of one CPU core)
# The sizes the batched compiled variants are compiled at (see `CachedModel.warm_up`): rows, and cached positions
# over a short and a long cache (`attention.LONG_KEYS` parts them: each may run its own attention kernel).
WARM_UP_ROWS, WARM_UP_POSITIONS = 64, (128, 512)


class CachedModel:
    """A decoder with its own static KV cache and RoPE table; builds the per-forward attention metadata."""

    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device, compiled: bool = False) -> None:
        self.model = model  # packs its linear layers' weights for this device (service/models/packed.py)
        self.cfg = model.config
        self.cache = cache
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.rope = Rope(self.cfg, cache.max_positions, device, self.dtype)
        Hkv = self.cfg.num_kv_heads
        # The attention kernel this machine runs faster for each kind of step and cache length (`attention.pick`)
        self.attn_kernels = attention.choose(Hkv, self.cfg.num_heads // Hkv, self.cfg.head_dim, self.dtype, device)
        # Decode / verify forwards: replayed as CUDA graphs on a GPU (service/engine/graphs.py), compiled with
        # torch.compile on CPU (service/engine/compiled.py), else eager.
        self.graphs = StepGraphs(self, cache.num_slots) if compiled and device.type == "cuda" else None
        self.compiled = compiled_forward if compiled and device.type == "cpu" and compiled_available() else None
        # Rows of different lengths run packed (`AttnMeta.packed`, eagerly) where that saves at least this many
        # positions: PACK_MIN_MACS of linear-layer work, more than eager costs over compiled code on a small
        # model. Never where the GPU replays graphs of the padded passes.
        macs = self.cfg.num_layers * self.cfg.layer_macs
        self.pack_min_saved = None if self.graphs is not None else max(1, math.ceil(PACK_MIN_MACS / macs))

    @property
    def model(self) -> CausalLM:
        return self._model

    @model.setter
    def model(self, model: CausalLM) -> None:
        # Pushed weights come laid out already (service/engine/weights.py stages them so): nothing to do here then
        ensure_packed(model)
        self._model = model

    def build_meta(self, slot_lo: int, starts: list[int], q_lens: list[int], pack: bool = False,
                   width: int | None = None) -> tuple[AttnMeta, torch.Tensor]:
        """Rows b = slots slot_lo + b append q_lens[b] tokens at positions starts[b]...; returns meta and
        the [B, Q] position tensor (padding entries point at the scratch position; Q = `width`, default the
        longest row). `pack`: rows of different lengths compute their real tokens only (`AttnMeta.packed`;
        eager forwards only)."""
        B, Q = len(starts), width or max(q_lens)
        dev = self.device
        # Positions [B, Q] and the cache slot of each new token [B * Q] as tensors of their own: a view into a
        # shared one has a storage offset, which the compiled forward takes as a size (see compiled.py).
        if all(n == Q for n in q_lens):  # decode and verify steps: no padding, built from `starts` alone
            pos = int_tensor(starts, dev)[:, None] + torch.arange(Q, device=dev)
        else:
            scratch = self.cache.scratch_pos
            pos = torch.tensor([[s + j if j < n else scratch for j in range(Q)] for s, n in zip(starts, q_lens,
                                strict=True)], dtype=torch.int64, device=dev)
        slots = torch.arange(slot_lo, slot_lo + B, device=dev).repeat_interleave(Q)
        kv_len = max(s + n for s, n in zip(starts, q_lens, strict=True))
        meta = self.meta_for(slot_lo, pos, slots, kv_len, attention.pick(self.attn_kernels, B, Q, kv_len))
        if pack and self.pack_min_saved is not None and B * Q - sum(q_lens) >= self.pack_min_saved:
            packed = torch.tensor([b * Q + j for b, n in enumerate(q_lens) for j in range(n)], device=dev)
            meta.packed = packed
            meta.write_slots, meta.write_pos = meta.write_slots[packed], meta.write_pos[packed]
            meta.cos = meta.cos.reshape(B * Q, *meta.cos.shape[2:])[packed]  # [N, 1, D]
            meta.sin = meta.sin.reshape(B * Q, *meta.sin.shape[2:])[packed]
        return meta, pos

    def meta_for(self, slot_lo: int, pos: torch.Tensor, write_slots: torch.Tensor, kv_len: int,
                 kernel: str) -> AttnMeta:
        """Metadata from device tensors alone (what a CUDA graph captures): positions [B, Q], the cache slot of
        each new token [B * Q], attention over cache positions [0, kv_len)."""
        B, Q = pos.shape
        # Additive mask in the dtype of this machine's attention kernel, once per step for all layers, already laid
        # out as attention's [B, Hkv, G * Q, L] (query heads grouped by KV head); padded rows see everything. The
        # cpp kernel takes the positions instead: no mask.
        bias, dtype = None, attention.mask_dtype(kernel, self.dtype)
        if dtype is not None:
            Hkv = self.cfg.num_kv_heads
            G = self.cfg.num_heads // Hkv
            hidden = torch.arange(kv_len, device=pos.device) > pos[:, None, None, :, None]  # [B, 1, 1, Q, L]
            bias = torch.zeros(B, Hkv, G, Q, kv_len, dtype=dtype, device=pos.device)
            bias.masked_fill_(hidden, -torch.inf)
            bias = bias.view(B, Hkv, G * Q, kv_len)
        cos, sin = self.rope.lookup(pos)
        return AttnMeta(slot_lo, kv_len, write_slots, pos.reshape(-1), bias, cos, sin, kernel, positions=pos)

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """input_ids [B, Q] -> final hidden states [B, Q, hidden] ([N, hidden] packed: `CausalLM.forward`)."""
        return self.model(input_ids, meta, self.cache.k, self.cache.v)

    def forward_rows(self, input_ids: torch.Tensor, starts: list[int]) -> tuple[torch.Tensor, ...]:
        """Rows b = slots b append input_ids[b] ([B, Q], the same Q for all) at positions starts[b]...: a CUDA
        graph replay where one fits, else eager. Returns hidden [B, Q, hidden] (valid until the next forward)
        and the cache slot and position of each new token ([B * Q] each)."""
        B, Q = input_ids.shape
        if self.graphs is not None and self.graphs.fits(B, Q):
            return self.graphs.forward(input_ids, starts)
        meta, _ = self.build_meta(0, starts, [Q] * B)
        return self.forward_uniform(input_ids, meta), meta.write_slots, meta.write_pos

    def forward_uniform(self, input_ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """A forward where every row appends the same number of tokens: compiled where this model compiles
        (CPU), else eager. input_ids [B, Q] -> hidden [B, Q, hidden]."""
        if self.compiled is not None:
            return self.compiled(self.model, input_ids, meta, self.cache.k, self.cache.v)
        return self.forward(input_ids, meta)

    def warm_up(self, query_lens: list[int], cache: KVCache | None = None,
                forward: Callable[..., torch.Tensor] | None = None) -> bool:
        """Compile (CPU) the uniform forwards of these query lengths: one run per compiled variant (batch 1 or
        more x one position per row or more; other sizes share them), on rows from slot 0 of `cache` (default:
        this model's own, written before any sequence owns them: call it before the first request), with
        `forward` (default: `self.compiled`; none: nothing to compile). False where the compiler stack failed
        (logged; `self.compiled` is then None: forwards run eagerly).

        The batched variants compile at a serving size (`WARM_UP_ROWS` rows over a short and a long cache,
        `WARM_UP_POSITIONS`, where each may run its own attention kernel), not the smallest: inductor decides from
        the sizes a variant is compiled at whether each of its fused loops runs on all threads, and the variant
        keeps that for every size. Compiled at batch 2 over 2 positions, every loop ran on one thread: the demo
        model in bf16 on 2 threads decoded 18,000 tokens/s at batch 64 and 12,300 at batch 16, against 29,700 and
        14,700 compiled at a serving size (bench/engine_throughput.py; batches 2-8 gained 8-15% too)."""
        forward = forward or self.compiled
        if forward is None:
            return True
        cache = cache or self.cache
        try:
            widths = sorted({min(q, 2) for q in query_lens})  # sizes 0 and 1 are specialised, not 2
            last = cache.max_positions - 1 - widths[-1]  # the last position is scratch
            short, long = (max(min(p, last), 0) for p in WARM_UP_POSITIONS)
            # The long cache only where one of its kernels differs (else the same variants: nothing to compile).
            rows = sorted({1, min(WARM_UP_ROWS, cache.num_slots)})
            kernels = [attention.pick(self.attn_kernels, B, Q, start + Q) for B in rows for Q in widths
                       for start in (short, long)]
            for start in (short, long) if kernels[0::2] != kernels[1::2] else (short,):
                for B in rows:
                    for Q in widths:
                        meta, _ = self.build_meta(0, [start] * B, [Q] * B)
                        ids = torch.ones(B, Q, dtype=torch.int64, device=self.device)
                        forward(self.model, ids, meta, cache.k, cache.v)
        except Exception as exc:  # any failure of the compiler stack: serve eagerly rather than not at all
            logger.warning("torch.compile failed, forwards run eagerly: %s: %s", type(exc).__name__, exc)
            self.compiled = None
            return False
        return True

    def extend(self, slot_lo: int, starts: list[int], tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Append per-row token lists at positions starts[b]...; returns the hidden states as rows [B * Q or N,
        hidden] and the row of each sequence's last token among them [B]."""
        q_lens = [len(t) for t in tokens]
        Q = max(q_lens)
        ids = torch.tensor([t + [0] * (Q - len(t)) for t in tokens], dtype=torch.int64, device=self.device)
        meta, _ = self.build_meta(slot_lo, starts, q_lens, pack=True)
        hidden = self.forward(ids, meta)
        return hidden.reshape(-1, hidden.shape[-1]), last_rows(meta, q_lens, self.device)


def last_rows(meta: AttnMeta, q_lens: list[int], device: torch.device) -> torch.Tensor:
    """The row of each sequence's last new token among a forward's hidden states seen as rows: [B * Q, hidden]
    on the padded grid, [N, hidden] packed (each sequence's tokens in turn)."""
    Q = max(q_lens)
    ends = itertools.accumulate(q_lens) if meta.packed is not None else (b * Q + n for b, n in enumerate(q_lens))
    return torch.tensor([e - 1 for e in ends], dtype=torch.int64, device=device)
