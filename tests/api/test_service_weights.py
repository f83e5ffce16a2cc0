"""Hot weight pushes against a real server: modes mid-generation, refused pushes, uploads and folder loads."""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from helpers import default_checkpoint
from safetensors.torch import save
from service_utils import (
    ADMIN,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    auth,
    checkpoint_tensors,
    engine_config,
    perturbed,
    running,
    start_server,
    write_checkpoint,
)

from client import AsyncSpecrollClient, Sample, SpecrollClient, checksums
from client import weights as wt
from client.errors import SpecrollError
from service.app import BackgroundServer
from service.engine.llm_engine import LLMEngine
from service.models.llama import causal_meta
from service.models.loader import load_model
from service.models.rope import Rope
from service.params import SamplingParams
from service.protogen import pb2

N_STREAMS = 32
PARAMS: dict[str, Any] = {"temperature": 1.0, "top_p": 0.95, "seed": 77, "max_tokens": 160, "ignore_eos": True,
                          "raw_logprobs": True}
PROBE = [9, 8, 7, 6]
PROBE_PARAMS: dict[str, Any] = {"temperature": 0.9, "seed": 5, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return default_checkpoint(tied=False)


@pytest.fixture(scope="module")
def base(base_dir) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(base_dir)


@pytest.fixture(scope="module")
def new(base) -> dict[str, torch.Tensor]:
    return perturbed(base, seed=1)


@pytest.fixture(scope="module")
def new_dir(base_dir, new, tmp_path_factory) -> Path:
    return write_checkpoint(base_dir, new, tmp_path_factory.mktemp("pushed") / "new")


@pytest.fixture(scope="module")
def server(base_dir) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir))


@pytest.fixture(scope="module")
def client(server) -> Iterator[SpecrollClient]:
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        yield c


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 512, (int(k),), generator=g).tolist() for k in torch.randint(2, 20, (N_STREAMS,),
                                                                                           generator=g)]


def reference(model_dir: Path, ps: list[list[int]], params: dict[str, Any]) -> list[list[int]]:
    engine = LLMEngine(engine_config(model_dir))
    return [o.outputs[0].token_ids for o in engine.generate(ps, SamplingParams(**params))]


@pytest.fixture(scope="module")
def ref_old(base_dir) -> list[list[int]]:
    return reference(base_dir, prompts(), PARAMS)


@pytest.fixture(scope="module")
def ref_new(new_dir) -> list[list[int]]:
    return reference(new_dir, prompts()[:4], PARAMS)


async def push_mid_generation(target: str, base: dict, new: dict, mode: str) -> tuple[Any, list[Sample], list]:
    async with AsyncSpecrollClient(target, admin_token=ADMIN) as c:
        await c.push_weights(base, f"base-{mode}", mode="keep")
        started = [asyncio.Event() for _ in range(N_STREAMS)]

        async def consume(i: int, prompt: list[int]) -> Sample:
            final = None
            async for ev in c.stream(prompt, request_id=f"{mode}-{i}", **PARAMS):
                if isinstance(ev, Sample):
                    final = ev
                else:
                    started[i].set()
            assert final is not None
            return final

        tasks = [asyncio.create_task(consume(i, p)) for i, p in enumerate(prompts())]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        result = await c.push_weights(new, f"new-{mode}", mode=mode)
        finals = await asyncio.gather(*tasks)
        later = await c.generate(prompts()[:4], **PARAMS)
        return result, list(finals), later


@functools.cache
def _model(model_dir: Path) -> tuple[Any, Rope]:
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    return model, Rope(model.config, 512, torch.device("cpu"), torch.float32)


def raw_logprobs_under(model_dir: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of the raw logits at each output token under the weights in `model_dir` ([len(tokens)])."""
    model, rope = _model(model_dir)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        hidden = model(ids[:, :-1], causal_meta(rope.cos, rope.sin, 1, ids.shape[1] - 1), None, None)
        logp = torch.log_softmax(model.logits(hidden)[0, len(prompt) - 1 :].float(), dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def produced_by(s: Sample, prompt: list[int], spans: list[tuple[Path, int, int]]) -> float:
    """Largest |server raw logprob - recompute| over the sample, recomputing each span under its weights."""
    got = torch.tensor(s.raw_logprobs)
    assert len(got) == len(s.token_ids)
    worst = 0.0
    for model_dir, a, b in spans:
        want = raw_logprobs_under(model_dir, prompt, s.token_ids)[a:b]
        worst = max(worst, float((got[a:b] - want).abs().max()))
    return worst


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_push_while_32_requests_stream(server, client, base, new, base_dir, new_dir, ref_old, ref_new, mode):
    result, finals, later = asyncio.run(push_mid_generation(server.grpc_target, base, new, mode))
    old_v, new_v = f"base-{mode}", f"new-{mode}"
    assert result.version == new_v and client.server_info().policy_version == new_v
    # Which weights produced every token is checked by recomputing its raw logprob under each version (the
    # versions differ by far more than 1e-3 per token), not by comparing sampled tokens to a reference run:
    # seeded sampling is not bitwise reproducible across different batch compositions.
    ps = prompts()
    matches = 0
    for s, want, prompt in zip(finals, ref_old, ps, strict=True):
        spans = [(v.policy_version, v.start, v.end) for v in s.version_spans]
        k = len(s.token_ids)
        old_end = spans[0][2]  # tokens made by the old weights
        matches += s.token_ids[:old_end] == want[:old_end]
        if mode == "wait":
            assert s.finish_reason == "length" and spans == [(old_v, 0, 160)]
            assert produced_by(s, prompt, [(base_dir, 0, k)]) < 1e-3 < produced_by(s, prompt, [(new_dir, 0, k)])
        elif mode == "abort":
            assert s.finish_reason == "abort" and 1 <= k < 160 and spans == [(old_v, 0, k)]
            assert produced_by(s, prompt, [(base_dir, 0, k)]) < 1e-3
        else:
            assert s.finish_reason == "length" and len(spans) == 2, spans
            (v0, a0, v1, b1) = (spans[0][0], spans[0][1], spans[1][0], spans[1][2])
            b0 = spans[0][2]
            assert (v0, a0, v1, b1) == (old_v, 0, new_v, 160) and b0 == spans[1][1] and 1 <= b0 < 160
            assert produced_by(s, prompt, [(base_dir, 0, b0)]) < 1e-3
            # The tail came from the new weights (over the prefix's old-weight KV, which `keep` keeps).
            assert produced_by(s, prompt, [(base_dir, b0, k)]) > 1e-2
    assert matches >= N_STREAMS - 2  # and the samples are the reference's (a rare numerical flip aside)
    if mode == "wait":
        assert result.wait_seconds > 0
    if mode == "abort":
        assert sorted(result.aborted) == sorted(f"abort-{i}" for i in range(N_STREAMS))
    assert sum(c.samples[0].token_ids == want for c, want in zip(later, ref_new, strict=False)) >= len(later) - 1
    assert all(c.samples[0].version_spans[0].policy_version == new_v for c in later)


# -- refused pushes -----------------------------------------------------------------------------------
def raw_push(target: str, messages: list[Any], token: str | None = ADMIN) -> Any:
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 16 * 2**20)]) as ch:
        call = ch.stream_unary("/specroll.v1.Rollout/PushWeights", request_serializer=wt.serialize_push,
                               response_deserializer=pb2.WeightsReply.FromString)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        return call(iter(messages), metadata=metadata, timeout=60)


def push_messages(tensors: dict[str, torch.Tensor], version: str, edit: Any = None) -> list[Any]:
    tb = wt.from_state_dict(tensors)
    wt.hash_all(tb)
    manifest = wt.manifest(tb, "target", version, "keep")
    chunks = [pb2.PushWeightsRequest(chunk=pb2.WeightChunk(offset=c.offset, data=b"".join(c.parts)))
              for c in wt.iter_chunks(tb, 64 * 1024)]
    msgs = [pb2.PushWeightsRequest(manifest=manifest), *chunks]
    if edit is not None:
        edit(msgs[0].manifest, msgs)  # the request holds a copy of the manifest
    return msgs


def _corrupt_chunk(m, msgs):
    data = bytearray(msgs[3].chunk.data)
    data[100] ^= 0xFF
    msgs[3].chunk.data = bytes(data)


def _wrong_shape(m, msgs):
    t = next(t for t in m.tensors if t.name == "model.layers.0.mlp.up_proj.weight")
    t.shape[:] = [t.shape[1], t.shape[0]]


def _wrong_dtype(m, msgs):
    m.tensors[2].dtype = "float16"


def _int_dtype(m, msgs):
    m.dtype = "int64"
    for t in m.tensors:
        t.dtype = "int64"


def _unknown(m, msgs):
    m.tensors.add(name="model.layers.0.self_attn.rotary.weight", dtype="float32", shape=[1], nbytes=4,
                  digest=checksums.digest_of(m.checksum, b"\0" * 4))
    msgs.append(pb2.PushWeightsRequest(chunk=pb2.WeightChunk(offset=sum(len(x.chunk.data) for x in msgs[1:]),
                                                             data=b"\0" * 4)))


def _missing(m, msgs):
    del m.tensors[-1]


def _bad_checksum(m, msgs):
    m.tensors[0].digest = "0" * 32


def _truncated(m, msgs):
    del msgs[len(msgs) // 2 :]


def _big_chunk(m, msgs):
    msgs[1:] = [pb2.PushWeightsRequest(chunk=pb2.WeightChunk(offset=0, data=b"\0" * (5 * 2**20)))]


def _reordered(m, msgs):
    msgs[1], msgs[2] = msgs[2], msgs[1]


def _no_manifest(m, msgs):
    del msgs[0]


BAD_PUSHES = [
    (_corrupt_chunk, "checksum mismatch for tensor"), (_wrong_shape, "wrong shapes"),
    (_wrong_dtype, "has dtype float16, but the manifest declares float32"), (_int_dtype, "cannot be cast"),
    (_unknown, "unknown tensors"), (_missing, "missing tensors"), (_bad_checksum, "checksum mismatch"),
    (_truncated, "push ended after"), (_big_chunk, "at most 4194304"), (_reordered, "in order"),
    (_no_manifest, "first message of a push must be its manifest"),
]


def probe(c: SpecrollClient) -> list[int]:
    [comp] = c.generate([PROBE], **PROBE_PARAMS)
    return comp.samples[0].token_ids


def test_bad_pushes_are_refused_and_change_nothing(server, client, base, new):
    client.push_weights(base, "good", mode="keep")
    before = probe(client)
    for edit, needle in BAD_PUSHES:
        with pytest.raises(grpc.RpcError) as err:
            raw_push(server.grpc_target, push_messages(new, f"bad-{edit.__name__}", edit))
            pytest.fail(f"{edit.__name__} was accepted")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (edit.__name__, err.value.details())
        assert needle in err.value.details(), (edit.__name__, err.value.details())
    for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), ("nope", grpc.StatusCode.UNAUTHENTICATED)):
        with pytest.raises(grpc.RpcError) as err:
            raw_push(server.grpc_target, push_messages(new, "no-token"), token=token)
        assert err.value.code() == code
    assert client.server_info().policy_version == "good"
    assert probe(client) == before
    metrics = httpx.get(server.http_url + "/metrics").text
    assert 'specroll:weight_sync_total{result="error",role="target"}' in metrics


def test_a_refused_push_reports_the_servers_status_every_time(server, client, base):
    """The server refuses these pushes while the client is still sending small chunks. grpc's asyncio client,
    which the client used for pushes before, reported INTERNAL in ~2% of them (grpc#36066): 300 tries."""
    name = next(n for n in base if n.endswith("mlp.up_proj.weight"))
    wrong = {**base, name: base[name][:, :-1].contiguous()}
    outcomes: dict[str, int] = {}
    with SpecrollClient(server.grpc_target) as anon:
        for i in range(150):
            for who, tensors in ((anon, base), (client, wrong)):
                try:
                    who.push_weights(tensors, f"refused-{i}", chunk_bytes=4096)
                    kind = "accepted"
                except SpecrollError as exc:
                    kind = type(exc).__name__
                outcomes[kind] = outcomes.get(kind, 0) + 1
    assert outcomes == {"Unauthenticated": 150, "InvalidArgument": 150}


def test_cancelled_push_changes_nothing(server, client, base, new):
    client.push_weights(base, "good-2", mode="keep")
    before = probe(client)

    async def cancel_midway() -> None:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            push = channel.stream_unary("/specroll.v1.Rollout/PushWeights", request_serializer=wt.serialize_push,
                                        response_deserializer=pb2.WeightsReply.FromString)
            msgs = push_messages(new, "cancelled")

            async def slow():
                for i, m in enumerate(msgs):
                    if i == len(msgs) // 2:
                        await asyncio.sleep(10)
                    yield m

            call = push(slow(), metadata=tuple(auth().items()))
            await asyncio.sleep(0.5)
            call.cancel()

    asyncio.run(cancel_midway())
    assert client.server_info().policy_version == "good-2" and probe(client) == before
    client.push_weights(new, "after-cancel", mode="keep")  # the role lock was released
    assert client.server_info().policy_version == "after-cancel"


def test_a_push_its_caller_cancels_is_cancelled_on_the_server(server, client, base, new):
    """A push in `wait` mode is held while a rollout runs; cancelling the task that awaits it must end the RPC on
    the server (no swap once the rollout finishes; the role lock free for the next push)."""
    client.push_weights(base, "before-cancel", mode="keep")

    async def cancel_while_held() -> bool:
        async with AsyncSpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
            running = asyncio.Event()

            async def rollout() -> None:
                async for _ in c.stream(PROBE, n=MAX_NUM_SEQS, max_tokens=MAX_MODEL_LEN - len(PROBE),
                                        temperature=1.0, ignore_eos=True):
                    running.set()

            task = asyncio.create_task(rollout())
            await asyncio.wait_for(running.wait(), 60)
            push = asyncio.create_task(c.push_weights(new, "cancelled-while-held", mode="wait"))
            await asyncio.sleep(0.2)
            held = not push.done()
            push.cancel()
            await asyncio.gather(push, return_exceptions=True)
            await task
            return held

    for _ in range(5):  # the rollout can end before the push is cancelled on a fast machine: then try again
        if asyncio.run(cancel_while_held()):
            break
    else:
        pytest.skip("the rollout always ended within 0.2 s of the push")
    assert client.server_info().policy_version == "before-cancel"
    assert client.push_weights(base, "after-held-cancel", mode="wait").version == "after-held-cancel"


# -- uploads and folder loads -------------------------------------------------------------------------
def test_http_upload_and_folder_loads(server, client, base, new, new_dir, ref_new):
    url = server.http_url
    body = save({k: v.contiguous() for k, v in new.items()})
    up = url + "/weights/upload"
    assert httpx.post(up, params={"version": "u1"}, content=body).status_code == 401
    r = httpx.post(up, params={"version": "u1"}, content=b"not safetensors", headers=auth())
    assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
    r = httpx.post(up, params={"version": "u1", "sha256": "0" * 64}, content=body, headers=auth())
    assert r.status_code == 400 and "checksum mismatch" in r.text
    r = httpx.post(up, params={"version": "u1", "dtype": "bfloat16"}, content=body, headers=auth())
    assert r.status_code == 400 and "declares bfloat16" in r.text
    partial = save({k: v.contiguous() for k, v in list(new.items())[:-1]})
    r = httpx.post(up, params={"version": "u1"}, content=partial, headers=auth())
    assert r.status_code == 400 and "missing tensors" in r.text
    r = httpx.post(up, params={"version": "u1", "sha256": hashlib.sha256(body).hexdigest(), "mode": "keep"},
                   content=body, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == "u1" and httpx.get(url + "/weights/version").json()["policy_version"] == "u1"
    [comp] = client.generate([prompts()[0]], **PARAMS)
    assert comp.samples[0].token_ids == ref_new[0]

    client.push_weights(base, "b", mode="keep")
    r = httpx.post(url + "/weights/load", json={"path": str(new_dir), "version": "disk-1"}, headers=auth())
    assert r.status_code == 200 and r.json()["version"] == "disk-1", r.text
    assert client.generate([prompts()[0]], **PARAMS)[0].samples[0].token_ids == ref_new[0]
    r = httpx.post(url + "/weights/load", json={"path": "/no/such/dir", "version": "x"}, headers=auth())
    assert r.status_code == 400 and "no such folder" in r.text
    res = client.load_weights(str(new_dir), "disk-2")
    assert res.version == "disk-2" and res.bytes > 0
    res = client.push_weights(new_dir, "folder-push", mode="keep")  # memory-mapped safetensors folder
    assert res.version == "folder-push" and client.server_info().policy_version == "folder-push"
    metrics = httpx.get(url + "/metrics").text
    assert 'specroll:weight_version{role="target",version="folder-push"} 1.0' in metrics
    assert 'specroll:weight_sync_bytes_total{role="target"}' in metrics
