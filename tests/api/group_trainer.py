"""A trainer process pushing a safetensors checkpoint to a server over a gloo process group.

    python group_trainer.py slime|client|die|longer|shorter|client-wrong HTTP_URL WEIGHTS.safetensors VERSION GROUP

`slime` does what slime's trainer does, payloads and order alike: THUDM/slime at commit
624b824a898ab0ec1fcb4d373004c7f3852bf515, slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py
(`connect_rollout_engines_from_distributed`: the engine's /init_weights_update_group call is made, then rank 0 joins
the group; `update_weights_from_distributed`: per bucket the /update_weights_from_distributed call is made, then each
tensor is broadcast from rank 0 with async_op and the handles waited for) and slime/backends/sglang_utils/
sglang_engine.py (the payloads: dtypes as "float32", flush_cache False, weight_version a string). `die` does the same
but is killed halfway through the second bucket's broadcast. `longer` / `shorter` announce the second bucket as
slime does, print "ready" and wait for a line on stdin, then broadcast its first tensor with 64 elements more / fewer
than announced (a buggy trainer): the replies go to stdout, the group is left to the server to close. `client`
pushes with our client (client/weights.py); `client-wrong` pushes a tensor of a wrong shape with it. The admin
token comes from SPECROLL_ADMIN_TOKEN; TRANSFER_BACKEND=nccl runs `client` on CUDA.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

TOKEN = os.environ["SPECROLL_ADMIN_TOKEN"]


def post(url: str, payload: dict[str, Any], out: list[Any]) -> threading.Thread:
    def run() -> None:
        req = urllib.request.Request(url, json.dumps(payload).encode(), method="POST", headers={
            "content-type": "application/json", "authorization": f"Bearer {TOKEN}"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                out.append(json.loads(resp.read()))
        except urllib.error.HTTPError as exc:
            out.append({"status": exc.code, "body": exc.read().decode()})

    t = threading.Thread(target=run)
    t.start()
    return t


def slime_push(url: str, state: dict[str, torch.Tensor], version: str, group: str, die: bool = False,
               wrong_size: str = "") -> None:
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    out: list[Any] = []
    call = post(f"{url}/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                     "rank_offset": 1, "world_size": 2, "group_name": group,
                                                     "backend": "gloo"}, out)
    timeout = datetime.timedelta(seconds=60)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(2, 0, [], Backend("gloo"), PrefixStore(group, store), group_name=group,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {0: 0, 1: 1}
    call.join()
    names = sorted(state)
    for i, bucket in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        call = post(f"{url}/update_weights_from_distributed", {
            "names": bucket, "dtypes": [str(state[n].dtype).replace("torch.", "") for n in bucket],
            "shapes": [list(state[n].shape) for n in bucket], "group_name": group, "flush_cache": False,
            "weight_version": version}, out)
        if die and i == 1:
            dist.broadcast(state[bucket[0]], 0, group=pg)
            time.sleep(1.0)  # the server is receiving the rest of the bucket: die now
            os.kill(os.getpid(), signal.SIGKILL)
        if wrong_size and i == 1:
            print("ready", flush=True)
            sys.stdin.readline()
            flat = state[bucket[0]].reshape(-1)
            sent = torch.cat([flat, flat[:64]]) if wrong_size == "longer" else flat[:-64].clone()
            try:
                for t in (sent, *(state[n] for n in bucket[1:])):
                    dist.broadcast(t, 0, group=pg)
            except RuntimeError as exc:  # the server's receiver left the group
                out.append({"broadcast_failed": str(exc)[:300]})
            call.join()
            print(json.dumps(out), flush=True)
            return
        handles = [dist.broadcast(state[n], 0, group=pg, async_op=True) for n in bucket]
        for h in handles:
            h.wait()
        call.join()
    call = post(f"{url}/destroy_weights_update_group", {"group_name": group}, out)
    dist.destroy_process_group(pg)
    call.join()
    print(json.dumps(out))


def client_push(url: str, state: dict[str, torch.Tensor], version: str, group: str, wrong: bool) -> None:
    from client.weights import GroupPushError, WeightGroup

    backend = os.environ.get("TRANSFER_BACKEND", "gloo")  # nccl: the tensors are broadcast from CUDA
    if backend == "nccl":
        state = {k: v.cuda() for k, v in state.items()}
    g = WeightGroup.join(url, admin_token=TOKEN, group_name=group, backend=backend, timeout_s=60)
    try:
        if wrong:
            name = sorted(state)[0]
            try:
                g.push({**state, name: state[name][:-1].contiguous()}, version + "-wrong", bucket_bytes=64 * 1024)
            except GroupPushError as exc:
                print(json.dumps({"refused": str(exc)}))
        reply = g.push(state, version, bucket_bytes=64 * 1024)  # many buckets
        print(json.dumps(reply))
    finally:
        g.close()


if __name__ == "__main__":
    how, url, path, version, group = sys.argv[1:6]
    weights = {k: v.contiguous() for k, v in load_file(path).items()}
    if how in ("slime", "die", "longer", "shorter"):
        slime_push(url, weights, version, group, die=how == "die", wrong_size=how if how in ("longer", "shorter")
                   else "")
    else:
        client_push(url, weights, version, group, wrong=how == "client-wrong")
