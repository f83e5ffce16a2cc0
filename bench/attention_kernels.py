"""Attention over the cache, kernel by kernel: our `cpp` kernel against SDPA and float32 bmm on the same inputs, for
rows of one length and rows of different lengths (as a batch holds them: prompts and accepted drafts differ).

Each shape is a step's attention in one layer of the demo model's layout (4 KV heads x 32, 64 rows): a decode (1
position per row) or a verify (k + 1 positions) over the batch's longest row's keys. With `spread` s, row lengths are
drawn uniformly from [(1 - 2s) L, L]: the library kernels run to L for every row under a mask (built once per step in
the engine, so not timed here), the `cpp` kernel stops at each row's own keys. Calls alternate between the kernels,
medians over `--reps`.

    python3 -m bench.attention_kernels [--threads 1] [--dtype float32] [--reps 200]

Prints one JSON line: per shape the milliseconds of each kernel, `cpp_over_sdpa`, and each kernel's largest
difference from SDPA's output (`max_abs_diff`: they compute the same attention, rounded differently).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from service.models import attention

# (positions per row, keys of the longest row, spread): rows hold 1 - spread of the longest's keys on average (in
# GRPO rollouts of the demo task, 0.72-0.76 at 64 rows, 0.87-0.95 at 32: attention_cpp.py)
SHAPES = tuple((q, keys, spread) for spread in (0.0, 0.125, 0.25) for keys in (200, 512) for q in (1, 5))


def inputs(dtype: torch.dtype, rows: int, q_len: int, keys: int, spread: float, seed: int = 0) -> dict:
    """One layer's attention inputs: cache views, the rows' positions, and the mask they make."""
    gen = torch.Generator().manual_seed(seed)
    heads, head_dim = 4, 32
    q = torch.randn(rows, heads, q_len, head_dim, generator=gen).to(dtype)
    cache = torch.randn(2, rows, heads, keys + 8, head_dim, generator=gen).to(dtype)  # views of a longer cache
    lengths = (keys - torch.rand(rows, generator=gen) * 2 * spread * keys).long().clamp(q_len, keys)
    lengths[0] = keys  # the longest row sets the keys every library kernel runs to
    positions = lengths[:, None] - q_len + torch.arange(q_len)  # [B, Q]
    hidden = torch.arange(keys) > positions[:, None, :, None]  # [B, 1, Q, L]
    return {"q": q, "keys": cache[0, :, :, :keys], "values": cache[1, :, :, :keys], "positions": positions,
            "hidden": hidden, "mean_keys": float(lengths.float().mean()) / keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernels = [k for k in attention.KERNELS if attention.usable(k, dtype, 32)]
    result = {}
    with torch.inference_mode():
        for q_len, keys, spread in SHAPES:
            x = inputs(dtype, args.rows, q_len, keys, spread)
            calls = {}
            for kernel in kernels:
                mask = attention.mask_dtype(kernel, dtype)
                bias = None if mask is None else torch.zeros(x["hidden"].shape, dtype=mask).masked_fill_(
                    x["hidden"], -torch.inf).expand(-1, x["q"].shape[1], -1, -1).contiguous()
                calls[kernel] = (x["q"], x["keys"], x["values"], bias, kernel, x["positions"])
            outputs = {kernel: attention.cached_attention(*call).float() for kernel, call in calls.items()}
            took: dict[str, list[float]] = {k: [] for k in kernels}
            for _ in range(args.reps):
                for kernel, call in calls.items():
                    start = time.perf_counter()
                    attention.cached_attention(*call)
                    took[kernel].append(time.perf_counter() - start)
            ms = {k: round(statistics.median(t[3:]) * 1e3, 3) for k, t in took.items()}
            diff = {k: float((out - outputs["sdpa"]).abs().max()) for k, out in outputs.items() if k != "sdpa"}
            row = {"ms": ms, "mean_keys_of_longest": round(x["mean_keys"], 3), "max_abs_diff": diff}
            if "cpp" in ms:
                row["cpp_over_sdpa"] = round(ms["cpp"] / ms["sdpa"], 3)
            result[f"q{q_len}_keys{keys}_spread{spread}"] = row
    print(json.dumps({"bench": "attention_kernels", "dtype": args.dtype, "threads": args.threads, "rows": args.rows,
                      "shapes": result, "loadavg": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
