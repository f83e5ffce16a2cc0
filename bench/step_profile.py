"""Where the time of one native step goes: a plain decode step (1 query position per row) against a verify
step (k + 1 positions per row), per batch size, with the share of each kind of op and the matmul rate.

Speculative decoding pays when a verify step of k + 1 positions costs little more than a decode step. That
holds where a step is bound by reading the weights (small batches, GPUs); once the linear layers are bound
by arithmetic, a verify step costs what its k + 1 times more multiply-adds cost, whatever the engine does
around them. This bench shows which regime each batch size is in on this machine: per (batch, positions)
the median step time, the time in matmuls, attention, KV-cache writes and the rest (torch.profiler, self
time), and the matmuls' achieved GFLOP/s next to the machine's own peak for one large matmul.

    python3 -m bench.step_profile [--model spec_decode|demo|DIR] [--batches 1,16,64] [--k 4] [--threads 1] [--compiled]

Prints one JSON line: `verify_over_decode` per batch size is the ratio issue 14 asks to bring to <= 1.5 at
batch 64; `verify_matmul_floor` is the ratio the verify step's matmuls alone impose at the measured peak.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from service.engine.cached_model import CachedModel
from service.engine.kv_cache import KVCache
from service.models import attention, packed
from service.models.llama import CausalLM
from service.models.loader import load_model

logger = logging.getLogger("bench.step_profile")

CATEGORIES = {
    "matmul": ("aten::addmm", "aten::mm", "aten::mkldnn_linear", "mkldnn::_linear_pointwise"),
    "attention": ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "specroll::cache_attention"),
    "kv_write": ("aten::index_put_", "aten::_index_put_impl_"),
}


def category(op: str) -> str:
    return next((name for name, ops in CATEGORIES.items() if op in ops), "other")


def linear_flops(model: CausalLM, tokens: int, logit_rows: int) -> float:
    """Multiply-adds x 2 of every linear layer for `tokens` positions, and of the LM head for `logit_rows`."""
    linears = (m for layer in model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
    per_token = sum(m.weight.numel() for m in linears)
    return 2.0 * (per_token * tokens + model.lm_head.weight.numel() * logit_rows)


def matmul_peak(dtype: torch.dtype, n: int = 1024, reps: int = 10) -> float:
    """GFLOP/s of one n x n x n matmul in `dtype` on this process's threads: the best of `reps`, over both CPU
    kernels the engine can run (`torch.mm` and oneDNN on a prepacked weight; which is faster depends on the CPU)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    kernels = [lambda: torch.mm(a, b)]
    if packed.onednn_available():
        w = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), 1)
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""))
    best = float("inf")
    for fn in kernels:
        fn()
        best = min(best, *(_timed(fn) for _ in range(reps)))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Step:
    """One target forward + LM head over rows that each append `q` tokens after `context` cached ones."""

    def __init__(self, cached: CachedModel, batch: int, q: int, context: int) -> None:
        self.cached, self.q = cached, q
        vocab = cached.cfg.vocab_size
        self.ids = torch.randint(1, vocab, (batch, q))
        self.meta, _ = cached.build_meta(0, [context] * batch, [q] * batch)

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        hidden = self.cached.forward_uniform(self.ids, self.meta)  # [B, Q, hidden]: compiled with --compiled
        return self.cached.model.logits(hidden)  # [B, Q, V]: a verify step needs every position's logits


def measure(cached: CachedModel, batch: int, q: int, context: int, reps: int) -> dict:
    step = Step(cached, batch, q, context)
    for _ in range(5):
        step()
    ms = statistics.median(_timed(step) for _ in range(reps)) * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            step()
    share: dict[str, float] = {}
    for ev in prof.key_averages():
        share[category(ev.key)] = share.get(category(ev.key), 0.0) + ev.self_cpu_time_total
    total = sum(share.values())
    matmul_s = share.get("matmul", 0.0) / 1e6 / reps
    flops = linear_flops(cached.model, batch * q, batch * q)
    return {
        "ms": round(ms, 3),
        "share": {k: round(v / total, 3) for k, v in sorted(share.items())},
        "matmul_ms": round(matmul_s * 1e3, 3),
        "matmul_gflops": round(flops / matmul_s / 1e9, 1) if matmul_s else None,
        "linear_gflop": round(flops / 1e9, 3),
    }


def build_model(which: str, dtype: torch.dtype, workdir: Path) -> tuple[CausalLM, str]:
    if which == "spec_decode":  # the target bench/spec_decode.py times
        from bench.spec_decode import write_models

        target, _ = write_models(workdir, 768, 12, 1, 4096, 0.1, 0)
        return load_model(target, dtype, torch.device("cpu")), "spec_decode target (768 hidden, 12 layers)"
    if which == "demo":
        from service.demo.default_model import ensure_default_model

        path = ensure_default_model()
        return load_model(path, dtype, torch.device("cpu")), f"demo model ({path.name})"
    return load_model(which, dtype, torch.device("cpu")), which


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="spec_decode", help="spec_decode (default), demo, or a model folder")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--k", type=int, default=4, help="draft depth: a verify step has k + 1 positions per row")
    ap.add_argument("--context", type=int, default=128, help="cached tokens per row before the step")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compiled", action="store_true",
                    help="compiled forwards (what the engine serves on CPU); default: eager")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model, name = build_model(args.model, dtype, Path(tmp))
    cache = KVCache(model.config, max(batches), args.context + args.k + 2, dtype, torch.device("cpu"))
    cached = CachedModel(model, cache, torch.device("cpu"), compiled=args.compiled)
    if args.compiled and cached.compiled is None:
        raise SystemExit("--compiled: torch.compile cannot build CPU code here (no C++ compiler)")
    peak = matmul_peak(dtype)
    rows, ratio, floor = {}, {}, {}
    for b in batches:
        for q in (1, args.k + 1):
            rows[f"b{b}_q{q}"] = measure(cached, b, q, args.context, args.reps)
            rows[f"b{b}_q{q}"]["kernel"] = attention.pick(cached.attn_kernels, b, q, args.context + q)
            logger.info("batch %d, %d positions: %s", b, q, rows[f"b{b}_q{q}"])
        dec, ver = rows[f"b{b}_q1"], rows[f"b{b}_q{args.k + 1}"]
        ratio[str(b)] = round(ver["ms"] / dec["ms"], 2)
        # The verify step's matmuls at the machine's peak rate, over the whole decode step.
        floor[str(b)] = round(ver["linear_gflop"] / peak * 1e3 / dec["ms"], 2)
    sys.stdout.write(json.dumps({
        "bench": "step_profile", "model": name, "dtype": args.dtype, "threads": args.threads, "k": args.k,
        "compiled": cached.compiled is not None,
        "context": args.context, "matmul_peak_gflops": round(peak, 1), "steps": rows,
        "verify_over_decode": ratio, "verify_matmul_floor": floor, "loadavg": os.getloadavg(),
    }) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
