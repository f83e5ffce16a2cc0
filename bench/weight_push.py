"""Weight-push benchmark: GB/s of a push over loopback gRPC, and the pause it causes to generation.

Builds a Qwen2-architecture checkpoint of the requested size with our own initialiser (no downloads),
starts ``specroll serve`` on it in a subprocess, keeps a few greedy streams generating, pushes a perturbed
copy of the weights with the Python client (mode keep by default), and reports:

- push throughput: bytes / wall time of ``push_weights`` (client hashing, transfer, server checks, build,
  swap), and bytes / transfer-and-build time (without the client's hashing);
- the time the engine loop was held for the swap (server-measured), and the largest gap between two tokens
  of the running streams around the swap compared with their median gap.

    python bench/weight_push.py --size-mb 256 [--device cpu] [--dtype float32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from client import AsyncSpecrollClient, Sample
from client import weights as wt
from service.demo.default_model import init_qwen2_weights
from service.netutil import free_port

logger = logging.getLogger("bench.weight_push")


def model_config(size_mb: int, bytes_per_param: int) -> dict[str, Any]:
    """A Qwen2 config of about `size_mb` MB: hidden 1024, as many layers as the size asks for."""
    hidden, inter, heads, kv_heads, head_dim, vocab = 1024, 2816, 16, 8, 64, 8192
    per_layer = hidden * hidden * 2 + 2 * kv_heads * head_dim * hidden + 3 * hidden * inter + 4 * hidden
    layers = max(1, round((size_mb * 2**20 / bytes_per_param - vocab * hidden) / per_layer))
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "vocab_size": vocab, "tie_word_embeddings": True,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }


def build_checkpoint(folder: Path, size_mb: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    config = model_config(size_mb, torch.empty((), dtype=dtype).element_size())
    weights = {k: v.to(dtype) for k, v in init_qwen2_weights(config).items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return weights


def start_server(model: Path, args: argparse.Namespace, http_port: int, grpc_port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "service.cli", "--log-level", "WARNING", "serve", "--model", str(model),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--admin-token", "bench",
           "--device", args.device, "--dtype", args.serve_dtype, "--max-model-len", "512", "--max-num-seqs", "16",
           "--kv-cache-gb", "0.5", "--compile-before-serving"]
    return subprocess.Popen(cmd, env=dict(os.environ, SPECROLL_LOG_LEVEL="WARNING"))


async def one_push(c: AsyncSpecrollClient, weights: dict[str, torch.Tensor], version: str, mode: str,
                   streams: int) -> dict[str, float]:
    times: list[list[float]] = [[] for _ in range(streams)]
    stop = asyncio.Event()

    async def consume(i: int) -> None:
        while not stop.is_set():
            async for ev in c.stream([10 + i, 20, 30], max_tokens=400, temperature=0.0, ignore_eos=True):
                times[i].append(time.perf_counter())
                if isinstance(ev, Sample) or stop.is_set():
                    break

    tasks = [asyncio.create_task(consume(i)) for i in range(streams)]
    while streams and min(len(t) for t in times) < 5:
        await asyncio.sleep(0.05)
    t_hash = time.perf_counter()
    tensors = wt.from_state_dict(weights)
    await asyncio.to_thread(wt.hash_all, tensors)
    hash_s = time.perf_counter() - t_hash
    t0 = time.perf_counter()
    result = await c.push_weights(weights, version, mode=mode)
    t1 = time.perf_counter()
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps_before = [b - a for ts in times for a, b in itertools.pairwise(ts) if b < t0]
    gaps_push = [b - a for ts in times for a, b in itertools.pairwise(ts) if b >= t0 and a <= t1]
    around = [b - a for ts in times for a, b in itertools.pairwise(ts) if b >= t1 - 0.05 and a <= t1 + 0.05]
    return {
        "bytes": result.bytes, "push_s": t1 - t0, "client_hash_s": hash_s, "server_s": result.seconds,
        "swap_ms": result.swap_seconds * 1e3,
        "gb_per_s": result.bytes / (t1 - t0) / 1e9,
        "gb_per_s_server": result.bytes / result.seconds / 1e9,
        "median_gap_ms": statistics.median(gaps_before) * 1e3 if gaps_before else float("nan"),
        "max_gap_during_push_ms": max(gaps_push, default=0.0) * 1e3,
        "max_gap_around_swap_ms": max(around, default=0.0) * 1e3,
    }


async def bench(args: argparse.Namespace, model: Path, weights: dict[str, torch.Tensor], grpc_port: int) -> None:
    async with AsyncSpecrollClient(f"127.0.0.1:{grpc_port}", admin_token="bench", timeout_s=600) as c:
        await c.wait_until_ready(600)
        for r in range(args.repeats):
            gen = torch.Generator().manual_seed(r)
            new = {k: v + (0.001 * torch.randn(v.shape, generator=gen)).to(v.dtype) for k, v in weights.items()}
            res = await one_push(c, new, f"bench-{r}", args.mode, args.streams)
            logger.info("push %d: %s", r, json.dumps({k: round(v, 4) for k, v in res.items()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="checkpoint (and push) dtype")
    p.add_argument("--serve-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", default="keep", choices=["keep", "wait", "abort"])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="specroll-bench-") as tmp:
        model = Path(tmp) / "model"
        weights = build_checkpoint(model, args.size_mb, getattr(torch, args.dtype))
        size = sum(t.numel() * t.element_size() for t in weights.values())
        logger.info("checkpoint: %.1f MB in %d tensors (%s)", size / 1e6, len(weights), args.dtype)
        http_port, grpc_port = free_port(), free_port()
        proc = start_server(model, args, http_port, grpc_port)
        try:
            asyncio.run(bench(args, model, weights, grpc_port))
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
