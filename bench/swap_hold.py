"""The swap hold of a weight push: how long the engine thread stops generating to serve pushed weights.

Builds a Qwen2-architecture checkpoint of the requested size (bench/weight_push.py's builder), starts the native
backend on it in this process with eager forwards (nothing to compile), stages perturbed copies off the engine
thread and commits each in mode keep. Prints one JSON line: per push, the seconds staging took and the hold the
engine measured (`SwapResult.swap_seconds`, what the push reply and `specroll:weight_swap_seconds` report).
No transport runs: bench/weight_push.py measures the whole push over gRPC.

    python bench/swap_hold.py --size-mb 1024 --dtype float32 [--pushes 3] [--weight-spare start]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from bench.weight_push import build_checkpoint
from service.config import EngineConfig
from service.engine.native import NativeBackend

logger = logging.getLogger("bench.swap_hold")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--weight-spare", default="start", help="start | on-demand | free (where the build has it)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="specroll-swap-") as tmp:
        weights = build_checkpoint(Path(tmp) / "model", args.size_mb, dtype)
        kw = {"weight_spare": args.weight_spare} if "weight_spare" in {
            f.name for f in dataclasses.fields(EngineConfig)} else {}
        config = EngineConfig(model=str(Path(tmp) / "model"), dtype=args.dtype, max_model_len=256, max_num_seqs=4,
                              kv_cache_memory_gb=0.25, enforce_eager=True, drafter="none", **kw)
        backend = NativeBackend(config)
        t0 = time.perf_counter()
        backend.start()
        backend.wait_loaded(3600)
        start_s = time.perf_counter() - t0
        pushes = []
        for r in range(args.pushes):
            gen = torch.Generator().manual_seed(r)
            new = {k: v + (1e-3 * torch.randn(v.shape, generator=gen)).to(dtype) for k, v in weights.items()}
            t0 = time.perf_counter()
            staged = backend.stage_weights("target", new.items())
            stage_s = time.perf_counter() - t0
            swap = backend.commit_weights(staged, f"bench-{r}", "keep").result(3600)
            pushes.append({"stage_s": round(stage_s, 3), "hold_ms": round(swap.swap_seconds * 1e3, 2)})
            del new
        backend.stop()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(json.dumps({"bytes": nbytes, "dtype": args.dtype, "weight_spare": kw.get("weight_spare", "n/a"),
                      "start_s": round(start_s, 2), "pushes": pushes}))


if __name__ == "__main__":
    main()
