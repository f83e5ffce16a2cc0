"""Weight pushes over vLLM's weight-transfer endpoints and a gloo group, real trainer processes
(tests/api/transfer_trainer.py cites what each one runs): TRL's own VLLMClient pushes two checkpoints back to
back (the second into the spare the first left); vLLM's trainer-engine payloads push packed chunks. Afterwards
the server's greedy tokens and logprobs are a fresh engine's on the pushed weights. Wrong shapes or names are
refused before a byte is read; a trainer killed or stalled mid-broadcast leaves the old weights serving, the
group is given up (at its timeout) and the next engine's push lands; wait / abort / keep act as on every push.

The trainers run under the vLLM virtualenv's interpreter (trl and vllm are importable there)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers import default_checkpoint
from probes import metric, wait_for
from safetensors.torch import save_file
from service_utils import (
    ADMIN,
    across,
    assert_same,
    auth,
    checkpoint_tensors,
    fresh,
    perturbed,
    running,
    served,
    start_server,
    trainer_env,
)

from client import AsyncSpecrollClient, Sample, SpecrollClient
from service.app import BackgroundServer

ROOT = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("transfer_trainer.py")
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.skipif(not VENV_PYTHON.exists(), reason="the trainers need trl and vllm: "
                                "bash bench/setup_vllm_venv.sh .venv-vllm")


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return default_checkpoint(tied=False)


@pytest.fixture(scope="module")
def server(base_dir: Path) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir))


def saved(weights: dict[str, torch.Tensor], path: Path) -> str:
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
    return str(path)


def trainer(*args: str, wait: bool = True, stdin: bool = False) -> Any:
    env = trainer_env()
    cmd = [str(VENV_PYTHON), str(TRAINER), *args]
    if wait:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.PIPE if stdin else None)


def lines(out: str) -> list[Any]:
    return [json.loads(line) for line in out.splitlines() if line.startswith(("{", "["))]


def failed_pushes(srv: BackgroundServer) -> float:
    return metric(httpx.get(f"{srv.http_url}/metrics").text, 'specroll:weight_sync_total{result="error",role="target"}')


def serving_module(srv: BackgroundServer) -> object:
    return srv.server.backend._stager.engine.runner.model


def test_trl_client_pushes_back_to_back_into_the_spare(server, base_dir, tmp_path):
    base = checkpoint_tensors(base_dir)
    first, second = perturbed(base, seed=51), perturbed(base, seed=52)
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(base, "before-trl")
        was = serving_module(server)
        run = trainer("trl", server.http_url, saved(first, tmp_path / "a.safetensors"),
                      saved(second, tmp_path / "b.safetensors"))
        assert run.returncode == 0, run.stderr[-3000:]
        assert [r["pushed"] for r in lines(run.stdout)] == [str(tmp_path / "a.safetensors"),
                                                            str(tmp_path / "b.safetensors")]
        # TRL names no version: each push over the engine gets the next one.
        assert c.server_info().policy_version.startswith("weight-transfer-")
        assert_same(served(c), fresh(base_dir, second, tmp_path / "ref"))
        # Two swaps later the module serving before them serves again: each push loaded into the spare.
        assert serving_module(server) is was


def test_vllm_payloads_in_packed_chunks_and_wrong_manifests(server, base_dir, tmp_path):
    base = checkpoint_tensors(base_dir)
    new = perturbed(base, seed=53)
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(base, "before-wrong")
        before = served(c)
        errors = failed_pushes(server)
        run = trainer("wrong", server.http_url, saved(new, tmp_path / "n.safetensors"), "packed-v1", "wait", "60")
        assert run.returncode == 0, run.stderr[-3000:]
        shape, name, pushed = lines(run.stdout)
        for refused, why in ((shape, "wrong shapes"), (name, "unknown tensors")):
            assert refused[0] == {"message": "Weight update started"}, refused
            assert refused[-1]["status"] == 400 and why in refused[-1]["body"], refused
        assert failed_pushes(server) == errors + 2  # discarded, the weights untouched meanwhile
        assert [r.get("message") for r in pushed] == ["Weight update started", "Weights updated",
                                                      "Weight update finished"], pushed
        assert pushed[1]["remaining"] == 0 and pushed[2]["version"] == "packed-v1"
        assert c.server_info().policy_version == "packed-v1"
        got = served(c)
        assert got[0] != before[0]
        assert_same(got, fresh(base_dir, new, tmp_path / "ref"))


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_trainer_lost_mid_broadcast_changes_nothing(server, base_dir, tmp_path, how):
    base = checkpoint_tensors(base_dir)
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        spare = serving_module(server)
        c.push_weights(base, f"before-{how}")
        before = served(c)
        errors = failed_pushes(server)
        proc = trainer(how, server.http_url, saved(perturbed(base, seed=54), tmp_path / "x.safetensors"), "lost",
                       "wait", "3", wait=False)
        try:
            if how == "die":
                assert proc.wait(120) == -9, proc.stderr.read()[-3000:] if proc.stderr else ""
            else:
                assert "stalled_after_chunks" in proc.stdout.readline()  # and it sends nothing more
            # The group fails (its peer is gone) or times out (3 s): the push is discarded.
            wait_for(lambda: failed_pushes(server) > errors, 60, "the lost trainer's push to be given up")
            assert c.server_info().policy_version == f"before-{how}" and served(c) == before
        finally:
            proc.kill()
            proc.wait()
        r = httpx.post(f"{server.http_url}/start_weight_update", headers=auth())
        assert r.status_code == 400 and "no weight transfer engine" in r.text, r.text
        after = perturbed(base, seed=55)
        run = trainer("vllm", server.http_url, saved(after, tmp_path / "y.safetensors"), f"after-{how}", "wait", "60")
        assert run.returncode == 0, run.stderr[-3000:]
        assert c.server_info().policy_version == f"after-{how}"
        assert_same(served(c), fresh(base_dir, after, tmp_path / "ref"))
        assert serving_module(server) is spare  # the lost push's spare, its contents dropped, took the next one


@pytest.mark.parametrize("how", ["longer", "shorter"])
def test_a_chunk_of_another_size_fails_its_call_not_the_server(server, base_dir, tmp_path, how):
    """vLLM's packed chunk with more bytes than announced makes gloo abort the receiving process (the server's
    child), with fewer its end stays unwritten: the update fails with the reason, a stream across the fault
    completes on the old weights, the engine is shut down and the next one's push lands."""
    base = checkpoint_tensors(base_dir)
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(base, f"before-{how}")
        before = served(c)
        errors = failed_pushes(server)
        proc = trainer(how, server.http_url, saved(perturbed(base, seed=57), tmp_path / "w.safetensors"),
                       f"wrong-{how}", "wait", "60", wait=False, stdin=True)

        def fault() -> str:
            out, err = proc.communicate("go\n", timeout=120)
            assert proc.returncode == 0, err[-3000:]
            return out

        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:] if proc.stderr else ""
            out, final = across(server, fault)
        finally:
            proc.kill()
        replies = [r for r in lines(out)[-1] if "broadcast_failed" not in r]
        assert replies[0] == {"message": "Weight update started"} and replies[1]["status"] == 400, replies
        body = json.loads(replies[1]["body"])["error"]["message"]
        assert "the broadcast of version weight-transfer-" in body and "failed, nothing changed" in body, body
        assert ("the receiving process died" in body and "more bytes than the bucket announced" in body
                if how == "longer" else "fewer bytes than the bucket announced" in body), body
        assert failed_pushes(server) == errors + 1
        assert httpx.get(f"{server.http_url}/health").json() == {"status": "ok"}
        assert isinstance(final, Sample) and final.finish_reason == "length" and len(final.token_ids) == 240
        assert [v.policy_version for v in final.version_spans] == [f"before-{how}"]
        assert c.server_info().policy_version == f"before-{how}" and served(c) == before
        r = httpx.post(f"{server.http_url}/start_weight_update", headers=auth())
        assert r.status_code == 400 and "no weight transfer engine" in r.text, r.text
        after = perturbed(base, seed=58)
        run = trainer("vllm", server.http_url, saved(after, tmp_path / "a.safetensors"), f"after-{how}", "wait", "60")
        assert run.returncode == 0, run.stderr[-3000:]
        assert c.server_info().policy_version == f"after-{how}"
        assert_same(served(c), fresh(base_dir, after, tmp_path / "ref"))


STREAM: dict[str, Any] = {"temperature": 1.0, "seed": 3, "max_tokens": 200, "ignore_eos": True}


async def finish_mid_generation(srv: BackgroundServer, mode: str, version: str) -> tuple[dict[str, Any], list[Sample]]:
    """Streams run while the received checkpoint is committed with /finish_weight_update."""
    async with AsyncSpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
        started = [asyncio.Event() for _ in range(4)]

        async def consume(i: int) -> Sample:
            final = None
            async for ev in c.stream([5 + i, 6, 7], request_id=f"{version}-{i}", **STREAM):
                if isinstance(ev, Sample):
                    final = ev
                else:
                    started[i].set()
            assert final is not None
            return final

        tasks = [asyncio.create_task(consume(i)) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        async with httpx.AsyncClient(timeout=120) as h:
            r = await h.post(f"{srv.http_url}/finish_weight_update", json={"weight_version": version}, headers=auth())
        assert r.status_code == 200, r.text
        return r.json(), list(await asyncio.gather(*tasks))


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_modes(server, base_dir, tmp_path, mode):
    base = checkpoint_tensors(base_dir)
    old, new = f"base-{mode}", f"new-{mode}"
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(base, old)
        run = trainer("staged", server.http_url, saved(perturbed(base, seed=56), tmp_path / "m.safetensors"), new,
                      mode, "60")
        assert run.returncode == 0, run.stderr[-3000:]
        assert c.server_info().policy_version == old  # received, not committed: the old weights serve
        result, finals = asyncio.run(finish_mid_generation(server, mode, new))
        assert result["version"] == new and c.server_info().policy_version == new
    for s in finals:
        spans = [(v.policy_version, v.start, v.end) for v in s.version_spans]
        k = len(s.token_ids)
        if mode == "wait":
            assert s.finish_reason == "length" and spans == [(old, 0, 200)]
        elif mode == "abort":
            assert s.finish_reason == "abort" and 1 <= k < 200 and spans == [(old, 0, k)]
        else:
            assert s.finish_reason == "length" and len(spans) == 2 and spans[0][:2] == (old, 0), spans
            assert spans[1] == (new, spans[0][2], 200) and 1 <= spans[0][2] < 200
    if mode == "wait":
        assert result["wait_seconds"] > 0
    if mode == "abort":
        assert sorted(result["aborted"]) == sorted(f"{new}-{i}" for i in range(4))


def test_calls_out_of_order_are_refused(server):
    r = httpx.post(f"{server.http_url}/shutdown_weight_transfer_engine", headers=auth())  # one may be left open
    assert r.status_code == 200, r.text
    for path, body in (("/update_weights", {"update_info": {"names": ["x"], "dtype_names": ["float32"],
                                                             "shapes": [[1]]}}),
                       ("/finish_weight_update", {}), ("/start_weight_update", None)):
        r = httpx.post(f"{server.http_url}{path}", json=body, headers=auth())
        assert r.status_code == 400 and "no weight transfer engine" in r.text, (path, r.text)
    r = httpx.post(f"{server.http_url}/init_weight_transfer_engine",
                   json={"init_info": {"rank_offset": 1, "world_size": 2, "nccl_unique_id_b64": "AAAA"}},
                   headers=auth())
    assert r.status_code == 400 and "nccl_unique_id_b64" in r.text
    r = httpx.post(f"{server.http_url}/init_weight_transfer_engine",
                   json={"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                       "world_size": 2, "surprise": 1}}, headers=auth())
    assert r.status_code == 400 and "surprise" in r.text
    r = httpx.post(f"{server.http_url}/start_weight_update", json={})
    assert r.status_code == 401
