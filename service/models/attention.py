"""Attention of a step's new query rows over the static KV cache: two kernels, chosen per machine by timing.

- `sdpa`: one `F.scaled_dot_product_attention` call with the additive mask in the model dtype. On CPU its flash
  kernel reads the bf16 cache in place and accumulates in float32.
- `bmm`: scores in float32 (one baddbmm with the scale and a float32 mask, a float32 softmax, one bmm with V);
  bf16 caches are converted per layer. At tiny sizes (batch x keys <= `TINY_ROWS_X_KEYS`) it hands over to
  SDPA, whose single call costs less than its dispatches.

Neither wins everywhere, by a lot: decode on the demo model in bf16 at batch 64, 2 threads (bench/step_profile.py),
sdpa 3.5 ms and bmm 5.7 ms on an Intel Xeon with AMX; sdpa 3.1 ms and bmm 2.1 ms on an AMD EPYC (AVX512-BF16, no
AMX), where the flash kernel's share of the step was 65%. So `choose` times both on the model's own head layout
at decode and verify shapes the first time a layout is installed in a process, and every cache-attached forward
of that layout runs the faster one from then on (the runner's `CachedModel` records it in `AttnMeta.kernel`).
CUDA always runs `sdpa`. Both kernels compute the same attention, rounded differently: every exactness test
runs on whichever this machine chose.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

KERNELS = ("sdpa", "bmm")
TINY_ROWS_X_KEYS = 512
TIMED_SHAPES = ((32, 1, 256), (32, 5, 256))  # (batch, query positions, keys): a decode and a verify step
WIN_MARGIN = 0.9  # bmm must take under this fraction of sdpa's time to be chosen (sdpa is one call)

_chosen: dict[tuple, str] = {}  # (device type, dtype, Hkv, G, D) -> kernel


def mask_dtype(kernel: str, model_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if kernel == "bmm" else model_dtype


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     kernel: str = "sdpa") -> torch.Tensor:
    """q [B, Hkv, G * Q, D] over cache views keys/values [B, Hkv, L, D] with an additive mask [B, Hkv, G * Q, L]
    (0 = attend, -inf = not; in `mask_dtype(kernel, ...)`) -> [B, Hkv, G * Q, D] in q's dtype."""
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
    B, Hkv, GQ, D = q.shape
    L = keys.shape[2]
    if B * L <= TINY_ROWS_X_KEYS:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias.to(q.dtype))
    # Cache views fold (B, Hkv) into one batch axis without a copy: the slot stride is a multiple of the head's.
    qf = q.reshape(B * Hkv, GQ, D).float()
    kf = keys.reshape(B * Hkv, L, D).float()
    probs = torch.baddbmm(bias.view(B * Hkv, GQ, L), qf, kf.transpose(1, 2), alpha=D**-0.5).softmax(-1)
    return torch.bmm(probs.to(values.dtype), values.reshape(B * Hkv, L, D)).view(B, Hkv, GQ, D)


def _median_seconds(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def choose(num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, device: torch.device,
           timer: Callable[[Callable[[], object]], float] | None = None) -> str:
    """The kernel for this head layout on this device: `sdpa` on CUDA, the faster one on CPU (timed once)."""
    key = (device.type, dtype, num_kv_heads, group, head_dim)
    if device.type != "cpu":
        return "sdpa"
    if key not in _chosen:
        timer = timer or _median_seconds
        totals = dict.fromkeys(KERNELS, 0.0)
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for B, Q, L in TIMED_SHAPES:
                q = torch.randn(B, num_kv_heads, group * Q, head_dim, generator=gen).to(dtype)
                cache = torch.randn(2, B, num_kv_heads, 2 * L, head_dim, generator=gen).to(dtype)
                keys, values = cache[0, :, :, :L], cache[1, :, :, :L]  # views into a longer cache, as served
                for kernel in KERNELS:
                    bias = torch.zeros(B, num_kv_heads, group * Q, L, dtype=mask_dtype(kernel, dtype))
                    totals[kernel] += timer(lambda a=(q, keys, values, bias, kernel): cached_attention(*a))
        _chosen[key] = "bmm" if totals["bmm"] < WIN_MARGIN * totals["sdpa"] else "sdpa"
        logger.info("attention over the cache (%s, %d KV heads x %d, head_dim %d): %s (sdpa %.2f ms, bmm %.2f ms)",
                    dtype, num_kv_heads, group, head_dim, _chosen[key], totals["sdpa"] * 1e3, totals["bmm"] * 1e3)
    return _chosen[key]
