"""A trainer process pushing safetensors checkpoints over vLLM's weight-transfer endpoints and a gloo group.

    python transfer_trainer.py trl HTTP_URL A.safetensors [B.safetensors ...]
    python transfer_trainer.py vllm|die|hang|staged|wrong|longer|shorter HTTP_URL A.safetensors VERSION MODE TIMEOUT_S

`trl`: trl 1.16.0's own `trl.generation.vllm_client.VLLMClient`, unchanged (`init_communicator`, then one
`update_named_params` per file), with its two NCCL transport names (`open_trainer_endpoint`,
`packed_nccl_broadcast_producer`) bound to gloo counterparts that chunk with vllm 0.32.0's own `pack_tensors`
(vllm/distributed/weight_transfer/packed_tensor.py). The other modes send the payloads, in the order, of vllm
0.32.0's `NCCLTrainerWeightTransferEngine.trainer_init` / `send_weights` (distributed/weight_transfer/
nccl_engine.py, through clients.py `HTTPVLLMWeightSyncClient`), packed in several chunks (`chunk_bytes`):
`die` is SIGKILLed and `hang` stalls after the first chunk, `staged` leaves finish to the test, `wrong`
announces a misshaped then an unknown tensor (a new engine after each refusal); `longer` / `shorter` print
"ready", wait for a stdin line, then pack a chunk 64 elements longer / shorter than announced (a buggy trainer).
The admin token: SPECROLL_ADMIN_TOKEN (on TRL's `requests` session); TRANSFER_BACKEND=nccl runs on CUDA.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

TOKEN = os.environ["SPECROLL_ADMIN_TOKEN"]
GROUP = "weight-transfer"  # the server's default store prefix for the weight-transfer engine
BACKEND = os.environ.get("TRANSFER_BACKEND", "gloo")  # nccl: the group and the broadcast tensors on CUDA


class Endpoint:
    """What TRL keeps as its communicator: a gloo group; `group` is what its close_communicator clears."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.group = type("Detached", (), {"store": None, "socket": None})()


def gloo_endpoint(init_info: dict[str, Any], rank: int = 0) -> Endpoint:
    """Rank 0 of a gloo group over a TCP store at master_address:master_port (what the server joins)."""
    timeout = datetime.timedelta(seconds=60)
    size = int(init_info["world_size"])
    store, _, _ = next(rendezvous(f"tcp://{init_info['master_address']}:{init_info['master_port']}", rank, size,
                                  timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(size, rank, [], Backend(BACKEND), PrefixStore(GROUP, store), group_name=GROUP,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(size)}
    return Endpoint(pg)


def vllm_packed_tensor() -> Any:
    """vLLM's packed_tensor module, loaded from its file (it needs only torch; importing vllm takes long)."""
    if "vllm" in sys.modules:
        from vllm.distributed.weight_transfer import packed_tensor

        return packed_tensor
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vllm is not installed for this interpreter"
    path = Path(spec.submodule_search_locations[0]) / "distributed" / "weight_transfer" / "packed_tensor.py"
    loaded = importlib.util.spec_from_file_location("vllm_packed_tensor", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def gloo_producer(iterator: Iterator[tuple[str, torch.Tensor]], group: Endpoint, src: int,
                  post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
                  buffer_size_bytes: int = 2**30, num_buffers: int = 2,
                  after_chunk: Callable[[int], None] | None = None) -> None:
    """vLLM's packed broadcast, each chunk a gloo broadcast instead of an NCCL one on a CUDA stream."""
    pack_tensors = vllm_packed_tensor().pack_tensors
    sent = 0
    warnings.filterwarnings("ignore", "Tensor .* exceeds buffer_size_bytes")  # a chunk then holds that tensor
    while (chunk := pack_tensors(iterator, post_iter_func, buffer_size_bytes)) is not None:
        dist.broadcast(chunk.packed_tensor if BACKEND == "gloo" else chunk.packed_tensor.cuda(), src, group=group.pg)
        sent += 1
        if after_chunk is not None:
            after_chunk(sent)


def run_trl(url: str, paths: list[str]) -> None:
    import trl.generation.vllm_client as trl_client

    trl_client.open_trainer_endpoint = gloo_endpoint
    trl_client.packed_nccl_broadcast_producer = gloo_producer
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    client = trl_client.VLLMClient(base_url=url, group_port=port)
    client.session.headers["authorization"] = f"Bearer {TOKEN}"
    client.init_communicator(device="cuda")  # TRL refuses any other device type; nothing CUDA runs here
    for path in paths:
        state = load_file(path)
        metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in state.items()]
        client.update_named_params(metadata, iter(state.items()))
        print(json.dumps({"pushed": path}), flush=True)
    client.close_communicator()


def post(url: str, payload: dict[str, Any] | None) -> dict[str, Any]:
    data = json.dumps(payload).encode() if payload is not None else b""
    req = urllib.request.Request(url, data, method="POST", headers={
        "content-type": "application/json", "authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode()}


class Call(threading.Thread):
    def __init__(self, url: str, payload: dict[str, Any] | None) -> None:
        super().__init__(daemon=True)
        self.url, self.payload, self.reply = url, payload, None
        self.start()

    def run(self) -> None:
        self.reply = post(self.url, self.payload)

    def result(self) -> Any:
        self.join()
        return self.reply


def chunk_bytes(state: dict[str, torch.Tensor]) -> int:
    """The `vllm` modes' packed buffer: exactly the first two tensors, so the second one reaches it without
    passing it (vLLM's chunk goes on), and the checkpoint takes several chunks."""
    first, second = list(state.values())[:2]
    return first.numel() * first.element_size() + second.numel() * second.element_size()


def engine(url: str, timeout_s: float, chunk: int) -> Endpoint:
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                 "packed": True, "packed_buffer_size_bytes": chunk, "packed_num_buffers": 2, "timeout_s": timeout_s,
                 "backend": BACKEND}
    call = Call(f"{url}/init_weight_transfer_engine", {"init_info": init_info})
    endpoint = gloo_endpoint(init_info)
    assert call.result() == {"message": "Weight transfer initialized"}, call.reply
    return endpoint


def send(url: str, endpoint: Endpoint, chunk: int, state: dict[str, torch.Tensor], version: str, mode: str,
         after_chunk: Callable[[int], None] | None = None, finish: bool = True,
         post_iter: Callable[[tuple[str, torch.Tensor]], torch.Tensor] = lambda item: item[1]) -> list[Any]:
    replies = [post(f"{url}/start_weight_update", {"mode": mode} if mode != "wait" else None)]
    update_info = {"names": list(state), "dtype_names": [str(t.dtype).split(".")[-1] for t in state.values()],
                   "shapes": [list(t.shape) for t in state.values()]}
    call = Call(f"{url}/update_weights", {"update_info": update_info})
    try:
        gloo_producer(iter(state.items()), endpoint, 0, post_iter, chunk, after_chunk=after_chunk)
    except RuntimeError as exc:  # the server refused the bucket and left the group
        replies.append({"broadcast_failed": str(exc)[:200]})
    replies.append(call.result())
    if finish and "status" not in replies[-1]:
        replies.append(post(f"{url}/finish_weight_update", {"weight_version": version}))
    return replies


def run_vllm(how: str, url: str, path: str, version: str, mode: str, timeout_s: float) -> None:
    state = load_file(path)
    chunk = chunk_bytes(state)
    endpoint = engine(url, timeout_s, chunk)

    def stop(sent: int) -> None:
        if how == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        print(json.dumps({"stalled_after_chunks": sent}), flush=True)
        time.sleep(3600)  # the test kills this process

    if how == "wrong":
        name = next(iter(state))
        for bad in ({**state, name: state[name][:-1].contiguous()}, {**state, "model.extra.weight": state[name]}):
            print(json.dumps(send(url, endpoint, chunk, bad, version + "-wrong", mode)), flush=True)
            dist.destroy_process_group(endpoint.pg)  # the refusal shut the engine down: init it again
            endpoint = engine(url, timeout_s, chunk)
    changed = next(iter(state)) if how == "longer" else list(state)[-1]  # the last chunk is short, not merged

    def resized(item: tuple[str, torch.Tensor]) -> torch.Tensor:
        flat = item[1].reshape(-1)
        if item[0] != changed:
            return item[1]
        return torch.cat([flat, flat[:64]]) if how == "longer" else flat[:-64].clone()

    if how in ("longer", "shorter"):
        print("ready", flush=True)
        sys.stdin.readline()
    replies = send(url, endpoint, chunk, state, version, mode, after_chunk=stop if how in ("die", "hang") else None,
                   finish=how != "staged", post_iter=resized if how in ("longer", "shorter") else lambda item: item[1])
    if how != "staged":  # `staged` leaves the received push for the test to finish
        post(f"{url}/shutdown_weight_transfer_engine", None)
    print(json.dumps(replies), flush=True)

if __name__ == "__main__":
    kind, base_url = sys.argv[1:3]
    if kind == "trl":
        run_trl(base_url, sys.argv[3:])
    else:
        run_vllm(kind, base_url, sys.argv[3], sys.argv[4], sys.argv[5], float(sys.argv[6]))
