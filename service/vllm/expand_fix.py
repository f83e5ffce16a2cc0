"""vLLM's per-request -> per-token expand (`expand_batch_to_tokens`), probed and, where wrong, replaced.

Before verifying drafts of a batch that is not all greedy, vLLM's rejection sampler expands each request's
temperature, top-k and top-p to its draft tokens. On CPU builds without a Triton backend the platform replaces
that Triton kernel with a C++ one that only writes int64 buffers; the float32 / int32 buffers it is given are
converted to int64 copies, the copies are filled, and the caller's buffer stays uninitialised. Every sampled
verification then runs on garbage settings (and in mixed batches greedy rows are argmaxed after it).

`probe` calls the expand with unusual values in each dtype it is used with, into a buffer prefilled with a
sentinel; `install` rebinds vLLM's kernel name to `expand_tokens` (repeat_interleave over the per-request
counts, the replace rule kept) through vLLM's own kernel-override registry. `SPECROLL_VLLM_EXPAND_FIX=0`
turns the fix off (to learn when upstream fixed it: the start-up self-check then decides on vLLM's own code).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
FIX_ENV = "SPECROLL_VLLM_EXPAND_FIX"
SENTINEL = -7  # written before each probe: a kernel that writes nothing leaves it there

# (dtype, per-request values, the replace rule (from, to)): the dtypes vLLM expands (temperature, top-p; top-k;
# its warm-up also names int64), values an int64 round trip or a missed write cannot reproduce.
PROBES: tuple[tuple[torch.dtype, tuple[float, ...], tuple[int, int]], ...] = (
    (torch.float32, (0.7, 0.0, 1.3, 2.5, 0.03125), (0, 1)),
    (torch.int32, (5, 0, -614, 2**30, 3), (0, 9)),
    (torch.int64, (2**40, 0, 7, -3, 11), (7, 2)),
)
COUNTS = (2, 1, 0, 4, 3)  # draft tokens per request, one request with none


def fix_enabled() -> bool:
    return os.environ.get(FIX_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def expand_tokens(output_ptr: torch.Tensor, input_ptr: torch.Tensor, cu_num_tokens_ptr: torch.Tensor,
                  replace_from: Any, replace_to: Any, MAX_NUM_TOKENS: Any = None) -> None:
    """vLLM's expand_kernel in torch: output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to), in the
    output's own dtype and storage. Named like the kernel's arguments, so vLLM's launcher passes them by name."""
    cu = cu_num_tokens_ptr.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_ptr == replace_from,
                         torch.tensor(replace_to, dtype=input_ptr.dtype, device=input_ptr.device), input_ptr)
    expanded = values.repeat_interleave(counts)
    output_ptr[: expanded.numel()].copy_(expanded)


def _want(dtype: torch.dtype, values: tuple[float, ...], rule: tuple[int, int]) -> torch.Tensor:
    rows = [[rule[1] if v == rule[0] else v] * n for v, n in zip(values, COUNTS, strict=True)]
    return torch.tensor([v for row in rows for v in row], dtype=dtype)


def probe(device: str | torch.device = "cpu") -> str:
    """'' when vLLM's expand is right for every probe, else what it returned instead."""
    from vllm.v1.sample import rejection_sampler as rs

    cu = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    for dtype, values, rule in PROBES:
        want = _want(dtype, values, rule)
        x = torch.tensor(values, dtype=dtype, device=device)
        out = torch.full((want.numel(),), SENTINEL, dtype=dtype, device=device)
        try:
            rs._expand(out, x, cu, rule[0], rule[1])
            via_api = rs.expand_batch_to_tokens(x, cu, want.numel(), replace_from=rule[0], replace_to=rule[1])
        except Exception as exc:  # a kernel that cannot take this dtype is wrong too
            return f"expand ({dtype}) raised {type(exc).__name__}: {exc}"
        for got in (out, via_api):
            if not torch.equal(got.cpu(), want):
                return f"expand ({dtype}) of {list(values)} gave {got.cpu().tolist()}, not {want.tolist()}"
    return ""


def install() -> None:
    """Point vLLM's expand kernel (and every module holding it) at `expand_tokens`."""
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({EXPAND_KERNEL: expand_tokens})


def ensure(device: str | torch.device = "cpu") -> dict[str, str]:
    """Probe, fix where wrong (unless switched off), probe again. What was found, what was done, and what the
    expand does now ('' = right)."""
    before = probe(device)
    if not before:
        return {"before": "", "fix": "not needed", "after": ""}
    if not fix_enabled():
        logger.warning("vLLM's expand is wrong here and %s=0 leaves it: %s", FIX_ENV, before)
        return {"before": before, "fix": f"off ({FIX_ENV}=0)", "after": before}
    install()
    after = probe(device)
    logger.info("vLLM's expand was wrong (%s); replaced: %s", before, after or "right now")
    return {"before": before, "fix": "installed", "after": after}
