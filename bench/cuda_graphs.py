"""CUDA graphs against eager steps in the native engine, on one GPU, in one run.

For each batch size, the same engine configuration runs twice, once with `enforce_eager` (every forward
launched kernel by kernel) and once replaying CUDA graphs (service/engine/cached_model.py): plain decoding, the
draft model at a fixed k, and the adaptive strategy over the suffix drafter and the draft model. Each run
generates `--new-tokens` sampled tokens (temperature 1, fixed seeds, end-of-sequence ignored) per prompt;
tokens/s = generated tokens / wall seconds of one `generate` call (prefill included), best of `--repeats`
after a warm-up that also captures the graphs. Needs CUDA.

    python -m bench.cuda_graphs [--model DIR] [--batches 1,16,64] [--out FILE] > docs/cuda_graphs.json

stdout: one JSON line with tokens/s per (mode, batch) and the graphs/eager ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from service.config import EngineConfig
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams

logger = logging.getLogger("bench.cuda_graphs")

MODES = {  # name -> engine settings beside the model
    "plain": dict(spec="off"),
    "draft_k4": dict(drafter="auto", spec="fixed", spec_k=4),
    "adaptive": dict(drafter="auto", spec="adaptive"),
}


def tokens_per_s(model: str, dtype: str, batch: int, new_tokens: int, repeats: int, eager: bool,
                 **kw) -> tuple[float, float]:
    """(tokens/s, seconds to start the engine: with graphs, their capture)."""
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device="cuda", max_model_len=64 + new_tokens,
                                    max_num_seqs=batch, enforce_eager=eager, **kw))
    start_seconds = time.perf_counter() - t0
    prompts = [[16 + (7 * i + j) % 200 for j in range(16)] for i in range(batch)]
    params = [SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=100 + i, ignore_eos=True)
              for i in range(batch)]
    engine.generate(prompts, params)  # warm-up: captures graphs, primes the strategy
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return tokens / best, start_seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded demo model, with its drafter)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the JSON here, rewritten after every (mode, batch) with `complete` false until "
                         "the end, so a run stopped at a time limit keeps what it measured")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if not torch.cuda.is_available():
        raise SystemExit("bench.cuda_graphs needs a CUDA device")
    model = args.model
    if model is None:
        from service.demo.default_model import ensure_default_model

        model = str(ensure_default_model())
    batches = [int(b) for b in args.batches.split(",")]
    out: dict = {"bench": "cuda_graphs", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "dtype": args.dtype, "new_tokens": args.new_tokens, "loadavg_start": os.getloadavg()[0],
                 "tokens_per_s": {}, "graphs_over_eager": {}}
    for mode in tqdm(args.modes.split(","), desc="modes", file=sys.stderr):
        for batch in batches:
            row = {}
            for name, eager in (("eager", True), ("graphs", False)):
                tok_s, start_s = tokens_per_s(model, args.dtype, batch, args.new_tokens, args.repeats, eager,
                                              **MODES[mode])
                row[name], row[f"{name}_start_s"] = round(tok_s, 1), round(start_s, 2)
            out["tokens_per_s"][f"{mode}_b{batch}"] = row
            out["graphs_over_eager"][f"{mode}_b{batch}"] = round(row["graphs"] / row["eager"], 2)
            logger.warning("%s batch %d: %s", mode, batch, row)
            if args.out:
                args.out.write_text(json.dumps(out | {"complete": False}) + "\n")
    out["loadavg_end"] = os.getloadavg()[0]
    out["complete"] = True
    if args.out:
        args.out.write_text(json.dumps(out) + "\n")
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
