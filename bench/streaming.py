"""What streaming costs a served rollout: bench/e2e.py's GRPO rollouts with every sample's tokens streamed in chunks
against the same rollouts with each sample sent whole when it ends (gRPC `final_only`, what the client's
`generate` and the GRPO example ask for).

Streamed, the engine thread builds an event for every running sample every step and the server's event loop wakes
to merge and send them; on a CPU server both share the cores the forwards run on. Whole, neither happens until a
sample ends. One server (SD off unless `--spec`/`--drafter` say otherwise; compiled before serving; pinned to half
the cores and the client to the other half, as bench/e2e.py pins them) serves rounds of bench.e2e's rollouts (its
prompt pool, sampling seeds and token budget; the policy frozen), both modes in each round on the same step's
prompts and seeds, which mode goes first alternating. Per round, streamed seconds over whole seconds.

    python -m bench.streaming [--rounds 16] [--spec adaptive --drafter suffix] [--quick]

Prints one JSON line: each mode's rollout seconds per round, the paired ratio (median and each round's), whether
the two modes decoded the same number of tokens in every round, and loadavg.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

from tqdm import tqdm

from bench.e2e import split_cores
from client import AsyncSpecrollClient
from examples.grpo.grpo import GRPOConfig, PromptStream, rollout
from examples.grpo.server import ServerProcess

MODES = ("streamed", "final_only")


async def serve_rounds(target: str, token: str, tokenizer: Any, cfg: GRPOConfig, rounds: int) -> dict[str, list]:
    """Per mode, (rollout seconds, output tokens) of each round."""
    stream = PromptStream(cfg)
    out: dict[str, list[tuple[float, int]]] = {m: [] for m in MODES}
    async with AsyncSpecrollClient(target, admin_token=token, max_message_bytes=64 * 2**20) as client:
        await client.wait_until_ready()
        prompts = [tokenizer.encode(p.prompt) for p in stream.at(rounds)]
        await rollout(client, prompts, cfg, rounds)  # untimed: the server's first rollout
        for r in tqdm(range(rounds), desc="rounds", file=sys.stderr):
            prompts = [tokenizer.encode(p.prompt) for p in stream.at(r)]
            for mode in MODES if r % 2 == 0 else MODES[::-1]:  # which goes first alternates
                start = time.perf_counter()
                groups, _ = await rollout(client, prompts, cfg, r, final_only=mode == "final_only")
                out[mode].append((time.perf_counter() - start, sum(s.num_output_tokens for g in groups for s in g)))
    return out


def summarize(runs: dict[str, list[tuple[float, int]]]) -> dict[str, Any]:
    streamed, whole = runs["streamed"], runs["final_only"]
    ratios = [s / w for (s, _), (w, _) in zip(streamed, whole, strict=True)]
    return {"streamed_s": [round(s, 4) for s, _ in streamed], "final_only_s": [round(s, 4) for s, _ in whole],
            "same_tokens": all(a == b for (_, a), (_, b) in zip(streamed, whole, strict=True)),
            "mean_streamed_s": round(statistics.fmean(s for s, _ in streamed), 4),
            "mean_final_only_s": round(statistics.fmean(s for s, _ in whole), 4),
            "ratio_streamed_vs_final_only": {"median": round(statistics.median(ratios), 3),
                                             "runs": [round(x, 3) for x in ratios]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--spec", default="off", help="the server's --spec (off | fixed | adaptive)")
    ap.add_argument("--drafter", default="none", help="the server's --drafter")
    ap.add_argument("--enforce-eager", action="store_true", help="no compiled forwards (not what a server runs)")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    from service.demo.default_model import ensure_default_model
    from service.tokenizer import Tokenizer

    cfg = GRPOConfig()
    if args.quick:
        cfg.prompts_per_step, cfg.group_size, cfg.max_tokens, cfg.max_terms = 2, 4, 64, 5
    model = ensure_default_model()
    cores = os.sched_getaffinity(0)
    halves = split_cores()  # as bench.e2e pins them
    server_cpus = halves[0] if halves else None
    load_start = os.getloadavg()
    try:
        if halves:
            os.sched_setaffinity(0, halves[1])
        with ServerProcess(str(model), drafter=args.drafter, spec=args.spec, threads=len(server_cpus or cores),
                           cpus=server_cpus, max_model_len=cfg.max_tokens + 256,
                           max_num_seqs=max(64, cfg.prompts_per_step * cfg.group_size),
                           extra_args=["--enforce-eager"] if args.enforce_eager else [],
                           compile_before_serving=not args.enforce_eager) as server:
            runs = asyncio.run(serve_rounds(server.grpc_target, server.admin_token, Tokenizer.from_dir(model), cfg,
                                            args.rounds))
    finally:
        os.sched_setaffinity(0, cores)
    out = {"bench": "streaming", "spec": args.spec, "drafter": args.drafter, "rounds": args.rounds,
           "samples_per_rollout": cfg.prompts_per_step * cfg.group_size, **summarize(runs),
           "loadavg": [round(x, 2) for x in (*load_start, os.getloadavg()[0])]}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
