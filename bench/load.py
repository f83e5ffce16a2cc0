"""Load bench: N concurrent mixed HTTP + gRPC clients against one server; prints one JSON line.

Requests cycle over /v1/completions and SGLang /generate (streaming and not) and gRPC Generate (client
`AsyncSpecrollClient`), all with ``ignore_eos`` so every sample must come back with exactly ``max_tokens``
tokens: a sample with fewer tokens, or fewer samples than ``n``, counts as truncated. A clean refusal (HTTP 503,
gRPC RESOURCE_EXHAUSTED) counts as a refusal, anything else that is not a full answer as an error by kind.

Without ``--http``/``--grpc`` it starts ``python3 -m service.cli serve`` itself (embedded demo model, tiny
size unless SPECROLL_DEMO_SIZE says otherwise) on free ports, with any ``--server-arg`` passed through.

    python3 -m bench.load --concurrency 1000 [--requests 1000] [--max-tokens 32] [--http URL --grpc HOST:PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from client import AsyncSpecrollClient, Sample, SpecrollError

logger = logging.getLogger("bench.load")

KINDS = ("http_completions", "http_completions_stream", "http_generate", "http_generate_stream", "grpc_generate")


@dataclass
class Outcome:
    kind: str
    latency_s: float
    tokens: int = 0
    error: str | None = None  # error kind; None when answered
    refused: bool = False
    truncated: int = 0  # samples short of max_tokens, or missing


@dataclass
class Job:
    kind: str
    prompt: list[int]
    n: int
    max_tokens: int
    seed: int
    tokens_by_sample: dict[int, int] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def local_server(server_args: list[str]) -> Iterator[tuple[str, str]]:
    http_port, grpc_port = _free_port(), _free_port()
    env = {**os.environ, "SPECROLL_DEMO_SIZE": os.environ.get("SPECROLL_DEMO_SIZE", "tiny")}
    cmd = [sys.executable, "-m", "service.cli", "serve", "--http-port", str(http_port), "--grpc-port",
           str(grpc_port), "--compile-before-serving", *server_args]  # measured on compiled forwards
    logger.info("starting %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become ready")
            time.sleep(0.5)
        yield url, f"127.0.0.1:{grpc_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _sse(lines: list[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


async def _http(http: httpx.AsyncClient, job: Job) -> str | None:
    """Fills job.tokens_by_sample; returns an error kind, 'refused', or None."""
    stream = job.kind.endswith("_stream")
    if job.kind.startswith("http_completions"):
        path = "/v1/completions"
        body: dict[str, Any] = {"prompt": job.prompt, "max_tokens": job.max_tokens, "n": job.n, "temperature": 1.0,
                                "seed": job.seed, "ignore_eos": True, "stream": stream}
    else:
        path = "/generate"
        body = {"input_ids": job.prompt, "stream": stream, "sampling_params": {
            "max_new_tokens": job.max_tokens, "n": job.n, "temperature": 1.0, "sampling_seed": job.seed,
            "ignore_eos": True}}
    async with http.stream("POST", path, json=body) as r:
        if r.status_code == 503:
            return "refused"
        if r.status_code != 200:
            return f"http_{r.status_code}"
        if not stream:
            data = json.loads(await r.aread())
            if path == "/v1/completions":
                for c in data["choices"]:
                    job.tokens_by_sample[c["index"]] = len(c["token_ids"])
            else:
                for i, item in enumerate(data if isinstance(data, list) else [data]):
                    job.tokens_by_sample[i] = len(item["output_ids"])
            return None
        lines = [line async for line in r.aiter_lines()]
    for event in _sse(lines):
        if "error" in event:
            return "stream_error"
        if path == "/v1/completions":
            for c in event["choices"]:
                job.tokens_by_sample[c["index"]] = job.tokens_by_sample.get(c["index"], 0) + len(c["token_ids"])
        else:
            job.tokens_by_sample[event.get("index", 0)] = len(event["output_ids"])  # cumulative
    return None


async def _grpc(client: AsyncSpecrollClient, job: Job) -> str | None:
    try:
        async for ev in client.stream(job.prompt, n=job.n, max_tokens=job.max_tokens, temperature=1.0,
                                      seed=job.seed, ignore_eos=True):
            if isinstance(ev, Sample):
                job.tokens_by_sample[ev.index] = len(ev.token_ids)
    except SpecrollError as exc:
        return "refused" if exc.code == "RESOURCE_EXHAUSTED" else f"grpc_{exc.code}"
    return None


async def _one(job: Job, http: httpx.AsyncClient, client: AsyncSpecrollClient, timeout_s: float) -> Outcome:
    start = time.perf_counter()
    try:
        result = await asyncio.wait_for(_grpc(client, job) if job.kind == "grpc_generate" else _http(http, job),
                                        timeout_s)
    except TimeoutError:
        result = "timeout"
    except (httpx.HTTPError, OSError) as exc:
        result = type(exc).__name__
    latency = time.perf_counter() - start
    if result == "refused":
        return Outcome(job.kind, latency, refused=True)
    tokens = sum(job.tokens_by_sample.values())
    if result is not None:
        return Outcome(job.kind, latency, tokens, error=result)
    short = sum(1 for i in range(job.n) if job.tokens_by_sample.get(i, 0) < job.max_tokens)
    return Outcome(job.kind, latency, tokens, truncated=short)


def _jobs(count: int, vocab: int, max_tokens: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [Job(KINDS[i % len(KINDS)], [rng.randrange(1, vocab) for _ in range(rng.randint(4, 24))],
                rng.choice([1, 1, 2]), max_tokens, rng.randrange(2**31)) for i in range(count)]


def _loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


async def run_load(http_url: str, grpc_target: str, *, concurrency: int, requests: int, max_tokens: int,
                   timeout_s: float, seed: int = 0) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with (httpx.AsyncClient(base_url=http_url, timeout=timeout_s, limits=limits) as http,
                AsyncSpecrollClient(grpc_target, timeout_s=timeout_s, retries=0) as client):
        info = (await http.get("/server_info")).json()
        jobs = _jobs(requests, int(info.get("vocab_size") or 64), max_tokens, seed)
        gate = asyncio.Semaphore(concurrency)

        async def gated(job: Job) -> Outcome:
            async with gate:
                return await _one(job, http, client, timeout_s)

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(gated(j) for j in jobs))
        wall = time.perf_counter() - start
    answered = [o for o in outcomes if o.error is None and not o.refused]
    latencies = sorted(o.latency_s for o in answered)
    tokens = sum(o.tokens for o in outcomes)

    def pct(q: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3) if latencies else None

    return {
        "requests": len(outcomes), "concurrency": concurrency, "max_tokens": max_tokens, "ok": len(answered),
        "errors": sum(1 for o in outcomes if o.error),
        "errors_by_kind": dict(Counter(f"{o.kind}:{o.error}" for o in outcomes if o.error)),
        "refusals": sum(1 for o in outcomes if o.refused),
        "truncated_samples": sum(o.truncated for o in outcomes), "requests_by_kind": dict(Counter(j.kind
                                                                                               for j in jobs)),
        "p50_latency_s": pct(0.5), "p99_latency_s": pct(0.99),
        "mean_latency_s": round(statistics.fmean(latencies), 3) if latencies else None,
        "wall_s": round(wall, 2), "output_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
        "loadavg": _loadavg(), "cpus": os.cpu_count(),
        "server": {k: v for k, v in info.items() if k not in ("model_path", "num_running", "num_waiting")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=1000)
    p.add_argument("--requests", type=int, default=None, help="total requests (default: --concurrency)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http", default=None, help="HTTP base URL of a running server")
    p.add_argument("--grpc", default=None, help="gRPC host:port of the same server")
    p.add_argument("--server-arg", action="append", default=[], help="extra `serve` argument (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    requests = args.requests or args.concurrency

    def go(http_url: str, grpc_target: str) -> dict[str, Any]:
        return asyncio.run(run_load(http_url, grpc_target, concurrency=args.concurrency, requests=requests,
                                    max_tokens=args.max_tokens, timeout_s=args.timeout, seed=args.seed))

    if args.http and args.grpc:
        result = go(args.http, args.grpc)
    else:
        with local_server(args.server_arg) as (http_url, grpc_target):
            result = go(http_url, grpc_target)
            result["server_args"] = args.server_arg
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
