"""A push's integrity check, whichever kind it names (xxh3_128, crc32c, sha256 or none named: a client that predates
the field), over gRPC chunks and HTTP safetensors bodies: a good push serves exactly what a fresh server on the
same weights serves, a corrupted byte is refused naming the tensor, and nothing is swapped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
from helpers import default_checkpoint
from safetensors.torch import save
from service_utils import ADMIN, auth, checkpoint_tensors, perturbed, running, start_server, write_checkpoint

from client import SpecrollClient, checksums
from client import weights as wt
from service.api.push_protocol import ChunkReceiver, Manifest, Staging, TensorEntry
from service.app import BackgroundServer
from service.protogen import pb2

PROMPTS = [[5, 9, 13], [7, 3, 22, 41, 8]]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "raw_logprobs": True}


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return default_checkpoint(tied=False)


@pytest.fixture(scope="module")
def new(base_dir) -> dict[str, torch.Tensor]:
    return perturbed(checkpoint_tensors(base_dir), seed=4)


@pytest.fixture(scope="module")
def server(base_dir) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir))


@pytest.fixture(scope="module")
def client(server) -> Iterator[SpecrollClient]:
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        yield c


def outputs(c: SpecrollClient) -> list[tuple[list[int], list[float]]]:
    return [(s.token_ids, list(s.raw_logprobs)) for comp in c.generate(PROMPTS, **GREEDY) for s in comp.samples]


def same(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]]) -> bool:
    """The same greedy tokens and raw logprobs (to float32 rounding: a pushed model's kernels may differ from a
    freshly loaded one's in summation order, never in the weights: a wrong byte moves them by far more)."""
    return all(ta == tb and torch.allclose(torch.tensor(la), torch.tensor(lb), rtol=0, atol=1e-5)
               for (ta, la), (tb, lb) in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def fresh_outputs(base_dir, new, tmp_path_factory) -> list[tuple[list[int], list[float]]]:
    """What a server started on the pushed weights serves."""
    srv = start_server(write_checkpoint(base_dir, new, tmp_path_factory.mktemp("fresh") / "model"))
    try:
        with SpecrollClient(srv.grpc_target) as c:
            return outputs(c)
    finally:
        srv.stop()


def raw_push(target: str, messages: list[Any]) -> Any:
    with grpc.insecure_channel(target) as ch:
        call = ch.stream_unary("/specroll.v1.Rollout/PushWeights", request_serializer=wt.serialize_push,
                               response_deserializer=pb2.WeightsReply.FromString)
        return call(iter(messages), metadata=tuple(auth().items()), timeout=60)


def messages(tensors: dict[str, torch.Tensor], version: str, checksum: str | None) -> list[Any]:
    """A push as a client sends it; checksum None: as a client that predates the field (sha256 in TensorSpec.sha256,
    no `checksum`, no `digest`)."""
    tb = wt.from_state_dict(tensors)
    wt.hash_all(tb, checksum=checksum or "sha256")
    m = wt.manifest(tb, "target", version, "keep", checksum=checksum or "sha256")
    if checksum is None:
        m.ClearField("checksum")
        for spec in m.tensors:
            spec.sha256, spec.digest = spec.digest, ""
    chunks = [pb2.PushWeightsRequest(chunk=pb2.WeightChunk(offset=c.offset, data=b"".join(c.parts)))
              for c in wt.iter_chunks(tb, 256 * 1024)]
    return [pb2.PushWeightsRequest(manifest=m), *chunks]


@pytest.mark.parametrize("kind", [*checksums.KINDS, None])
def test_grpc_push_of_each_kind_serves_what_a_fresh_server_serves(server, client, new, fresh_outputs, kind):
    client.push_weights({k: v * 0.5 for k, v in new.items()}, "other", mode="keep")
    assert not same(outputs(client), fresh_outputs)
    reply = raw_push(server.grpc_target, messages(new, f"good-{kind}", kind))
    assert reply.version == f"good-{kind}" and client.server_info().policy_version == f"good-{kind}"
    assert same(outputs(client), fresh_outputs)


@pytest.mark.parametrize("kind", [*checksums.KINDS, None])
def test_grpc_corrupted_chunk_of_each_kind_is_refused_and_nothing_swapped(server, client, new, kind):
    client.push_weights(new, "before", mode="keep")
    before = outputs(client)
    msgs = messages({k: v * 0.5 for k, v in new.items()}, f"bad-{kind}", kind)
    data = bytearray(msgs[2].chunk.data)  # the second chunk: inside a tensor that spans chunks
    data[1000] ^= 0x01
    msgs[2].chunk.data = bytes(data)
    with pytest.raises(grpc.RpcError) as err:
        raw_push(server.grpc_target, msgs)
    name = msgs[0].manifest.tensors[0].name
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "checksum mismatch for tensor" in err.value.details() and f"({kind or 'sha256'})" in err.value.details()
    assert name in err.value.details() or any(t.name in err.value.details() for t in msgs[0].manifest.tensors)
    assert client.server_info().policy_version == "before" and same(outputs(client), before)


def test_grpc_digest_of_the_wrong_form_or_kind_is_refused_before_any_byte(server, client, new):
    msgs = messages(new, "bad-form", "xxh3_128")
    msgs[0].manifest.tensors[1].digest = "abc"
    with pytest.raises(grpc.RpcError) as err:
        raw_push(server.grpc_target, msgs[:1])  # no chunk at all: refused on the manifest
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "32 hex digits" in err.value.details()
    msgs[0].manifest.checksum = "md5"
    with pytest.raises(grpc.RpcError) as err:
        raw_push(server.grpc_target, msgs[:1])
    assert "checksum must be one of" in err.value.details()
    tb = wt.from_state_dict(new)  # a lying crc32c digest, sent as the client sends chunks
    wt.hash_all(tb, checksum="crc32c")
    tb[0].digest = f"{(int(tb[0].digest, 16) ^ 1):08x}"
    m = wt.manifest(tb, "target", "lying", "keep", checksum="crc32c")
    with pytest.raises(grpc.RpcError) as err:
        raw_push(server.grpc_target, [pb2.PushWeightsRequest(manifest=m), *wt.iter_chunks(tb)])
    assert f"checksum mismatch for tensor {tb[0].name!r}" in err.value.details() and "(crc32c)" in err.value.details()
    assert client.server_info().policy_version != "lying"


@pytest.mark.parametrize("kind", checksums.KINDS)
def test_http_upload_of_each_kind_and_a_corrupted_body(server, client, new, fresh_outputs, kind):
    up = server.http_url + "/weights/upload"
    client.push_weights({k: v * 0.5 for k, v in new.items()}, "other", mode="keep")
    before = outputs(client)
    body = save({k: v.contiguous() for k, v in new.items()})
    digest = checksums.digest_of(kind, body)
    corrupt = bytearray(body)
    corrupt[len(body) // 2] ^= 0x01  # a byte of tensor data: the header still parses
    r = httpx.post(up, params={"version": "bad", kind: digest, "mode": "keep"}, content=bytes(corrupt),
                   headers=auth(), timeout=60)
    assert r.status_code == 400 and "checksum mismatch" in r.json()["error"]["message"] and kind in r.text
    assert client.server_info().policy_version == "other" and same(outputs(client), before)
    r = httpx.post(up, params={"version": f"up-{kind}", kind: digest, "mode": "keep"}, content=body, headers=auth(),
                   timeout=60)
    assert r.status_code == 200, r.text
    assert client.server_info().policy_version == f"up-{kind}" and same(outputs(client), fresh_outputs)


def test_http_upload_refuses_a_malformed_digest_two_digests_and_a_torn_body(server, client, new):
    up = server.http_url + "/weights/upload"
    body = save({k: v.contiguous() for k, v in new.items()})
    version = client.server_info().policy_version
    for params, want in (({"xxh3_128": "abc"}, "32 hex digits"),
                         ({"sha256": "0" * 64, "crc32c": "0" * 8}, "give one checksum"),
                         ({}, "not a valid safetensors file")):
        content = body[: len(body) - 100] if not params else body
        r = httpx.post(up, params={"version": "refused", **params}, content=content, headers=auth(), timeout=60)
        assert r.status_code == 400 and want in r.json()["error"]["message"], r.text
    assert client.server_info().policy_version == version


def test_receiver_gathers_tensors_in_one_reused_buffer_and_views_the_ones_inside_a_chunk() -> None:
    rng = np.random.default_rng(0)
    tensors = {"big": torch.from_numpy(rng.standard_normal(3000).astype(np.float32)),
               "small": torch.from_numpy(rng.standard_normal(10).astype(np.float32))}
    raw = {n: t.numpy().tobytes() for n, t in tensors.items()}
    entries = [TensorEntry(n, "float32", tuple(t.shape), len(raw[n]), checksums.digest_of("xxh3_128", raw[n]))
               for n, t in tensors.items()]
    staging = Staging()
    pointers: list[int] = []
    for _ in range(2):
        manifest = Manifest("target", "v", "float32", entries, checksum="xxh3_128")
        seen: dict[str, torch.Tensor] = {}

        def build(ts: Iterator[tuple[str, torch.Tensor]], seen: dict[str, torch.Tensor] = seen) -> int:
            for name, t in ts:
                seen[name] = t.clone()
                if name == "big":
                    pointers.append(t.data_ptr())
            return len(seen)

        receiver: ChunkReceiver[int] = ChunkReceiver(manifest, build, staging=staging)
        stream = raw["big"] + raw["small"]
        cut = 5000  # "big" spans two chunks; "small" lies inside the second
        receiver.feed(0, stream[:cut])
        receiver.feed(cut, stream[cut:])
        assert receiver.finish() == 2
        assert all(torch.equal(seen[n], tensors[n]) for n in tensors)
    assert pointers[0] == pointers[1]  # the second push gathered "big" where the first did: nothing allocated
