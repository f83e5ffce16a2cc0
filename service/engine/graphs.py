"""CUDA graphs of a cached model's decode and verify forwards, over padded shape buckets.

On a GPU a small model's step is mostly kernel launches; a graph replays a captured forward with one launch. It
needs fixed shapes and addresses, so a step is padded to a bucket: batch rows (padded rows write a scratch
position), query positions per row (1 or k + 1, never padded) and a power-of-two bucket of keys. Mask, RoPE and
cache writes are computed inside the graph from a static position buffer; the host copies only token ids and
positions. Decode graphs and the strategy's verify depths are captured at start-up, the rest on first use (such a
step is not fed to the strategy as a cost). Graphs of one model share a memory pool; those of the last two models
are kept, so a pushed-into spare finds its graphs again. Prefill, catch-up and the EAGLE head run eagerly.

A graph computes the same forward as the eager step over more masked keys, so drafting and verification read one
consistent target distribution: lossless. Without CUDA, `capture=False` runs the same static-buffer function eagerly,
which CPU tests check against the unpadded step. docs/design-notes.md has the details.
"""

from __future__ import annotations

import gc
import logging
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from service.engine.cached_model import CachedModel

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_KEYS = 128  # the smallest key bucket; each next one doubles, the last is the whole cache
MAX_QUERY = 16  # verify of k + 1 <= 16 positions (EngineConfig caps spec_k at 15)
MODELS_KEPT = 2  # the serving model's graphs and the last one's (a pushed-into spare comes back)


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
        host = [s + j for s in starts for j in range(Q)] + [scratch] * ((Bb - B) * Q)
        self.pos[: Bb * Q].copy_(torch.tensor(host, dtype=torch.int64), non_blocking=True)
        self.ids[: B * Q].copy_(ids.reshape(-1))
        _, pool, graphs = self._table()
        graph = graphs.get((Bb, Q, L))
        if graph is None:  # inputs first: a capture's warm-up runs this very step
            graph = graphs[(Bb, Q, L)] = self._build(Bb, Q, L, pool)
        return graph.run()[:B], self.slots.view(-1, MAX_QUERY)[:B, :Q].reshape(-1), self.pos[: B * Q]
