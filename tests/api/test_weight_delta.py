"""Delta weight pushes against real servers: only what changed, applied to a copy of the serving weights.

A delta push must leave the server bitwise where a full push of the same checkpoint does (tensors, greedy tokens
and logprobs against a fresh server on that checkpoint); one against a version that is not served, or with
sparse indices or values that cannot apply, is refused with nothing changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from helpers import default_checkpoint
from safetensors.torch import save
from service_utils import ADMIN, auth, checkpoint_tensors, running, start_server, write_checkpoint

from client import FailedPrecondition, SpecrollClient
from client import weights as wt
from service.app import BackgroundServer
from service.backend.base import SparseValues
from service.backend.weight_check import sparse_problem
from service.models.loader import hf_state_dict
from service.protogen import pb2

PROMPTS = [[5, 9, 11, 3], [7, 7, 2], [100, 200, 300, 400, 17]]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "raw_logprobs": True}
EAGER = {"enforce_eager": True}  # one kernel per shape: equal weights give equal bits (compiled ones may differ)


def stepped(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A training step's worth of change: a third of the tensors kept, a third with 2% of their elements moved
    (sparse), a third moved everywhere (dense)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if i % 3 == 0:
            out[name] = t.clone()
            continue
        noise = torch.randn(t.shape, generator=gen) * max(float(t.float().std()), 1e-2) * 0.5
        if i % 3 == 1:
            noise *= (torch.rand(t.shape, generator=gen) < 0.02).to(noise.dtype)
        out[name] = (t.float() + noise).to(t.dtype)
    return out


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return default_checkpoint(tied=False)


@pytest.fixture(scope="module")
def steps(base_dir: Path) -> list[dict[str, torch.Tensor]]:
    """The base checkpoint and two steps after it."""
    base = checkpoint_tensors(base_dir)
    one = stepped(base, 1)
    return [base, one, stepped(one, 2)]


@pytest.fixture(scope="module")
def server(base_dir: Path) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir, engine_kw=EAGER))


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[SpecrollClient]:
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        yield c


def served(server: BackgroundServer) -> dict[str, torch.Tensor]:
    return hf_state_dict(server.server.backend.teacher_snapshot().result(30).module)


def outputs(c: SpecrollClient) -> list[tuple[list[int], list[float], list[float]]]:
    out = []
    for prompt in PROMPTS:  # one at a time: a batch's row order would change the kernels' summation order
        [comp] = c.generate([prompt], **GREEDY)
        s = comp.samples[0]
        out.append((s.token_ids, s.logprobs, s.raw_logprobs))
    return out


def assert_serves(server: BackgroundServer, tensors: dict[str, torch.Tensor]) -> None:
    got = served(server)
    unequal = [n for n, t in tensors.items() if not torch.equal(got[n], t.float())]
    assert not unequal, f"served tensors differ from the checkpoint: {unequal[:5]}"


def test_delta_pushes_serve_what_full_pushes_do(server, client, steps, base_dir, tmp_path):
    base, one, two = steps
    pushed = wt.PushedState()
    pushed.record(base, "0")  # the server started on the base checkpoint: version 0
    full_bytes = sum(t.numel() * t.element_size() for t in one.values())
    plan = list(wt.plan_delta(base, one))
    assert {s is None for _, _, s in plan} == {True, False}  # dense and sparse tensors both
    r1 = client.push_weights(one, "d1", mode="keep", delta_from=pushed)
    assert r1.version == "d1" and 0 < r1.bytes < 0.8 * full_bytes  # only the changed part travelled
    assert_serves(server, one)
    r2 = client.push_weights(two, "d2", mode="keep", delta_from=pushed)  # into the reused spare
    assert r2.version == "d2" and r2.bytes < 0.8 * full_bytes and pushed.version == "d2"
    assert_serves(server, two)
    r3 = client.push_weights(two, "d3", mode="keep", delta_from=pushed)  # nothing changed: a new version only
    assert (r3.version, r3.bytes) == ("d3", 0) and client.server_info().policy_version == "d3"
    assert_serves(server, two)
    got = outputs(client)
    client.push_weights(two, "f2", mode="keep")  # the same checkpoint in full, on the same server
    assert outputs(client) == got  # greedy tokens and logprobs, bitwise
    fresh = start_server(write_checkpoint(base_dir, two, tmp_path / "two"), engine_kw=EAGER)
    try:
        with SpecrollClient(fresh.grpc_target, admin_token=ADMIN) as c:
            assert outputs(c) == got  # a fresh server on the checkpoint: bitwise too
    finally:
        fresh.stop()


def test_a_delta_against_another_version_is_refused(server, client, steps):
    base, one, two = steps
    client.push_weights(one, "r1", mode="keep")
    before = outputs(client)
    with pytest.raises(FailedPrecondition, match=r"applies to version 'old'.*serves 'r1'"):
        client.push_delta(two, "r2", base=base, base_version="old", mode="keep")
    assert client.server_info().policy_version == "r1"
    assert outputs(client) == before
    assert_serves(server, one)
    pushed = wt.PushedState()
    pushed.record(base, "old")  # a stale record: the client falls back to a full push
    assert client.push_weights(two, "r3", mode="keep", delta_from=pushed).version == "r3"
    assert_serves(server, two)


# -- refused sparse deltas, on the wire ----------------------------------------------------------------------
NAME = "model.layers.0.self_attn.q_proj.weight"


def sparse_push(version: str, base_version: str, index: torch.Tensor, values: torch.Tensor,
                encoding: str = "sparse") -> list[Any]:
    blob = torch.cat([index.view(torch.uint8), values.view(torch.uint8)])
    tb = [wt.TensorBytes(NAME, "float32", (64, 64), memoryview(blob.numpy()).cast("B"), owner=blob,
                         encoding=encoding)]
    wt.hash_all(tb)
    manifest = wt.manifest(tb, "target", version, "keep", base_version=base_version)
    return [pb2.PushWeightsRequest(manifest=manifest),
            pb2.PushWeightsRequest(chunk=pb2.WeightChunk(offset=0, data=bytes(blob.numpy())))]


def raw_push(target: str, messages: list[Any]) -> Any:
    with grpc.insecure_channel(target) as ch:
        call = ch.stream_unary("/specroll.v1.Rollout/PushWeights", request_serializer=wt.serialize_push,
                               response_deserializer=pb2.WeightsReply.FromString)
        return call(iter(messages), metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=60)


BAD_SPARSE = [
    ("past the end", [3, 4096], [0.5, 0.5], "outside the tensor's 4096 elements"),
    ("negative", [-1, 7], [0.5, 0.5], "outside the tensor's 4096 elements"),
    ("twice", [3, 3], [0.5, 0.5], "appears twice"),
    ("unsorted", [9, 3], [0.5, 0.5], "not in increasing order"),
    ("nan", [3, 9], [0.5, float("nan")], "NaN or infinite"),
    ("inf", [3, 9], [float("inf"), 0.5], "NaN or infinite"),
]


def test_bad_sparse_deltas_are_refused_and_change_nothing(server, client, steps):
    base = steps[0]
    client.push_weights(base, "s0", mode="keep")
    before = outputs(client)
    for label, index, values, needle in BAD_SPARSE:
        msgs = sparse_push(f"bad-{label.replace(' ', '-')}", "s0", torch.tensor(index, dtype=torch.int32),
                           torch.tensor(values, dtype=torch.float32))
        with pytest.raises(grpc.RpcError) as err:
            raw_push(server.grpc_target, msgs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (label, err.value.details())
        assert needle in err.value.details(), (label, err.value.details())
    ok = sparse_push("s1", "s0", torch.tensor([3, 4095], dtype=torch.int32), torch.tensor([0.25, -0.5]))
    assert raw_push(server.grpc_target, ok).version == "s1"  # the same push, well formed, applies
    q = served(server)[NAME].reshape(-1)
    assert (float(q[3]), float(q[4095])) == (0.25, -0.5)
    client.push_weights(base, "s2", mode="keep")
    with pytest.raises(grpc.RpcError) as err:  # sparse without a base version
        raw_push(server.grpc_target, sparse_push("s3", "", torch.tensor([3], dtype=torch.int32), torch.ones(1)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "only a delta push" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # stale base, well formed
        raw_push(server.grpc_target, sparse_push("s3", "s0", torch.tensor([3], dtype=torch.int32), torch.ones(1)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert client.server_info().policy_version == "s2"
    assert outputs(client) == before
    assert_serves(server, base)


def test_sparse_problems_name_the_fault() -> None:
    def problem(index: list[int], dtype: torch.dtype = torch.int64, nvalues: int | None = None) -> str:
        n = len(index) if nvalues is None else nvalues
        return sparse_problem(SparseValues((4, 4), torch.tensor(index, dtype=dtype), torch.zeros(n)))

    assert problem([0, 5, 15]) == "" and problem([]) == ""
    assert "outside" in problem([0, 16]) and "outside" in problem([-2, 3])
    assert "twice" in problem([1, 1]) and "increasing" in problem([2, 1])
    assert "not int32 or int64" in problem([1], torch.int16)
    assert "as long as each other" in problem([1, 2], nvalues=3)


# -- HTTP ---------------------------------------------------------------------------------------------------
def test_http_delta_uploads(server, client, steps):
    base, one, _ = steps
    client.push_weights(base, "h0", mode="keep")
    up = server.http_url + "/weights/upload"
    body = save(wt.delta_state_dict(base, one))
    assert len(body) < 0.8 * len(save(one))
    r = httpx.post(up, params={"version": "h1", "base_version": "nope", "mode": "keep"}, content=body,
                   headers=auth(), timeout=60)
    assert r.status_code == 409 and "serves 'h0'" in r.json()["error"]["message"], r.text
    bad = wt.delta_state_dict(base, one)
    key = next(k for k in bad if k.endswith(":indices"))
    bad[key] = bad[key].flip(0).contiguous()
    r = httpx.post(up, params={"version": "h1", "base_version": "h0"}, content=save(bad), headers=auth(),
                   timeout=60)
    assert r.status_code == 400 and "not in increasing order" in r.text, r.text
    lone = {key: bad[key]}
    r = httpx.post(up, params={"version": "h1", "base_version": "h0"}, content=save(lone), headers=auth())
    assert r.status_code == 400 and "a sparse delta sends both" in r.text, r.text
    assert client.server_info().policy_version == "h0"
    assert_serves(server, base)
    r = httpx.post(up, params={"version": "h1", "base_version": "h0", "mode": "keep"}, content=body,
                   headers=auth(), timeout=60)
    assert r.status_code == 200 and r.json()["version"] == "h1", r.text
    assert_serves(server, one)


def test_the_client_sends_what_changed_bit_for_bit() -> None:
    old = {"same": torch.ones(8, 8, dtype=torch.bfloat16), "few": torch.zeros(64, dtype=torch.bfloat16),
           "many": torch.zeros(64, dtype=torch.bfloat16), "new": torch.zeros(2)}
    new = {k: v.clone() for k, v in old.items()}
    new["few"][[3, 40]] = torch.tensor([1.0, -0.0], dtype=torch.bfloat16)  # -0.0 == 0.0, but its bits differ
    new["many"][::5] = 2.0  # 13 of 64: sparse would take 6 * 13 = 78 bytes of 128, more than half
    plan = {name: sparse for name, _, sparse in wt.plan_delta({k: v for k, v in old.items() if k != "new"}, new)}
    assert set(plan) == {"few", "many", "new"} and plan["many"] is None and plan["new"] is None
    index, values = plan["few"]
    assert index.dtype == torch.int32 and index.tolist() == [3, 40]
    assert values.view(torch.int16).tolist() == torch.tensor([1.0, -0.0], dtype=torch.bfloat16).view(
        torch.int16).tolist()
    [few] = [t for t in wt.delta(old, new) if t.name == "few"]
    assert few.encoding == "sparse" and bytes(few.data) == bytes(index.view(torch.uint8).numpy()) + bytes(
        values.view(torch.uint8).numpy())
