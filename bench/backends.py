"""Backends benchmark: the long-tail rollout of bench/spec_decode.py on the native backend, on the vLLM backend
(SD off, fixed k, adaptive per-batch-size table) and on vLLM's own AsyncLLM without specroll's layer.

Every run serves the same 64 requests (8 prompts x 8 samples, log-normal lengths; greedy, or sampled at
`--temperature`: the vLLM backend serves sampled requests under speculation where its start-up self-check
passed, see docs/vllm.md) submitted at once, and is timed from submission to the last token; each engine
serves the rollout `--repeats` times and the median counts.
The specroll runs go through real servers and the gRPC client; the raw run drives AsyncLLM directly, so
`overhead_vs_raw_vllm` is what our layer (admission, events, records, gRPC) costs. `--paired` measures it again
in alternating rounds beside a bare AsyncLLM, which cancels the machine's drift. Needs vllm (run it with
.venv-vllm/bin/python). Prints one JSON line.

    .venv-vllm/bin/python -m bench.backends [--quick] [--temperature 1] [--configs native-adaptive,vllm-off,raw-off]
        [--paired off,fixed]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.spec_decode import workload, write_models
from client import AsyncSpecrollClient
from service.app import BackgroundServer, ServerConfig
from service.config import EngineConfig
from service.netutil import free_port
from service.vllm.config import VllmConfig

logger = logging.getLogger("bench.backends")
CONFIGS = ("native-off", "native-adaptive", "vllm-off", "vllm-fixed", "vllm-adaptive", "raw-off", "raw-fixed")


async def _through_client(target: str, prompts: list[list[int]], lengths: list[int], per_prompt: int,
                          temperature: float = 0.0) -> int:
    async with AsyncSpecrollClient(target) as c:
        async def one(i: int, n: int) -> int:
            done = await c.generate_one(prompts[i // per_prompt], max_tokens=n, temperature=temperature,
                                        ignore_eos=True)
            return len(done.samples[0].token_ids)

        return sum(await asyncio.gather(*[one(i, n) for i, n in enumerate(lengths)]))


def _median_run(times: list[float], tokens: int) -> dict:
    seconds = sorted(times)[len(times) // 2]
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "all_seconds": [round(x, 3) for x in times]}


def run_server(backend: str, spec: str, target: Path, draft: Path, k: int, prompts, lengths, per_prompt: int,
               max_len: int, repeats: int, temperature: float = 0.0) -> dict:
    drafter = "none" if spec == "off" else (f"{draft},suffix" if backend == "native" else str(draft))
    engine = EngineConfig(model=str(target), drafter=drafter, spec=spec, spec_k=k, max_model_len=max_len,
                          max_num_seqs=len(lengths), kv_cache_memory_gb=0.5)
    cfg = ServerConfig(http_port=free_port(), grpc_port=free_port(), backend=backend,
                       vllm=VllmConfig(num_speculative_tokens=k, gpu_memory_utilization=0.3))
    t_start = time.perf_counter()
    with BackgroundServer(engine, cfg) as srv:
        ready_s = time.perf_counter() - t_start  # on vLLM adaptive: includes the start-up profile
        asyncio.run(_through_client(srv.grpc_target, prompts[:1], [8] * 4, 4))  # warm-up
        times, tokens = [], 0
        for _ in range(repeats):
            start = time.perf_counter()
            tokens = asyncio.run(_through_client(srv.grpc_target, prompts, lengths, per_prompt, temperature))
            times.append(time.perf_counter() - start)
        table = getattr(srv.server.backend, "table", None)
    out = _median_run(times, tokens) | {"ready_seconds": round(ready_s, 1)}
    return out | ({"k_table": [list(row) for row in table]} if backend == "vllm" and table else {})


def _raw_engine(spec: str, target: Path, draft: Path, k: int, n_requests: int, max_len: int) -> Any:
    """vLLM's AsyncLLM with the same engine arguments the backend uses, no specroll in between."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from service.drafter_spec import NO_DRAFTER, DrafterItem
    from service.vllm.engine import engine_args

    cfg = EngineConfig(model=str(target), max_model_len=max_len, max_num_seqs=n_requests, kv_cache_memory_gb=0.5)
    drafter = NO_DRAFTER if spec == "off" else DrafterItem("draft_model", str(draft))
    table = [] if spec == "off" else [(1, n_requests, k)]
    args = engine_args(cfg, VllmConfig(num_speculative_tokens=k, gpu_memory_utilization=0.3), drafter, table)
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))


async def _through_raw(eng: Any, tag: str, prompts: list[list[int]], lengths: list[int], per_prompt: int,
                       temperature: float) -> int:
    from vllm import SamplingParams

    async def one(rid: str, prompt: list[int], n: int) -> int:
        sp = SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True, logprobs=0, detokenize=False)
        outs = [o async for o in eng.generate({"prompt_token_ids": prompt}, sp, request_id=rid)]
        return len(outs[-1].outputs[0].token_ids)

    return sum(await asyncio.gather(*[one(f"{tag}-{i}", prompts[i // per_prompt], n) for i, n in enumerate(lengths)]))


def run_paired(spec: str, target: Path, draft: Path, k: int, prompts, lengths, per_prompt: int, max_len: int,
               repeats: int, temperature: float = 0.0) -> dict:
    """Our vLLM backend and a bare AsyncLLM both started, serving the rollout in alternating rounds (ABBA):
    each pair of rounds sees the same machine, so their ratio is our layer's overhead net of the drift."""
    engine = EngineConfig(model=str(target), drafter="none" if spec == "off" else str(draft), spec=spec, spec_k=k,
                          max_model_len=max_len, max_num_seqs=len(lengths), kv_cache_memory_gb=0.5)
    cfg = ServerConfig(http_port=free_port(), grpc_port=free_port(), backend="vllm",
                       vllm=VllmConfig(num_speculative_tokens=k, gpu_memory_utilization=0.3))

    async def rounds(target_addr: str) -> tuple[list[float], list[float], int]:
        eng = _raw_engine(spec, target, draft, k, len(lengths), max_len)
        ours, raw, tokens = [], [], 0
        try:
            await _through_raw(eng, "warm", prompts[:1], [8] * 4, 4, 0.0)
            await _through_client(target_addr, prompts[:1], [8] * 4, 4)
            for r in range(repeats):
                for side in (("raw", "ours") if r % 2 == 0 else ("ours", "raw")):
                    start = time.perf_counter()
                    if side == "raw":
                        tokens = await _through_raw(eng, f"r{r}", prompts, lengths, per_prompt, temperature)
                        raw.append(time.perf_counter() - start)
                    else:
                        tokens = await _through_client(target_addr, prompts, lengths, per_prompt, temperature)
                        ours.append(time.perf_counter() - start)
        finally:
            eng.shutdown()
        return ours, raw, tokens

    with BackgroundServer(engine, cfg) as srv:
        ours, raw, tokens = asyncio.run(rounds(srv.grpc_target))
    overheads = [1 - r / o for o, r in zip(ours, raw, strict=True)]
    return {"ours": _median_run(ours, tokens), "raw": _median_run(raw, tokens),
            "overhead_per_pair": [round(x, 3) for x in overheads],
            "overhead_median": round(statistics.median(overheads), 3)}


def run_raw(spec: str, target: Path, draft: Path, k: int, prompts, lengths, per_prompt: int, max_len: int,
            repeats: int, temperature: float = 0.0) -> dict:
    """vLLM's AsyncLLM alone, `repeats` rounds."""

    async def main() -> tuple[list[float], int]:
        eng = _raw_engine(spec, target, draft, k, len(lengths), max_len)
        try:
            await _through_raw(eng, "warm", prompts[:1], [8] * 4, 4, 0.0)
            times, tokens = [], 0
            for r in range(repeats):
                start = time.perf_counter()
                tokens = await _through_raw(eng, f"r{r}", prompts, lengths, per_prompt, temperature)
                times.append(time.perf_counter() - start)
        finally:
            eng.shutdown()
        return times, tokens

    times, tokens = asyncio.run(main())
    return _median_run(times, tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3, help="rollouts per engine; the median is reported")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy rollouts; RL rollouts sample (1)")
    ap.add_argument("--paired", default="", help="off,fixed: also measure our layer's overhead in alternating "
                    "rounds against a bare AsyncLLM started beside it (the figure to trust on a drifting machine)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the JSON line
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.quick:
        args.hidden, args.layers = 128, 4
    n_prompts, per_prompt = 8, 8
    prompts, lengths = workload("long_tail", n_prompts, per_prompt, 48 if not args.quick else 16, 0.9, 640,
                                args.vocab, args.seed)
    max_len = 40 + max(lengths)
    load_start = os.getloadavg()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = write_models(Path(tmp), args.hidden, args.layers, 1, args.vocab, 0.1, args.seed)
        for name in [c for c in args.configs.split(",") if c]:
            if name not in CONFIGS:
                raise SystemExit(f"unknown config {name}; choose from {CONFIGS}")
            kind, spec = name.split("-")
            if kind == "raw":
                results[name] = run_raw(spec, target, draft, args.k, prompts, lengths, per_prompt, max_len,
                                        args.repeats, args.temperature)
            else:
                results[name] = run_server(kind, spec, target, draft, args.k, prompts, lengths, per_prompt, max_len,
                                           args.repeats, args.temperature)
            logger.warning("%s: %s", name, results[name])
        paired = {}
        for spec in [c for c in args.paired.split(",") if c]:
            if spec not in ("off", "fixed"):
                raise SystemExit(f"--paired takes off and/or fixed, got {spec}")
            paired[spec] = run_paired(spec, target, draft, args.k, prompts, lengths, per_prompt, max_len,
                                      args.repeats, args.temperature)
            logger.warning("paired %s: %s", spec, paired[spec])
    out: dict = {"bench": "backends", "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
                 "requests": len(lengths), "max_len": max(lengths), "temperature": args.temperature,
                 "results": results}
    if paired:
        out["paired_overhead_vs_raw_vllm"] = paired

    def ratio(a: str, b: str) -> float | None:
        return round(results[b]["seconds"] / results[a]["seconds"], 3) if a in results and b in results else None

    out["ratios"] = {
        "vllm_adaptive_vs_off": ratio("vllm-adaptive", "vllm-off"),
        "vllm_adaptive_vs_fixed": ratio("vllm-adaptive", "vllm-fixed"),
        "native_adaptive_vs_off": ratio("native-adaptive", "native-off"),
        "vllm_off_vs_native_off": ratio("vllm-off", "native-off"),
        "vllm_fixed_vs_off": ratio("vllm-fixed", "vllm-off"),
        "overhead_vs_raw_vllm": (None if "raw-off" not in results or "vllm-off" not in results else
                                 round(1 - results["raw-off"]["seconds"] / results["vllm-off"]["seconds"], 3)),
        "overhead_vs_raw_vllm_fixed": (None if "raw-fixed" not in results or "vllm-fixed" not in results else
                                       round(1 - results["raw-fixed"]["seconds"] / results["vllm-fixed"]["seconds"],
                                             3)),
    }
    out["loadavg"] = {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
