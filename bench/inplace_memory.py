"""Server memory and generation pause of a weight push, with a spare (`--weight-spare start`) or in place.

Builds a Qwen2-architecture checkpoint of the requested size (bench/weight_push.py's builder), starts a server
process on it per setting, and pushes perturbed copies over gRPC (mode keep) while one greedy stream generates.
Prints one JSON line per setting: the server's peak RSS (VmHWM) after start and after the pushes, and per push
its seconds, the longest gap between two of the stream's token chunks while it ran (the generation pause), and
the server's RSS before it, its peak RSS while it ran, and its RSS once it is done.

    python bench/inplace_memory.py --size-mb 256 --dtype bfloat16 [--pushes 2] [--settings start,in-place]
        [--stream-tokens 300]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from bench.weight_push import build_checkpoint
from client import SpecrollClient

logger = logging.getLogger("bench.inplace_memory")
TOKEN = "bench-admin"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak(pid: int) -> bool:
    """Start the server's VmHWM over from its RSS now (Linux `clear_refs` 5), so the next read is this push's
    peak; False where the kernel refuses it (then the peak reads since start)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _run(model: Path, weights: dict[str, torch.Tensor], dtype: str, spare: str, pushes: int,
         stream_tokens: int) -> dict[str, object]:
    http, grpc_port = _port(), _port()
    cmd = [sys.executable, "-c", "from service.cli import main; main()", "serve", "--model", str(model),
           "--weight-spare", spare, "--enforce-eager", "--drafter", "none", "--dtype", dtype, "--http-port",
           str(http), "--grpc-port", str(grpc_port), "--max-model-len", "1024",
           "--max-num-seqs", "4", "--kv-cache-gb", "0.25"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, SPECROLL_ADMIN_TOKEN=TOKEN))
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{http}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"server ({spare}) did not become ready")
            time.sleep(0.2)
        started_kb = _status_kb(proc.pid, "VmHWM")
        results = []
        with SpecrollClient(f"127.0.0.1:{grpc_port}", admin_token=TOKEN) as c:
            for r in range(pushes):
                gen = torch.Generator().manual_seed(r)
                new = {k: v + (1e-3 * torch.randn(v.shape, generator=gen)).to(v.dtype) for k, v in weights.items()}
                arrivals: list[float] = []
                first = threading.Event()

                def consume(arrivals: list[float] = arrivals, first: threading.Event = first) -> None:
                    with SpecrollClient(f"127.0.0.1:{grpc_port}", admin_token=TOKEN) as s:
                        for _ in s.stream([5, 6, 7], temperature=0.0, max_tokens=stream_tokens, ignore_eos=True):
                            arrivals.append(time.monotonic())
                            first.set()

                stream = threading.Thread(target=consume, daemon=True)
                stream.start()
                first.wait(120)
                time.sleep(0.5)
                rss_before_kb = _status_kb(proc.pid, "VmRSS")
                reset = _reset_peak(proc.pid)
                t0 = time.monotonic()
                c.push_weights(new, f"bench-{r}", mode="keep")
                t1 = time.monotonic()
                stream.join(600)
                during = [b - a for a, b in itertools.pairwise(arrivals) if b >= t0 and a <= t1]
                results.append({"push_s": round(t1 - t0, 3), "pause_s": round(max(during, default=0.0), 3),
                                "stream_still_ran": bool(arrivals and arrivals[-1] > t1),
                                "rss_before_mb": round(rss_before_kb / 1024, 1),
                                "peak_mb": round(_status_kb(proc.pid, "VmHWM") / 1024, 1) if reset else None,
                                "rss_after_mb": round(_status_kb(proc.pid, "VmRSS") / 1024, 1)})
        peaks = [r["peak_mb"] for r in results if r["peak_mb"] is not None]
        peak_kb = max(peaks) * 1024 if len(peaks) == len(results) and peaks else _status_kb(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait(60)
    return {"weight_spare": spare, "peak_rss_after_start_mb": round(started_kb / 1024, 1),
            "peak_rss_after_pushes_mb": round(peak_kb / 1024, 1), "pushes": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--pushes", type=int, default=2)
    p.add_argument("--settings", default="start,in-place")
    p.add_argument("--stream-tokens", type=int, default=300, help="tokens the stream generating across a push asks")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="specroll-inplace-") as tmp:
        weights = build_checkpoint(Path(tmp) / "model", args.size_mb, getattr(torch, args.dtype))
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        for spare in args.settings.split(","):
            out = _run(Path(tmp) / "model", weights, args.dtype, spare, args.pushes, args.stream_tokens)
            print(json.dumps({"bytes": nbytes, "dtype": args.dtype, "loadavg": os.getloadavg(), **out}), flush=True)


if __name__ == "__main__":
    main()
