"""Attention of a step's new query rows over the static KV cache: three kernels, chosen per machine by timing.

- `sdpa`: one `F.scaled_dot_product_attention` call with the additive mask in the model dtype. On CPU its flash
  kernel reads the bf16 cache in place and accumulates in float32.
- `bmm`: scores in float32 (one baddbmm with the scale and a float32 mask, a float32 softmax, one bmm with V);
  bf16 caches are converted per layer. At tiny sizes (batch x keys <= `TINY_ROWS_X_KEYS`) it hands over to
  SDPA, whose single call costs less than its dispatches (not in compiled code: no dispatches to save there).
- `cpp`: our own CPU kernel (service/models/attention_cpp.py), float32 or bf16, head sizes a multiple of 16; it
  takes each query's position instead of a mask, so no mask is built for a step that runs it, and each row stops
  at its own keys; where it cannot be built here (no C++ compiler) it is left out.

Of the two library kernels neither wins everywhere, by a lot, and the winner depends on the number of query
positions per row and on how many keys they attend to. Demo model, bf16, at batch 64 (bench/step_profile.py): decode
took 3.5 ms with sdpa and 5.7 ms with bmm on an Intel Xeon with AMX (2 threads); on an AMD EPYC (AVX512-BF16, no
AMX; 1 thread, 400 cached tokens) decode took 19.3 ms with sdpa and 11.1 ms with bmm, while a verify step of 5
positions took 16.9 and 19.2 ms. The same EPYC, 2 threads, the attention of a verify step at batch 64 alone (both
kernels interleaved, medians): over 128 keys bmm 0.37-0.43 ms against sdpa's 0.53-0.66 ms, over 512 keys bmm
2.75-3.07 ms against 2.29-2.39 ms (compiled code ranks them alike). On that EPYC (1 thread, demo layout) the `cpp`
kernel won all four timed shapes in bf16 (decode over 512 keys: sdpa 3.49 ms, bmm 1.22, cpp 0.47) and three in
float32 (a verify over 128 keys: sdpa 0.78, cpp 0.71, under the margin). So `choose` times each on the model's own
head layout, for each kind of step (decode, verify) over a short and a long cache (`TIMED_SHAPES`; `LONG_KEYS` parts
them), the first time a layout is installed in a process, and from then on every cache-attached forward of that
layout runs the faster kernel for its rows (one or more), kind of step and keys (`pick`; `CachedModel` records it in
`AttnMeta.kernel`). CUDA always runs `sdpa`. The kernels compute the same attention, rounded differently: every
exactness test runs on whichever this machine chose.
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
