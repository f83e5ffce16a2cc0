"""`--weight-spare in-place` on a real server: a push pauses generation by its mode, loads into the serving
weights (no spare ever exists), lays them out for the CPU kernels again and resumes; outputs then equal a fresh
server's on the pushed weights. A bad file is refused before anything is written; a push failing after its
first write leaves the server refusing generation (503) and not ready until a complete push succeeds; a push
whose client leaves before its first write changes nothing (its pause withdrawn)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from helpers import make_checkpoint
from probes import metric, wait_for
from safetensors.torch import save
from service_utils import (
    ADMIN,
    across,
    assert_same,
    auth,
    checkpoint_tensors,
    fresh,
    group_trainer,
    perturbed,
    running,
    served,
    start_server,
    write_checkpoint,
)

from client import SpecrollClient, checksums
from client import weights as wt
from client.errors import SpecrollError
from service.app import BackgroundServer
from service.backend.base import PushUnsupported
from service.cli import build_parser, cmd_serve
from service.protogen import pb2

IN_PLACE = {"enforce_eager": True, "drafter": "none", "weight_spare": "in-place"}


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return make_checkpoint("qwen2", tied=False, dtype=torch.float32)


@pytest.fixture(scope="module")
def pushes(base_dir: Path) -> list[dict[str, torch.Tensor]]:
    base = checkpoint_tensors(base_dir)
    return [perturbed(base, seed=1), perturbed(base, seed=2)]


@pytest.fixture(scope="module")
def server(base_dir: Path, every_row_class_packed: None) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir, engine_kw=IN_PLACE))


@pytest.fixture()
def client(server: BackgroundServer) -> Iterator[SpecrollClient]:
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        yield c


def _serving(srv: BackgroundServer) -> torch.nn.Module:
    return srv.server.backend.loop.engine.runner.model


def _messages(tensors: dict[str, torch.Tensor], version: str, corrupt_last: bool = False,
              mode: str = "keep") -> list[Any]:
    """A gRPC push of `tensors`; `corrupt_last`: one byte of the last tensor flipped (its checksum then fails
    after every earlier tensor was written)."""
    tb = wt.from_state_dict(tensors)
    wt.hash_all(tb)
    manifest = wt.manifest(tb, "target", version, mode)
    chunks = [pb2.PushWeightsRequest(chunk=pb2.WeightChunk(offset=c.offset, data=b"".join(c.parts)))
              for c in wt.iter_chunks(tb, 64 * 1024)]
    if corrupt_last:
        data = bytearray(chunks[-1].chunk.data)
        data[-3] ^= 0xFF
        chunks[-1].chunk.data = bytes(data)
    return [pb2.PushWeightsRequest(manifest=manifest), *chunks]


def _push_call(ch: grpc.Channel) -> Any:
    return ch.stream_unary("/specroll.v1.Rollout/PushWeights", request_serializer=wt.serialize_push,
                           response_deserializer=pb2.WeightsReply.FromString)


def _raw_push(target: str, messages: list[Any]) -> Any:
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 16 * 2**20)]) as ch:
        return _push_call(ch)(iter(messages), metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=60)


def _leaving_push(target: str, manifest: Any, until: Any) -> None:
    """A push that sends its manifest and no tensor byte, then leaves (cancels) once `until()` holds."""
    gone = threading.Event()

    def requests() -> Iterable[Any]:
        yield manifest
        gone.wait(60)

    with grpc.insecure_channel(target) as ch:
        call = _push_call(ch).future(requests(), metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=60)
        try:
            wait_for(until, 30, "the server to take the push")
        finally:
            call.cancel()
            gone.set()
        with pytest.raises(grpc.FutureCancelledError):
            call.result()


def _settled(srv: BackgroundServer) -> bool:
    stats = srv.server.backend.stats()
    return not (stats.paused or stats.admission_held)


def test_grpc_and_disk_pushes_load_in_place_and_serve_exactly_the_pushed_weights(server, client, base_dir, pushes,
                                                                                  tmp_path):
    original = _serving(server)
    stager = server.server.backend.stager
    assert stager.spare("target") is None
    client.push_weights(pushes[0], "grpc-1", mode="keep")
    after_grpc = served(client)
    disk = write_checkpoint(base_dir, pushes[1], tmp_path / "disk")
    client.load_weights(str(disk), "disk-2", mode="keep")
    after_disk = served(client)
    assert _serving(server) is original and stager.spare("target") is None  # loaded into the one copy
    assert client.server_info().policy_version == "disk-2"
    assert_same(after_grpc, fresh(base_dir, pushes[0], tmp_path / "f1", enforce_eager=True, drafter="none"))
    assert_same(after_disk, fresh(base_dir, pushes[1], tmp_path / "f2", enforce_eager=True, drafter="none"))


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_a_push_in_place_follows_its_mode(server, client, pushes, mode):
    old = client.server_info().policy_version
    new = f"mode-{mode}"
    result, final = across(server, lambda: client.push_weights(pushes[0], new, mode=mode), max_tokens=200)
    assert result.version == new and client.server_info().policy_version == new
    spans = [(s.policy_version, s.start, s.end) for s in final.version_spans]
    k = len(final.token_ids)
    if mode == "wait":  # the stream finished on the old weights before any byte was written
        assert final.finish_reason == "length" and spans == [(old, 0, 200)]
    elif mode == "abort":
        assert final.finish_reason == "abort" and k < 200 and spans == [(old, 0, k)] and result.aborted
    else:  # paused, then resumed on the new weights
        assert final.finish_reason == "length" and k == 200
        assert [v for v, _, _ in spans] == [old, new] and spans[0][2] == spans[1][1]
    assert server.server.backend.stager.spare("target") is None


def test_a_bad_file_is_refused_before_anything_is_written(server, client, base_dir, pushes, tmp_path):
    client.push_weights(pushes[0], "good", mode="keep")
    before = served(client)
    bad = dict(pushes[1])
    name = next(n for n in bad if n.endswith("mlp.down_proj.weight"))
    bad[name] = bad[name].clone()
    bad[name].view(-1)[-1] = float("nan")
    with pytest.raises(SpecrollError, match="NaN or infinite"):
        client.load_weights(str(write_checkpoint(base_dir, bad, tmp_path / "nan")), "bad", mode="keep")
    assert client.server_info().policy_version == "good" and served(client) == before
    assert httpx.get(server.http_url + "/ready").status_code == 200


def test_a_push_failing_after_its_first_write_leaves_the_server_not_ready_until_a_good_push(server, client,
                                                                                             pushes):
    client.push_weights(pushes[0], "before", mode="keep")
    with pytest.raises(grpc.RpcError) as err:
        _raw_push(server.grpc_target, _messages(pushes[1], "torn", corrupt_last=True))
    assert "checksum mismatch" in err.value.details()
    url = server.http_url
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 503 and ready.json()["ready"] is False
    gen = httpx.post(url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}},
                     headers=auth())
    assert gen.status_code == 503 and "no valid version" in gen.text, gen.text
    with pytest.raises(SpecrollError, match="no valid version"):
        served(client)
    text = httpx.get(url + "/metrics").text
    assert metric(text, "specroll:weights_invalid") == 1 and metric(text, "specroll:ready") == 0
    client.push_weights(pushes[1], "after", mode="keep")
    wait_for(lambda: httpx.get(url + "/ready").status_code == 200, 10, "the server ready again")
    assert metric(httpx.get(url + "/metrics").text, "specroll:weights_invalid") == 0
    assert client.server_info().policy_version == "after"
    assert served(client)[0]


@pytest.mark.parametrize("mode", ["keep", "wait"])
def test_a_push_whose_client_leaves_before_its_first_byte_changes_nothing(server, client, pushes, mode):
    """Generation paused for the push, its client gone before any tensor byte came: nothing was written, so the
    pause is withdrawn and the weights it found serve on as their version; the next push goes through."""
    client.push_weights(pushes[0], "found", mode="keep")
    before = served(client)
    manifest = _messages(pushes[1], "left", mode=mode)[0]
    _leaving_push(server.grpc_target, manifest, lambda: server.server.backend.stats().paused)
    wait_for(lambda: _settled(server), 30, "generation resumed")
    assert httpx.get(server.http_url + "/ready").status_code == 200
    assert client.server_info().policy_version == "found" and served(client) == before
    assert client.push_weights(pushes[1], "next", mode="keep").version == "next"


def test_a_wait_push_whose_client_leaves_while_generation_drains_withdraws_its_pause(server, client, pushes):
    """Mode wait holds new requests back until what runs finishes. The client leaving meanwhile withdraws that
    hold at once: generation never pauses for it and the weights serve on, still their version. A try whose rows
    all finished before the server was seen holding is repeated (up to 5 times)."""
    client.push_weights(pushes[0], "drained", mode="keep")
    before = served(client)
    manifest = _messages(pushes[1], "left-draining", mode="wait")[0]
    for _ in range(5):
        finals: list[Any] = []
        started = threading.Event()

        def rows(finals: list[Any] = finals, started: threading.Event = started) -> None:
            with SpecrollClient(server.grpc_target) as c:
                for ev in c.stream([5, 6, 7], n=32, temperature=1.0, max_tokens=250, ignore_eos=True):
                    started.set()
                    if hasattr(ev, "finish_reason"):
                        finals.append(ev)

        stream = threading.Thread(target=rows, daemon=True)
        stream.start()
        assert started.wait(60)
        held_at: list[float] = []

        def holding(stream: threading.Thread = stream, held_at: list[float] = held_at) -> bool:
            if server.server.backend.stats().admission_held:
                held_at.append(time.monotonic())
            return bool(held_at) or not stream.is_alive()

        _leaving_push(server.grpc_target, manifest, holding)
        stream.join(120)
        wait_for(lambda: _settled(server), 30, "the hold withdrawn")
        assert len(finals) == 32 and {s.finish_reason for s in finals} == {"length"}
        assert all([v.policy_version for v in s.version_spans] == ["drained"] for s in finals)
        if held_at:
            break
    else:
        raise AssertionError("the rows finished before the server was seen holding for the push, in 5 tries")
    assert httpx.get(server.http_url + "/ready").status_code == 200
    assert client.server_info().policy_version == "drained" and served(client) == before
    assert client.push_weights(pushes[1], "after-drain", mode="keep").version == "after-drain"


def test_the_vllm_backend_refuses_in_place():
    args = build_parser().parse_args(["serve", "--backend", "vllm", "--weight-spare", "in-place"])
    with pytest.raises(ValueError, match="in-place is for the native backend"):
        cmd_serve(args)


def test_a_torn_http_upload_is_restored_by_an_sglang_disk_load(server, client, base_dir, pushes, tmp_path):
    """The HTTP body and SGLang's /update_weights_from_disk load in place too: a body whose bytes fail its
    checksum after the first writes leaves the server not ready; a good folder load restores it exactly."""
    body = save({k: v.contiguous() for k, v in pushes[0].items()})
    digest = checksums.digest_of("xxh3_128", body)
    corrupt = bytearray(body)
    corrupt[-5] ^= 0x01  # in the last tensor: every earlier one is already written
    r = httpx.post(server.http_url + "/weights/upload", params={"version": "torn", "xxh3_128": digest,
                                                                 "mode": "keep"},
                   content=bytes(corrupt), headers=auth(), timeout=60)
    assert r.status_code == 400 and "checksum mismatch" in r.text
    assert httpx.get(server.http_url + "/ready").status_code == 503
    folder = write_checkpoint(base_dir, pushes[1], tmp_path / "sglang")
    r = httpx.post(server.http_url + "/update_weights_from_disk", json={"model_path": str(folder),
                                                                         "weight_version": "sg-1"},
                   headers=auth(), timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert httpx.get(server.http_url + "/ready").status_code == 200
    assert server.server.backend.stager.spare("target") is None
    assert_same(served(client), fresh(base_dir, pushes[1], tmp_path / "f", enforce_eager=True, drafter="none"))


def test_in_place_lends_no_drafter_copy_to_an_in_process_trainer(server):
    """An in-place push overwrites the serving target an in-process trainer's teacher would read: the backend
    lends no drafter copy, so that trainer stays off (drafter_trainer/embedded.py) and the sidecar is named."""
    with pytest.raises(PushUnsupported, match="sidecar"):
        server.server.backend.drafter_copy()


def test_a_collective_push_loads_in_place(server, client, base_dir, pushes, tmp_path):
    """slime's process-group payloads reach an in-place server too: each bucket is written into the serving
    weights while generation is paused; outputs then equal a fresh server's on the pushed weights."""
    run = group_trainer("slime", server, pushes[0], "group-1", tmp_path, group="inplace")
    assert run.returncode == 0, run.stderr[-3000:]
    replies = json.loads(run.stdout.strip().splitlines()[-1])
    assert [r.get("success") for r in replies] == [True] * 4, replies  # init, two buckets, destroy
    assert client.server_info().policy_version == "group-1"
    assert server.server.backend.stager.spare("target") is None
    assert_same(served(client), fresh(base_dir, pushes[0], tmp_path / "f", enforce_eager=True, drafter="none"))


def test_a_trainer_killed_mid_broadcast_in_place_leaves_the_server_not_ready_until_a_good_push(
        server, client, base_dir, pushes, tmp_path):
    """In place, the buckets before the kill are in the serving weights already: the server refuses
    generation and is not ready (it cannot serve a half-written model); the next group's push restores it."""
    client.push_weights(pushes[0], "before-kill", mode="keep")
    run = group_trainer("die", server, pushes[1], "killed", tmp_path, group="dies-in-place")
    assert run.returncode == -9, run.stderr[-3000:]
    wait_for(lambda: httpx.get(server.http_url + "/ready").status_code == 503, 60, "the server not ready")
    with pytest.raises(SpecrollError, match="no valid version"):
        served(client)
    run = group_trainer("slime", server, pushes[1], "after-kill", tmp_path, group="dies-in-place")
    assert run.returncode == 0, run.stderr[-3000:]
    wait_for(lambda: httpx.get(server.http_url + "/ready").status_code == 200, 10, "the server ready again")
    assert client.server_info().policy_version == "after-kill"
    assert_same(served(client), fresh(base_dir, pushes[1], tmp_path / "f", enforce_eager=True, drafter="none"))


def test_a_delta_push_applies_in_place_and_a_stale_one_changes_nothing(server, client, base_dir, pushes, tmp_path):
    """A delta is written into the serving weights like any push; one against a version not served is refused
    before the pause, so the server stays ready on what it served."""
    near = dict(pushes[0])
    for name in sorted(near)[:3]:  # a few elements of a few tensors change
        t = near[name].clone()
        t.view(-1)[:: max(1, t.numel() // 7)] += 0.25
        near[name] = t
    pushed = wt.PushedState()
    client.push_weights(pushes[0], "d0", mode="keep", delta_from=pushed)
    with pytest.raises(SpecrollError, match="applies to version 'old'"):
        client.push_delta(near, "stale", base=pushes[0], base_version="old", mode="keep")
    assert httpx.get(server.http_url + "/ready").status_code == 200
    assert client.server_info().policy_version == "d0"
    full_bytes = sum(t.numel() * t.element_size() for t in near.values())
    r = client.push_weights(near, "d1", mode="keep", delta_from=pushed)
    assert r.version == "d1" and 0 < r.bytes < 0.5 * full_bytes  # only the changed part travelled
    assert_same(served(client), fresh(base_dir, near, tmp_path / "f", enforce_eager=True, drafter="none"))
