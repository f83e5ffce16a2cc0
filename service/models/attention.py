"""Attention of a step's new query rows over the static KV cache: three kernels, chosen per machine by timing.

- `sdpa`: one `F.scaled_dot_product_attention` call with an additive mask in the model dtype.
- `bmm`: float32 scores through baddbmm, a float32 softmax and a bmm with V; tiny sizes hand over to SDPA.
- `cpp`: our CPU kernel (attention_cpp.py); it takes each query's position instead of a mask and each row stops at
  its own keys. Left out where it cannot be built.

Neither kernel wins everywhere, and the winner depends on query positions per row and keys, so `choose` times
them per layout and kind of step, and the choice is remembered per machine (remembered.py). One-row steps run a
library kernel. Every choice is tested against transformers by forcing it. docs/design-notes.md has the figures
that motivated this.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from service.models import attention_cpp
from service.models.remembered import remembered
from service.models.timing import Timer, median_seconds

logger = logging.getLogger(__name__)

KERNELS = ("sdpa", "bmm", "cpp")
TINY_ROWS_X_KEYS = 512
# (batch, query positions, keys): decode and verify steps over a short and a long cache, in the order of each half
# of `Kernels`
TIMED_SHAPES = ((32, 1, 128), (32, 1, 512), (64, 5, 128), (64, 5, 512))
LONG_KEYS = 256  # a step attending to more keys than this runs the kernel timed over the long cache
WIN_MARGIN = 0.9  # another kernel must take under this fraction of sdpa's time to be chosen (sdpa: the default)

# Kernels a one-row step may run: the `cpp` kernel is an op implemented in Python, and its dispatch and arguments
# (15-20 us a layer) outweigh its gain at one row. Demo model, float32, one thread, compiled one-row forwards over
# 300 keys (measured with `torch.library.custom_op`, ~3 us a call dearer than the registration it has now):
# decode cpp 0.56-0.59 ms, bmm 0.44-0.46, sdpa 0.49-0.50; verify of 5 positions cpp 0.91-0.93, bmm 0.71-0.74.
ONE_ROW_KERNELS = ("sdpa", "bmm")
# The kernel for decode over a short cache, decode over a long one, verify (or prefill) short, verify long: of
# one-row steps, then of batched ones
Kernels = tuple[str, str, str, str, str, str, str, str]
_chosen: dict[tuple, Kernels] = {}  # (device type, dtype, Hkv, G, D) -> kernels


def pick(kernels: Kernels, rows: int, query_len: int, num_keys: int) -> str:
    """The kernel for a forward of `rows` rows of `query_len` positions attending to up to `num_keys` keys."""
    return kernels[4 * (rows > 1) + 2 * (query_len > 1) + (num_keys > LONG_KEYS)]


def mask_dtype(kernel: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The additive mask's dtype for `kernel`; None: it takes positions, no mask (`cpp`)."""
    return None if kernel == "cpp" else torch.float32 if kernel == "bmm" else model_dtype


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                     kernel: str = "sdpa", positions: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hkv, G * Q, D] over cache views keys/values [B, Hkv, L, D] -> [B, Hkv, G * Q, D] in q's dtype. The
    library kernels take an additive mask `bias` [B, Hkv, G * Q, L] (0 = attend, -inf = not; in
    `mask_dtype(kernel, ...)`); `cpp` takes each query position's place in the cache, `positions` [B, Q] int64
    (causal by position: it sees keys 0..that place), and no mask."""
    if kernel == "cpp":
        if positions is None:
            raise ValueError("the cpp attention kernel takes positions, not a mask")
        return attention_cpp.op(q, keys, values, positions)
    if bias is None:
        raise ValueError(f"the {kernel} attention kernel takes an additive mask")
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
    B, Hkv, GQ, D = q.shape
    L = keys.shape[2]
    # is_compiling() first: a size test in traced code is a guard, and a guard on B * L recompiles when it flips.
    if not torch.compiler.is_compiling() and B * L <= TINY_ROWS_X_KEYS:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias.to(q.dtype))
    # Cache views fold (B, Hkv) into one batch axis without a copy: the slot stride is a multiple of the head's.
    qf = q.reshape(B * Hkv, GQ, D).float()
    kf = keys.reshape(B * Hkv, L, D).float()
    probs = torch.baddbmm(bias.view(B * Hkv, GQ, L), qf, kf.transpose(1, 2), alpha=D**-0.5).softmax(-1)
    return torch.bmm(probs.to(values.dtype), values.reshape(B * Hkv, L, D)).view(B, Hkv, GQ, D)


def usable(kernel: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `kernel` runs this layout here (`cpp`: built, and the dtype and head size it takes)."""
    return kernel != "cpp" or attention_cpp.supports(dtype, head_dim)


def choose(num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, device: torch.device,
           timer: Timer | None = None) -> Kernels:
    """The kernels for this head layout on this device (see `Kernels`): `sdpa` on CUDA; on CPU, each the fastest
    usable one at its shape in `TIMED_SHAPES` (timed once), sdpa unless another takes under WIN_MARGIN of its time;
    for one-row steps the fastest of `ONE_ROW_KERNELS` there."""
    if device.type != "cpu":
        return ("sdpa",) * 8
    key = (device.type, dtype, num_kv_heads, group, head_dim)
    if key in _chosen:
        return _chosen[key]
    if timer is not None:  # a given timer times now (tests); the engine's choice is timed once per machine
        _chosen[key] = _timed(key, timer)
    else:
        usable_here = tuple(kernel for kernel in KERNELS if usable(kernel, dtype, head_dim))
        cpp_source = attention_cpp.source_id() if "cpp" in usable_here else ""  # a changed kernel is timed again
        kernels, again = remembered("attention", (*key, usable_here, cpp_source), lambda: _timed(key, None))
        if again:
            logger.info("attention over the cache (%s, %d KV heads x %d, head_dim %d): decode %s / %s, verify %s / "
                        "%s (short / long cache; one row: %s), as timed at an earlier start on this machine",
                        dtype, num_kv_heads, group, head_dim, *kernels[4:], " / ".join(kernels[:4]))
        _chosen[key] = kernels
    return _chosen[key]


def _timed(key: tuple, timer: Timer | None) -> Kernels:
    """`choose`'s timing: each kernel at each of `TIMED_SHAPES`."""
    _, dtype, num_kv_heads, group, head_dim = key
    timer = timer or (lambda fn: median_seconds(fn, reps=5))
    kernels = [kernel for kernel in KERNELS if usable(kernel, dtype, head_dim)]
    gen = torch.Generator().manual_seed(0)
    chosen, one_row, report = [], [], []
    with torch.inference_mode():
        for B, Q, L in TIMED_SHAPES:
            q = torch.randn(B, num_kv_heads, group * Q, head_dim, generator=gen).to(dtype)
            cache = torch.randn(2, B, num_kv_heads, 2 * L, head_dim, generator=gen).to(dtype)
            keys, values = cache[0, :, :, :L], cache[1, :, :, :L]  # views into a longer cache, as served
            positions = torch.full((B, Q), L - 1)  # every query sees every key, as the zero masks below
            took = {}
            for kernel in kernels:
                mask = mask_dtype(kernel, dtype)
                bias = None if mask is None else torch.zeros(B, num_kv_heads, group * Q, L, dtype=mask)
                took[kernel] = timer(lambda a=(q, keys, values, bias, kernel, positions): cached_attention(*a))
            score = {k: took[k] * (WIN_MARGIN if k == "sdpa" else 1.0) for k in kernels}
            chosen.append(min(kernels, key=score.get))
            one_row.append(min(ONE_ROW_KERNELS, key=score.get))
            times = ", ".join(f"{k} {took[k] * 1e3:.2f} ms" for k in kernels)
            report.append(f"{Q} per row over {L} keys: {times}")
    logger.info("attention over the cache (%s, %d KV heads x %d, head_dim %d): decode %s / %s, verify %s / %s "
                "(short / long cache; one row: %s; %s)", dtype, num_kv_heads, group, head_dim, *chosen,
                " / ".join(one_row), "; ".join(report))
    return (*one_row, *chosen)
