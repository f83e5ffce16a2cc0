"""A decoder with its own static KV cache: builds each forward's attention metadata and runs it eagerly, compiled
(CPU) or as replayed CUDA graphs. The target's (service/engine/runner.py) and a draft model's or EAGLE head's
(service/engine/drafters/) forwards all go through one.

CUDA graphs (`StepGraphs`): on a GPU a small model's step is mostly kernel launches, and a graph replays a
captured forward with one. It needs fixed shapes and addresses, so a step is padded to a bucket of batch rows
(padded rows write a scratch position), query positions (1 or k + 1, never padded) and a power-of-two bucket of
keys. Mask, RoPE and cache writes are computed inside the graph from a static position buffer; the host copies
only token ids and positions. Decode graphs and the strategy's verify depths are captured at start-up, the rest
on first use (such a step is not a cost measurement). The graphs of the last two models are kept, so a
pushed-into spare finds its graphs again. A graph computes the same forward as the eager step over more masked
keys: lossless. Without CUDA, `capture=False` runs the same static-buffer function eagerly (CPU tests check it
against the unpadded step). docs/design-notes.md has the details.
"""

from __future__ import annotations

import gc
import logging
import math
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable

import torch

from service.engine.batch_tensors import graph_positions, packed_rows, padded_ids, positions, write_slots
from service.engine.batch_tensors import last_rows as last_rows_of
from service.engine.compiled import available as compiled_available
from service.engine.compiled import compiled_forward
from service.engine.kv_cache import KVCache
from service.models import attention
from service.models.llama import AttnMeta, CausalLM
from service.models.packed import ensure_packed
from service.models.rope import Rope

logger = logging.getLogger(__name__)

PACK_MIN_MACS = 5e8  # a packed forward saves at least this many multiply-adds (a few ms of one CPU core)
# The sizes the batched compiled variants are compiled at (see `CachedModel.warm_up`): rows, and cached positions
# over a short and a long cache (`attention.LONG_KEYS` parts them: each may run its own attention kernel).
WARM_UP_ROWS, WARM_UP_POSITIONS = 64, (128, 512)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_KEYS = 128  # the smallest key bucket; each next one doubles, the last is the whole cache
MAX_QUERY = 16  # verify of k + 1 <= 16 positions (EngineConfig caps spec_k at 15)
MODELS_KEPT = 2  # the serving model's graphs and the last one's (a pushed-into spare comes back)


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
        # Decode / verify forwards: replayed as CUDA graphs on a GPU (service/engine/cached_model.py), compiled with
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
        pos = positions(starts, q_lens, Q, self.cache.scratch_pos, dev)
        slots = write_slots(slot_lo, B, Q, dev)
        kv_len = max(s + n for s, n in zip(starts, q_lens, strict=True))
        meta = self.meta_for(slot_lo, pos, slots, kv_len, attention.pick(self.attn_kernels, B, Q, kv_len))
        if pack and self.pack_min_saved is not None and B * Q - sum(q_lens) >= self.pack_min_saved:
            packed = packed_rows(q_lens, Q, dev)
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
        meta, _ = self.build_meta(slot_lo, starts, q_lens, pack=True)
        hidden = self.forward(padded_ids(tokens, self.device), meta)
        return hidden.reshape(-1, hidden.shape[-1]), last_rows_of(q_lens, meta.packed is not None, self.device)


def key_buckets(max_positions: int) -> list[int]:
    out, n = [], MIN_KEYS
    while n < max_positions:
        out.append(n)
        n *= 2
    return [*out, max_positions]


class _Graph:
    """One captured (or, without capture, directly run) forward at one (batch, query, keys) bucket."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool, stream: torch.cuda.Stream | None) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        if stream is None:  # no capture: run directly
            self.out: torch.Tensor | None = None
            return
        # One eager run at this very shape on the capture stream first: cuBLAS and SDPA pick and set up their
        # kernels (workspaces, handles) lazily per shape, which must not happen inside a capture.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # No garbage collection inside a capture: freeing a dropped engine's graphs there can invalidate it. Other
        # threads (a weight push staging tensors on the device) may go on: their work is not captured.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self.out = fn()  # [Bb, Q, hidden], static
        finally:
            if collecting:
                gc.enable()

    def run(self) -> torch.Tensor:
        if self.graph is None:
            self.out = self.fn()
        else:
            self.graph.replay()
        return self.out


class StepGraphs:
    """Graphs of one `CachedModel`'s uniform forwards (every row appends the same number of tokens)."""

    def __init__(self, cached: CachedModel, max_batch: int, capture: bool = True) -> None:
        self.cached = cached
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.key_buckets = key_buckets(cached.cache.max_positions)
        dev = cached.device
        n = max_batch * MAX_QUERY
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)  # static inputs, shared by every graph
        self.pos = torch.full((n,), cached.cache.scratch_pos, dtype=torch.int64, device=dev)
        self.slots = torch.arange(max_batch, device=dev).repeat_interleave(MAX_QUERY)  # sliced per Q below
        self._graphs: OrderedDict[int, tuple[torch.nn.Module, object, dict]] = OrderedDict()
        self.built = 0  # graphs built (captured, on CUDA) so far
        self.stream = torch.cuda.Stream(dev) if capture else None  # warm-ups and captures

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    def fits(self, batch: int, q_len: int) -> bool:
        return batch <= self.max_batch and q_len <= MAX_QUERY

    def _table(self) -> tuple[torch.nn.Module, object, dict]:
        """This model's graphs (and pool), the model's entry refreshed as most recently used."""
        model = self.cached.model
        entry = self._graphs.get(id(model))
        if entry is None or entry[0] is not model:
            pool = torch.cuda.graph_pool_handle() if self.stream is not None else None
            entry = (model, pool, {})
            self._graphs[id(model)] = entry
            while len(self._graphs) > MODELS_KEPT:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(id(model))
        return entry

    def _build(self, Bb: int, Q: int, L: int, pool) -> _Graph:
        cached, slot_ids = self.cached, self.slots.view(-1, MAX_QUERY)[:Bb, :Q].reshape(-1)

        def forward() -> torch.Tensor:
            pos = self.pos[: Bb * Q].view(Bb, Q)
            meta = cached.meta_for(0, pos, slot_ids, L, "sdpa")
            return cached.forward(self.ids[: Bb * Q].view(Bb, Q), meta)

        graph = _Graph(forward, pool, self.stream)
        self.built += 1
        logger.debug("captured a graph for batch %d x %d positions over %d keys", Bb, Q, L)
        return graph

    def capture_all(self, query_lens: list[int]) -> int:
        """Build every graph for these query lengths (all batch and key buckets) up front, so that no step of a
        rollout pays a capture; returns how many were built. Positions are the scratch one: nothing real is
        written."""
        _, pool, graphs = self._table()
        built = self.built
        self.pos.fill_(self.cached.cache.scratch_pos)  # a warm-up run writes K/V only at scratch positions
        for Q in query_lens:
            for Bb in reversed(self.batch_buckets):  # largest first: later captures reuse the pool's blocks
                for L in self.key_buckets:
                    if (Bb, Q, L) not in graphs:
                        graphs[(Bb, Q, L)] = self._build(Bb, Q, L, pool)
        return self.built - built

    def forward(self, ids: torch.Tensor, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [B, Q] appended at positions starts[b]... -> hidden [B, Q, H] (a view of the graph's output),
        and the real rows' cache slots and positions [B * Q] (for drafters that keep per-position features)."""
        B, Q = ids.shape
        Bb = self.batch_buckets[bisect_left(self.batch_buckets, B)]
        kv_len = max(starts) + Q
        L = self.key_buckets[bisect_left(self.key_buckets, kv_len)]
        scratch = self.cached.cache.scratch_pos
        self.pos[: Bb * Q].copy_(graph_positions(starts, Q, Bb, scratch), non_blocking=True)
        self.ids[: B * Q].copy_(ids.reshape(-1))
        _, pool, graphs = self._table()
        graph = graphs.get((Bb, Q, L))
        if graph is None:  # inputs first: a capture's warm-up runs this very step
            graph = graphs[(Bb, Q, L)] = self._build(Bb, Q, L, pool)
        return graph.run()[:B], self.slots.view(-1, MAX_QUERY)[:B, :Q].reshape(-1), self.pos[: B * Q]
