"""Same-GPU pushes through CUDA IPC handles (/update_weights_from_tensor, service/api/cuda_ipc.py).

Everywhere: SGLang's payload of pickled tensors is refused and never unpickled, and a handle's fields are checked
(base64, the tensor's bytes inside its storage, torch's counter name, dtype, duplicates) before any handle is
opened. Where CUDA is: a trainer process on the same GPU pushes from its own memory; the server then serves like
one started on those weights, a second push reuses the spare, and a wrong shape is refused with nothing changed.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers import default_checkpoint
from safetensors.torch import save_file
from service_utils import (
    ADMIN,
    auth,
    checkpoint_tensors,
    fresh,
    perturbed,
    running,
    served,
    start_server,
    trainer_env,
)

from client import SpecrollClient
from service.app import BackgroundServer

HERE = Path(__file__).parent
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return default_checkpoint(tied=False)


@pytest.fixture(scope="module")
def server(base_dir: Path) -> Iterator[BackgroundServer]:
    # CUDA: with graphs, which a reused spare's weights must keep feeding; CPU: nothing to compile for these checks
    yield from running(start_server(base_dir, engine_kw={"device": "cuda:0"} if CUDA else {"enforce_eager": True}))


def post(srv: BackgroundServer, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.http_url}/update_weights_from_tensor", json=payload, headers=auth(), timeout=120)


def version(srv: BackgroundServer) -> str:
    return httpx.get(f"{srv.http_url}/weights/version", timeout=30).json()["policy_version"]


class _Marker:
    """Unpickling this creates a folder: the proof that the server never unpickles."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (str(self.path),)


def test_sglangs_pickled_tensors_are_refused_and_never_unpickled(server, tmp_path):
    # SGLang's payload: sgl-project/sglang at f11d231cea29f76f78aaa524783d6556267e3b58,
    # python/sglang/srt/managers/io_struct.py, UpdateWeightsFromTensorReqInput (base64 strings over HTTP).
    marker = tmp_path / "unpickled"
    before = version(server)
    reply = post(server, {"serialized_named_tensors": [base64.b64encode(pickle.dumps(_Marker(marker))).decode()],
                          "load_format": None, "flush_cache": True, "abort_all_requests": False,
                          "weight_version": "pickled"})
    assert reply.status_code == 400 and "never unpickles" in reply.json()["error"]["message"]
    assert not marker.exists() and version(server) == before


def _handle(**override: Any) -> dict[str, Any]:
    """A well-formed handle for a 4x8 float32 tensor (its GPU memory exists nowhere)."""
    h = {"name": "model.norm.weight", "dtype": "float32", "shape": [4, 8], "offset": 0, "device": 0,
         "handle": base64.b64encode(b"\0" * 64).decode(), "storage_bytes": 128, "storage_offset": 0,
         "ref_counter": base64.b64encode(b"/torch_1_2_3").decode(), "ref_counter_offset": 0, "event": None,
         "event_sync": False}
    return {**h, **override}


@pytest.mark.parametrize(("handles", "message"), [
    ([_handle(handle="not base64!")], "handle is not base64"),
    ([_handle(storage_bytes=64)], "do not lie inside its storage"),
    ([_handle(offset=1)], "do not lie inside its storage"),
    ([_handle(shape=[4, -8], storage_bytes=10**6)], "negative size"),
    ([_handle(ref_counter=base64.b64encode(b"/etc/passwd").decode())], "not a torch IPC counter's name"),
    ([_handle(dtype="int8")], "dtype 'int8'"),
    ([_handle(), _handle()], "arrives twice"),
    ([], "holds no tensors"),
    ([_handle(name="model.layers.0.nope.weight")], "model.layers.0.nope.weight"),
], ids=["base64", "short-storage", "offset", "negative", "counter-name", "dtype", "twice", "empty", "unknown-name"])
def test_handle_fields_are_checked_before_any_is_opened(server, handles, message):
    before = version(server)
    reply = post(server, {"ipc_tensors": handles, "weight_version": "bad"})
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    assert version(server) == before


@pytest.mark.skipif(CUDA, reason="this server sees a CUDA device")
def test_a_server_without_cuda_says_so(server, base_dir):
    complete = [_handle(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                        storage_bytes=t.numel() * t.element_size()) for n, t in checkpoint_tensors(base_dir).items()]
    reply = post(server, {"ipc_tensors": complete, "weight_version": "no-cuda"})
    assert reply.status_code == 409 and "sees no CUDA device" in reply.json()["error"]["message"]


def _trainer(kind: str, srv: BackgroundServer, weights: Path, version: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(HERE / "ipc_trainer.py"), kind, srv.http_url, str(weights), version],
                          env=trainer_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.skipif(not CUDA, reason="CUDA IPC needs a CUDA device (the trainer's memory and the server's engine)")
def test_a_trainer_on_the_same_gpu_pushes_from_its_own_memory(server, base_dir, tmp_path):
    for i, seed in enumerate((71, 72)):  # the second push reuses the spare the first left
        new = perturbed(checkpoint_tensors(base_dir), seed=seed)
        save_file({k: v.contiguous() for k, v in new.items()}, str(tmp_path / f"w{i}.safetensors"))
        reply = _trainer("ok", server, tmp_path / f"w{i}.safetensors", f"ipc-v{i}")
        assert reply.get("version") == f"ipc-v{i}", reply
        with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
            got, want = served(c), fresh(base_dir, new, tmp_path / f"ref{i}", device="cuda:0")
        assert got[0] == want[0]
        assert torch.allclose(torch.tensor(got[1]), torch.tensor(want[1]), atol=1e-4, rtol=0)

    reply = _trainer("wrong-shape", server, tmp_path / "w0.safetensors", "ipc-wrong")
    assert "shape" in reply.get("error", ""), reply
    assert version(server) == "ipc-v1"
