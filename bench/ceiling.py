"""What speculative decoding could buy at most on this machine, for bench/e2e.py's GRPO workload.

The perfect drafter is the target drafting for itself at fixed k: it accepts nearly every draft, and its drafting
seconds are left out of each step. Both engines serve the same rollouts in one process, alternating, so a drift in
the machine's speed hits both alike. Per batch bucket it reports SD off's tokens a second, the perfect drafter's,
and their ratio; over the rollout, the rollout ceiling; given a bench.e2e JSON, the GRPO step ceiling. No real
drafter reaches these figures: an aim above them is out of reach here.

    python -m bench.ceiling [--k 8] [--rollouts 6] [--e2e docs/e2e.json]

Prints one JSON line. docs/design-notes.md has the details.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from examples.grpo.grpo import GRPOConfig, PromptStream, _seed
from service.config import EngineConfig
from service.engine.llm_engine import LLMEngine
from service.engine.strategy import bucket_of
from service.params import SamplingParams


def engine_for(model: Path, drafter: str, k: int, threads: int, max_model_len: int, eager: bool) -> LLMEngine:
    spec = "off" if drafter == "none" else "fixed"
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", drafter=drafter, spec=spec, spec_k=k,
                                  max_model_len=max_model_len, max_num_seqs=64, num_threads=threads,
                                  enforce_eager=eager))


def rollout(engine: LLMEngine, cfg: GRPOConfig, step: int, buckets: dict[int, list[float]]) -> None:
    """GRPO step `step`'s rollout; adds per decode step (seconds less drafting, tokens, rows, drafted, accepted)."""
    tok = engine.tokenizer
    for i, problem in enumerate(PromptStream(cfg).at(step)):
        engine.add_request(tok.encode(problem.prompt), SamplingParams(
            n=cfg.group_size, temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=_seed(cfg.seed, step, i)))
    while engine.has_unfinished():
        before = engine.stats.num_steps
        engine.step()
        if engine.stats.num_steps == before or (rec := engine.stats.recent[-1]).kind == "prefill":
            continue
        row = buckets[bucket_of(rec.batch_size)]
        seconds = rec.verify_seconds if rec.k else rec.seconds
        for j, v in enumerate((seconds, rec.emitted_tokens, rec.batch_size, rec.drafted_tokens, rec.accepted_tokens)):
            row[j] += v


def summarize(off: dict[int, list[float]], perfect: dict[int, list[float]], k: int) -> dict[str, Any]:
    """Per bucket and over the rollout: SD off's figures against the perfect drafter's (rows of `rollout`)."""
    off_s = sum(o[0] for o in off.values())
    per_bucket: dict[str, dict[str, Any]] = {}
    perfect_s = 0.0  # SD off's tokens in each bucket at the perfect drafter's rate there
    for b in sorted(off):
        o, p = off[b], perfect.get(b)
        rate_off = o[1] / o[0]
        rate = p[1] / p[0] if p and p[0] else None
        perfect_s += o[1] / rate if rate else o[0]  # a bucket the perfect drafter never reached: as SD off
        per_bucket[str(b)] = {
            "off_tokens_per_s": round(rate_off), "off_share": round(o[0] / off_s, 3),
            "perfect_tokens_per_s": round(rate) if rate else None,
            "perfect_tokens_per_row_step": round(p[1] / p[2], 2) if rate else None,
            "ratio": round(rate / rate_off, 3) if rate else None}
    drafted = sum(p[3] for p in perfect.values())
    return {"k": k, "buckets": per_bucket, "off_decode_s": round(off_s, 4), "perfect_decode_s": round(perfect_s, 4),
            "rollout_ceiling": round(off_s / perfect_s, 3),
            "perfect_acceptance": round(sum(p[4] for p in perfect.values()) / drafted, 4) if drafted else None}


def step_ceiling(e2e_json: Path, rollout_ceiling: float) -> dict[str, float]:
    """SD off's GRPO step from a bench.e2e JSON with its rollout `rollout_ceiling` times shorter."""
    off = json.loads(e2e_json.read_text())["summary"]["runs"]["off"]
    best = off["rollout_s"] / rollout_ceiling + off["update_s"] + off["push_s"]
    return {"off_step_s": off["step_s"], "off_rollout_s": off["rollout_s"], "off_update_s": off["update_s"],
            "step_ceiling": round(off["step_s"] / best, 3),
            "step_ceiling_no_rollout": round(off["step_s"] / (off["update_s"] + off["push_s"]), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="the policy folder (default: the demo model)")
    ap.add_argument("--k", type=int, default=8, help="the perfect drafter's depth")
    ap.add_argument("--rollouts", type=int, default=6, help="timed rollouts per engine (after one untimed)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (bench.e2e's server runs one)")
    ap.add_argument("--e2e", type=Path, default=None, help="a bench.e2e JSON: also the GRPO step's ceiling")
    ap.add_argument("--enforce-eager", action="store_true", help="no compiled forwards (not what a server runs)")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.k < 1 or args.rollouts < 1:
        raise SystemExit("--k and --rollouts must be at least 1")
    torch.set_num_threads(args.threads)
    cfg = GRPOConfig()
    if args.quick:
        cfg.prompts_per_step, cfg.group_size, cfg.max_tokens, cfg.max_terms, args.rollouts = 2, 4, 96, 5, 1
    if args.model is None:
        from service.demo.default_model import ensure_default_model

        args.model = ensure_default_model()
    max_len = cfg.max_tokens + 256  # what bench.e2e serves
    engines = {name: engine_for(args.model, drafter, args.k, args.threads, max_len, args.enforce_eager)
               for name, drafter in (("off", "none"), ("perfect", str(args.model)))}
    load_start = os.getloadavg()
    buckets: dict[str, dict[int, list[float]]] = {name: defaultdict(lambda: [0.0] * 5) for name in engines}
    for step in tqdm(range(args.rollouts + 1), desc="rollouts", file=sys.stderr):
        for name, engine in engines.items():  # alternating: the machine's drift hits both alike
            rollout(engine, cfg, step, buckets[name] if step else defaultdict(lambda: [0.0] * 5))
    out = {"bench": "ceiling", "model": str(args.model), "threads": args.threads, "rollouts": args.rollouts,
           "compiled": not args.enforce_eager,
           **summarize(buckets["off"], buckets["perfect"], args.k)}
    if args.e2e is not None:
        out |= step_ceiling(args.e2e, out["rollout_ceiling"])
    out["loadavg"] = [round(x, 2) for x in (*load_start, os.getloadavg()[0])]
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
