"""Pushes written straight into the spare, on a real server: gRPC chunks and a safetensors load land in the
spare's own tensors (no staging copy), the served outputs equal a fresh server on the pushed weights (a spare
that served and was written into is laid out again), a push cancelled mid-stream gives the spare back before the
next push runs (which then loads into it), and a same-host push through /dev/shm loads and leaves no file."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from helpers import make_checkpoint
from probes import metric
from service_utils import ADMIN, assert_same, checkpoint_tensors, fresh, perturbed, running, served, start_server

from client import SpecrollClient
from client import weights as wt
from client.errors import InvalidArgument, SpecrollError
from client.protogen import pb2
from service.app import BackgroundServer
from service.backend.base import Destinations
from service.safetensors_io import CheckpointError, read_tensors

EAGER = {"enforce_eager": True, "drafter": "none", "weight_spare": "start", "dtype": "bfloat16"}
PUSH = "/specroll.v1.Rollout/PushWeights"


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return make_checkpoint("qwen2", tied=False, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def server(base_dir) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir, engine_kw=EAGER))


def _serving(srv: BackgroundServer) -> torch.nn.Module:
    return srv.server.backend.loop.engine.runner.model


def _failed(srv: BackgroundServer) -> float:
    return metric(httpx.get(f"{srv.http_url}/metrics").text, 'specroll:weight_sync_total{result="error",role="target"}')


def test_a_grpc_push_lands_in_the_spare_and_serves_like_a_fresh_server(server, base_dir, tmp_path):
    new = perturbed(checkpoint_tensors(base_dir), seed=61)
    stager = server.server.backend.stager
    spare = stager.spare("target")
    name = "model.layers.0.mlp.down_proj.weight"
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(new, "direct-1", mode="keep", chunk_bytes=4096)  # tensors span many chunks
        assert _serving(server) is spare
        assert server.server.ctx.pushes.staging("target").capacity == 0  # no tensor was gathered apart
        assert torch.equal(_serving(server).get_parameter(name.removeprefix("model.")), new[name])
        assert_same(served(c), fresh(base_dir, new, tmp_path / "ref", **EAGER))


def test_a_push_cancelled_mid_stream_gives_the_spare_back_to_the_next_push(server, base_dir, tmp_path):
    base = checkpoint_tensors(base_dir)
    lost, after = perturbed(base, seed=62), perturbed(base, seed=63)
    tensors = wt.from_state_dict(lost)
    wt.hash_all(tensors)
    manifest = wt.manifest(tensors, "target", "cancelled", "keep")
    sent, hold = threading.Event(), threading.Event()

    def requests() -> Iterator[Any]:
        yield pb2.PushWeightsRequest(manifest=manifest)
        for i, chunk in enumerate(wt.iter_chunks(tensors, 4096)):
            if i == 8:
                sent.set()
                hold.wait(60)  # the client goes quiet mid-stream, then cancels
                return
            yield chunk

    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(base, "before-cancel", mode="keep")
        spare, before, errors = server.server.backend.stager.spare("target"), served(c), _failed(server)
        assert spare is not None
        with grpc.insecure_channel(server.grpc_target) as channel:
            call = channel.stream_unary(PUSH, request_serializer=wt.serialize_push,
                                        response_deserializer=pb2.WeightsReply.FromString)
            future = call.future(requests(), metadata=[("authorization", f"Bearer {ADMIN}")], timeout=60)
            assert sent.wait(60)
            future.cancel()
            hold.set()
        c.push_weights(after, "after-cancel", mode="keep")  # queued behind the cancelled push's clean-up
        assert _failed(server) == errors + 1
        assert _serving(server) is spare  # loaded into the spare the cancelled push had taken
        assert c.server_info().policy_version == "after-cancel"
        assert served(c) != before
        assert_same(served(c), fresh(base_dir, after, tmp_path / "ref", **EAGER))


def test_a_safetensors_load_reads_each_tensor_into_its_destination(base_dir, tmp_path):
    """`read_tensors` writes a tensor with a destination into it (no other buffer) and one without into a
    buffer it reuses; a file cut short is an error naming the tensor, never a short tensor."""
    want = checkpoint_tensors(base_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    dst = torch.empty_like(want[name])
    into = Destinations()
    into.offer(lambda n: dst if n == name else None)
    seen = {}
    for n, t in read_tensors([base_dir / "model.safetensors"], into.get):
        seen[n] = (t.data_ptr() == dst.data_ptr(), torch.equal(t, want[n]))
    assert seen[name] == (True, True)
    assert all(eq for n, (_, eq) in seen.items()) and set(seen) == set(want)
    assert sum(direct for direct, _ in seen.values()) == 1
    cut = tmp_path / "cut.safetensors"
    data = (base_dir / "model.safetensors").read_bytes()
    cut.write_bytes(data[: len(data) - 10])
    with pytest.raises(CheckpointError, match=r"past the \d+ data bytes the file holds"):
        list(read_tensors([cut]))
    cut.write_bytes(data)
    reading = read_tensors([cut])
    next(reading)  # its header was checked against the whole file: then the file shrinks
    with cut.open("r+b") as f:
        f.truncate(len(data) // 2)
    with pytest.raises(CheckpointError, match="the file ends inside it"):
        list(reading)


@pytest.fixture(scope="module")
def shm_server(base_dir, tmp_path_factory) -> Iterator[BackgroundServer]:
    """A server that loads only from a checkpoint folder of its own and from shared memory."""
    roots = (str(tmp_path_factory.mktemp("checkpoints")), wt.SHM_DIR)
    yield from running(start_server(base_dir, engine_kw=EAGER, load_root=roots))


@pytest.mark.skipif(not Path(wt.SHM_DIR).is_dir(), reason="no /dev/shm on this host")
def test_a_shared_memory_push_loads_into_the_spare_and_leaves_no_file(shm_server, base_dir, tmp_path):
    new = perturbed(checkpoint_tensors(base_dir), seed=64)
    before = set(Path(wt.SHM_DIR).glob("specroll-push-*"))
    spare = shm_server.server.backend.stager.spare("target")
    with SpecrollClient(shm_server.grpc_target, admin_token=ADMIN) as c:
        r = c.push_weights_shm(new, "shm-1", mode="keep")
        assert r.version == "shm-1" and c.server_info().policy_version == "shm-1"
        assert _serving(shm_server) is spare
        assert_same(served(c), fresh(base_dir, new, tmp_path / "ref", **EAGER))
        with pytest.raises(InvalidArgument, match="served target is bfloat16"):  # refused: still removed
            c.push_weights_shm(new, "shm-2", dtype=torch.float32)
        assert c.server_info().policy_version == "shm-1"
    assert set(Path(wt.SHM_DIR).glob("specroll-push-*")) == before


def test_a_load_outside_every_load_root_is_refused(shm_server, base_dir, tmp_path):
    """Shared memory is allowed because the operator named it; a folder elsewhere still is not."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes((base_dir / "model.safetensors").read_bytes())
    with SpecrollClient(shm_server.grpc_target, admin_token=ADMIN) as c, pytest.raises(
            SpecrollError, match="outside the folders the server may load from"):
        c.load_weights(str(elsewhere), "elsewhere")
