"""Weight pushes against their raw limits: every path side by side with the bare transport of the same bytes.

Per checkpoint (a Qwen2 model of each `--sizes-mb` in each `--dtypes`, our initialiser, no downloads) one
`specroll serve` and one bare-transport subprocess; each round pushes the same weights over every path, each
paired with its raw limit on the same bytes (the order alternates): gRPC `PushWeights` (client hashing included)
vs a bare grpc.aio stream; HTTP `/weights/upload` vs a bare uvicorn body; `/update_weights_from_disk` (file in
the page cache) vs memcpy; `push_weights_shm` (the client writes a safetensors file into /dev/shm, the
server loads it, the file is removed: two copies in all) vs memcpy; `push_weights_memfd` (the same through a
sealed memfd) vs memcpy; the collective path (client.weights `WeightGroup`) vs a bare gloo broadcast. Then one
gRPC push (mode keep) while greedy streams generate: the swap hold (server-measured), the push's time, and the
token gaps around the swap and during the push against those before it. Prints one JSON line (GB/s per round,
median ratios to each raw limit, swap holds, loadavg) and writes a PNG to `--png` when matplotlib is there.

    python -m bench.weight_push [--sizes-mb 256 1024] [--dtypes bfloat16 float32] [--rounds 3] [--png out.png]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import http.client
import inspect
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import grpc
import httpx
import numpy as np
import torch
from safetensors.torch import save, save_file

from client import AsyncSpecrollClient, Sample
from client import weights as wt
from service.demo.default_model import init_qwen2_weights
from service.netutil import free_port

logger = logging.getLogger("bench.weight_push")
TOKEN = "bench"
PATHS = ("grpc", "http", "disk", "shm", "memfd", "collective")
RAW = {"grpc": "bare grpc.aio stream", "http": "bare uvicorn body", "disk": "memcpy", "shm": "memcpy",
       "memfd": "memcpy", "collective": "bare gloo"}
RAW_METHOD = "/bench.Raw/Push"


def model_config(size_mb: int, bytes_per_param: int) -> dict[str, Any]:
    """A Qwen2 config of about `size_mb` MB: as many layers as the size asks for (narrow below 64 MB)."""
    wide = size_mb >= 64
    hidden, inter, heads, kv_heads, head_dim, vocab = (1024, 2816, 16, 8, 64, 8192) if wide else (256, 704, 4, 2, 64,
                                                                                                  2048)
    per_layer = hidden * heads * head_dim * 2 + 2 * kv_heads * head_dim * hidden + 3 * hidden * inter + 4 * hidden
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
    weights = {k: v.to(dtype).contiguous() for k, v in init_qwen2_weights(config).items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return weights


def start_server(model: Path, dtype: str, http_port: int, grpc_port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "service.cli", "--log-level", "WARNING", "serve", "--model", str(model),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--device", "cpu",
           "--dtype", dtype, "--max-model-len", "512", "--max-num-seqs", "8", "--kv-cache-gb", "0.25",
           "--enforce-eager"]  # a background compile would compete with the pushes for the cores
    return subprocess.Popen(cmd, env=dict(os.environ, SPECROLL_LOG_LEVEL="WARNING", SPECROLL_ADMIN_TOKEN=TOKEN))


# -- the bare transports (a subprocess, like the server) -------------------------------------------------
def _gloo_group(port: int, rank: int, timeout_s: float = 300.0) -> Any:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def raw_server(grpc_port: int, http_port: int) -> None:
    """Receives and drops: gRPC chunk streams, HTTP bodies, gloo broadcasts into tensors it allocates once."""
    import uvicorn

    groups: dict[str, Any] = {}

    async def push(request_iterator: Any, context: Any) -> bytes:
        n = 0
        async for raw in request_iterator:
            n += len(raw)
        return str(n).encode()

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        n, body = 0, bytearray()
        while True:
            msg = await receive()
            n += len(msg.get("body", b""))
            if scope["path"] != "/upload":
                body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] == "/gloo":  # {port, sizes, dtype}: join (first time), then receive the broadcasts
            req = json.loads(body)
            await asyncio.to_thread(_gloo_receive, groups, req)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": str(n).encode()})

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 2**20)])
        handler = grpc.stream_unary_rpc_method_handler(push)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Raw", {"Push": handler}),))
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        await server.start()
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="warning")).serve()

    asyncio.run(main())


def _gloo_receive(groups: dict[str, Any], req: dict[str, Any]) -> None:
    key = str(req["port"])
    if key not in groups:
        groups[key] = (_gloo_group(req["port"], 1), {})
    pg, buffers = groups[key]
    dtype = getattr(torch, req["dtype"])
    for i, numel in enumerate(req["numels"]):
        if i not in buffers or buffers[i].numel() != numel:
            buffers[i] = torch.empty(numel, dtype=dtype)
        pg.broadcast([buffers[i]]).wait()


def _post_body(base_url: str, path: str, body: bytes, headers: dict[str, str]) -> Any:
    """POST a body in one `sendall` (http.client) and return the reply's JSON. httpx sends a large body at well
    under 0.1 GB/s on loopback, which would make the client, not the server, what both HTTP paths measure."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=1200)
    try:
        conn.request("POST", path, body=body, headers={**headers, "content-type": "application/octet-stream"})
        reply = conn.getresponse()
        data = reply.read()
    finally:
        conn.close()
    if reply.status != 200:
        raise RuntimeError(f"POST {path.split('?')[0]}: HTTP {reply.status}: {data[:500]!r}")
    return json.loads(data)


# -- one round of each path and its raw limit ------------------------------------------------------------
class Bench:
    def __init__(self, weights: dict[str, torch.Tensor], folder: Path, http_url: str, grpc_target: str,
                 raw_http: str, raw_grpc: str) -> None:
        self.weights, self.folder, self.http_url = weights, folder, http_url
        self.grpc_target, self.raw_http, self.raw_grpc = grpc_target, raw_http, raw_grpc
        self.nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        self.body = save(weights)
        self.copy_dst = np.empty(len(self.body), dtype=np.uint8)
        self.http = httpx.Client(timeout=1200)
        self.auth = {"authorization": f"Bearer {TOKEN}"}
        self.checksum = "xxh3_128" if _has_checksums() else "sha256"
        self.swaps: dict[str, list[float]] = {p: [] for p in PATHS}
        self._round = itertools.count()
        self.group: wt.WeightGroup | None = None
        self.raw_port = free_port()
        self.raw_channel = grpc.insecure_channel(raw_grpc, options=[("grpc.max_send_message_length", 64 * 2**20)])

    def version(self, path: str) -> str:
        return f"{path}-{next(self._round)}"

    def grpc(self, client: AsyncSpecrollClient, loop: asyncio.AbstractEventLoop) -> float:
        kw = {"checksum": self.checksum} if self.checksum != "sha256" else {}
        t0 = time.perf_counter()
        r = asyncio.run_coroutine_threadsafe(client.push_weights(self.weights, self.version("grpc"), mode="keep",
                                                                 **kw), loop).result()
        dt = time.perf_counter() - t0
        self.swaps["grpc"].append(r.swap_seconds * 1e3)
        return dt

    def grpc_raw(self) -> float:
        tensors = wt.from_state_dict(self.weights)
        call = self.raw_channel.stream_unary(RAW_METHOD, request_serializer=wt.serialize_push,
                                             response_deserializer=bytes)
        t0 = time.perf_counter()
        call(wt.iter_chunks(tensors), timeout=1200)
        return time.perf_counter() - t0

    def http_push(self) -> float:
        t0 = time.perf_counter()  # the body's digest is part of the push's cost
        params = {"version": self.version("http"), "mode": "keep", self.checksum: _digest(self.checksum, self.body)}
        reply = _post_body(self.http_url, "/weights/upload?" + urlencode(params), self.body, self.auth)
        dt = time.perf_counter() - t0
        self.swaps["http"].append(reply["swap_seconds"] * 1e3)
        return dt

    def http_raw(self) -> float:
        t0 = time.perf_counter()
        _post_body(self.raw_http, "/upload", self.body, {})
        return time.perf_counter() - t0

    def disk(self) -> float:
        t0 = time.perf_counter()
        r = self.http.post(self.http_url + "/update_weights_from_disk", headers=self.auth,
                           json={"model_path": str(self.folder), "weight_version": self.version("disk"),
                                 "mode": "keep", "flush_cache": False})
        dt = time.perf_counter() - t0
        r.raise_for_status()
        self.swaps["disk"].append(r.json()["swap_seconds"] * 1e3)
        return dt

    def shm(self, client: AsyncSpecrollClient, loop: asyncio.AbstractEventLoop) -> float:
        t0 = time.perf_counter()
        r = asyncio.run_coroutine_threadsafe(client.push_weights_shm(self.weights, self.version("shm"), mode="keep"),
                                             loop).result()
        dt = time.perf_counter() - t0
        self.swaps["shm"].append(r.swap_seconds * 1e3)
        return dt

    def memfd(self, client: AsyncSpecrollClient, loop: asyncio.AbstractEventLoop) -> float:
        t0 = time.perf_counter()
        r = asyncio.run_coroutine_threadsafe(client.push_weights_memfd(self.weights, self.version("memfd"),
                                                                       mode="keep"), loop).result()
        dt = time.perf_counter() - t0
        self.swaps["memfd"].append(r.swap_seconds * 1e3)
        return dt

    def disk_raw(self) -> float:
        src = np.frombuffer(self.body, dtype=np.uint8)
        t0 = time.perf_counter()
        np.copyto(self.copy_dst, src)
        return time.perf_counter() - t0

    def collective(self) -> float:
        if self.group is None:
            self.group = wt.WeightGroup.join(self.http_url, admin_token=TOKEN, timeout_s=600)
        t0 = time.perf_counter()
        r = self.group.push(self.weights, self.version("collective"), mode="keep")
        dt = time.perf_counter() - t0
        if "swap_seconds" in r:
            self.swaps["collective"].append(float(r["swap_seconds"]) * 1e3)
        return dt

    def collective_raw(self) -> float:
        tensors = [t.reshape(-1) for t in self.weights.values()]
        dtype = str(tensors[0].dtype).removeprefix("torch.")
        req = {"port": self.raw_port, "numels": [t.numel() for t in tensors], "dtype": dtype}
        reply: dict[str, Any] = {}
        call = threading.Thread(target=lambda: reply.update(r=self.http.post(self.raw_http + "/gloo", json=req)))
        call.start()
        if not hasattr(self, "_raw_pg"):
            self._raw_pg = _gloo_group(self.raw_port, 0)
        t0 = time.perf_counter()
        for t in tensors:
            self._raw_pg.broadcast([t]).wait()
        call.join()
        dt = time.perf_counter() - t0
        reply["r"].raise_for_status()
        return dt

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.http.close()
        self.raw_channel.close()


def _digest(kind: str, body: bytes) -> str:
    if kind == "sha256":  # a client without client.checksums (before the field)
        import hashlib

        return hashlib.sha256(body).hexdigest()
    from client import checksums

    return checksums.digest_of(kind, body)


def _has_checksums() -> bool:
    return "checksum" in inspect.signature(AsyncSpecrollClient.push_weights).parameters


async def pause_round(client: AsyncSpecrollClient, weights: dict[str, torch.Tensor], streams: int) -> dict[str, float]:
    """One gRPC push (mode keep) while `streams` greedy streams generate: the hold and the token gaps. A gap is
    between two tokens of one request: a request queued for a KV slot has no token to be late."""
    requests: list[list[float]] = []  # token arrival times, per request
    stop = asyncio.Event()

    async def consume(i: int) -> None:
        while not stop.is_set():
            times: list[float] = []
            requests.append(times)
            async for ev in client.stream([10 + i, 20, 30], max_tokens=400, temperature=0.0, ignore_eos=True):
                times.append(time.perf_counter())
                if isinstance(ev, Sample) or stop.is_set():
                    break

    tasks = [asyncio.create_task(consume(i)) for i in range(streams)]
    while not any(len(t) >= 5 for t in requests):  # generating (streams past the KV cache may queue)
        await asyncio.sleep(0.05)
    kw = {"checksum": "xxh3_128"} if _has_checksums() else {}
    t0 = time.perf_counter()
    result = await client.push_weights(weights, "pause-round", mode="keep", **kw)
    t1 = time.perf_counter()
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps_before = [b - a for ts in requests for a, b in itertools.pairwise(ts) if b < t0]
    around = [b - a for ts in requests for a, b in itertools.pairwise(ts) if b >= t1 - 0.05 and a <= t1 + 0.05]
    during = [b - a for ts in requests for a, b in itertools.pairwise(ts) if b > t0 and a < t1]  # overlap the push

    def ms(gaps: list[float], of: Callable[[list[float]], float]) -> float:
        return round(of(gaps) * 1e3, 2) if gaps else float("nan")

    return {"swap_ms": round(result.swap_seconds * 1e3, 3), "push_s": round(t1 - t0, 3),
            "median_gap_ms": ms(gaps_before, statistics.median),
            "max_gap_around_swap_ms": round(max(around, default=0.0) * 1e3, 2),
            "median_gap_during_push_ms": ms(during, statistics.median), "max_gap_during_push_ms": ms(during, max)}


def run_config(size_mb: int, dtype: str, rounds: int, streams: int, paths: tuple[str, ...]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="specroll-bench-") as tmp:
        model = Path(tmp) / "model"
        weights = build_checkpoint(model, size_mb, getattr(torch, dtype))
        http_port, grpc_port, raw_http, raw_grpc = free_port(), free_port(), free_port(), free_port()
        server = start_server(model, dtype, http_port, grpc_port)
        raw = subprocess.Popen([sys.executable, "-m", "bench.weight_push", "--raw-server", str(raw_grpc),
                                str(raw_http)])
        loop = asyncio.new_event_loop()
        runner = threading.Thread(target=loop.run_forever, daemon=True)
        runner.start()
        try:
            client = asyncio.run_coroutine_threadsafe(_connect(f"127.0.0.1:{grpc_port}"), loop).result()
            _wait_http(f"http://127.0.0.1:{raw_http}/ping")
            b = Bench(weights, model, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}",
                      f"http://127.0.0.1:{raw_http}", f"127.0.0.1:{raw_grpc}")
            (model / "model.safetensors").read_bytes()  # the file in the page cache
            ours = {"grpc": lambda: b.grpc(client, loop), "http": b.http_push, "disk": b.disk,
                    "shm": lambda: b.shm(client, loop), "memfd": lambda: b.memfd(client, loop),
                    "collective": b.collective}
            bare = {"grpc": b.grpc_raw, "http": b.http_raw, "disk": b.disk_raw, "shm": b.disk_raw,
                    "memfd": b.disk_raw,
                    "collective": b.collective_raw}
            for p in paths:  # untimed: the first push builds the spare, the first of each transport connects
                ours[p]()
                bare[p]()
            for key in b.swaps:
                b.swaps[key].clear()
            times: dict[str, dict[str, list[float]]] = {p: {"ours": [], "raw": []} for p in paths}
            for r in range(rounds):
                order = paths[r % len(paths):] + paths[: r % len(paths)]
                for p in order:
                    first, second = (("ours", ours[p]), ("raw", bare[p])) if r % 2 == 0 else (
                        ("raw", bare[p]), ("ours", ours[p]))
                    for kind, fn in (first, second):
                        times[p][kind].append(fn())
                logger.info("%d MB %s round %d: %s", size_mb, dtype, r,
                            {p: round(b.nbytes / times[p]["ours"][-1] / 1e9, 3) for p in paths})
            pause = asyncio.run_coroutine_threadsafe(pause_round(client, weights, streams), loop).result()
            b.close()
            asyncio.run_coroutine_threadsafe(client.close(), loop).result()
            return summarize(size_mb, dtype, b.nbytes, times, b.swaps, pause, b.checksum)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            for proc in (server, raw):
                proc.terminate()
                proc.wait(60)


async def _connect(target: str) -> AsyncSpecrollClient:
    client = AsyncSpecrollClient(target, admin_token=TOKEN, timeout_s=1200)
    await client.wait_until_ready(600)
    return client


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def summarize(size_mb: int, dtype: str, nbytes: int, times: dict[str, dict[str, list[float]]],
              swaps: dict[str, list[float]], pause: dict[str, float], checksum: str) -> dict[str, Any]:
    out: dict[str, Any] = {"size_mb": size_mb, "dtype": dtype, "bytes": nbytes, "checksum": checksum, "paths": {},
                           "pause": pause}
    for p, t in times.items():
        ratios = [raw / ours for ours, raw in zip(t["ours"], t["raw"], strict=True)]
        out["paths"][p] = {
            "gb_s": [round(nbytes / s / 1e9, 3) for s in t["ours"]],
            "raw": RAW[p], "raw_gb_s": [round(nbytes / s / 1e9, 3) for s in t["raw"]],
            "median_gb_s": round(nbytes / statistics.median(t["ours"]) / 1e9, 3),
            "median_raw_gb_s": round(nbytes / statistics.median(t["raw"]) / 1e9, 3),
            "ratio_to_raw": {"median": round(statistics.median(ratios), 3), "runs": [round(x, 3) for x in ratios]},
            "swap_ms_median": round(statistics.median(swaps[p]), 3) if swaps.get(p) else None,
        }
    return out


def plot(result: dict[str, Any], png: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    configs = result["configs"]
    fig, axes = plt.subplots(1, len(configs), figsize=(4.5 * len(configs), 4), squeeze=False)
    for ax, cfg in zip(axes[0], configs, strict=True):
        paths = list(cfg["paths"])
        x = np.arange(len(paths))
        ax.bar(x - 0.2, [cfg["paths"][p]["median_gb_s"] for p in paths], 0.4, label="specroll")
        ax.bar(x + 0.2, [cfg["paths"][p]["median_raw_gb_s"] for p in paths], 0.4, label="raw limit")
        ax.set_xticks(x, paths)
        ax.set_title(f"{cfg['size_mb']} MB {cfg['dtype']}")
        ax.set_ylabel("GB/s (median)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(png)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[256, 1024], help="e.g. 256 1024 2048")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4, help="greedy streams generating during the pause round")
    p.add_argument("--png", type=Path, default=None, help="write a bar chart here ('' or none: no chart)")
    p.add_argument("--quick", action="store_true", help="one 8 MB checkpoint per dtype (the test's size)")
    p.add_argument("--raw-server", nargs=2, type=int, metavar=("GRPC_PORT", "HTTP_PORT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.raw_server:
        raw_server(*args.raw_server)
        return 0
    if args.rounds < 1 or args.streams < 1:
        p.error("--rounds and --streams must be positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sizes = [8] if args.quick else args.sizes_mb
    load_start = os.getloadavg()
    configs = []
    for size in sizes:
        for dtype in args.dtypes:
            configs.append(run_config(size, dtype, args.rounds, args.streams, tuple(args.paths)))
            logger.info("config done: %s", json.dumps(configs[-1]))
    result: dict[str, Any] = {"bench": "weight_push", "rounds": args.rounds, "configs": configs,
                              "loadavg": [round(x, 2) for x in (*load_start, os.getloadavg()[0])]}
    if args.png is not None and str(args.png) not in ("", ".", "none"):
        result["png"] = plot(result, args.png) or str(args.png)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
