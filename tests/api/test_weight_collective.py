"""Weight pushes over a gloo process group (SGLang's /init_weights_update_group protocol), real processes: a
trainer speaking slime's payloads and order (tests/api/group_trainer.py cites the file and commit) and one using
our client push checkpoints; afterwards the server's greedy tokens and logprobs are a fresh engine's on the pushed
weights. A wrong shape is refused before anything is broadcast; a trainer killed mid-broadcast leaves the old
weights serving and the next group's push lands. A broadcast of more or fewer bytes than its bucket announced fails
that call and nothing else: generation runs on across it on the old weights, and the next group's push lands."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import default_checkpoint
from safetensors.torch import save_file
from service_utils import (
    ADMIN,
    GROUP_TRAINER,
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
    trainer_env,
)

from client import Sample, SpecrollClient
from service.app import BackgroundServer


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return default_checkpoint(tied=False)


@pytest.fixture(scope="module")
def server(base_dir: Path) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir))


def test_slime_and_client_trainers_push_over_gloo(server, base_dir, tmp_path):
    base = checkpoint_tensors(base_dir)
    first, second = perturbed(base, seed=41), perturbed(base, seed=42)
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        before = served(c)
        run = group_trainer("slime", server, first, "slime-v1", tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        replies = json.loads(run.stdout.strip().splitlines()[-1])
        assert [r.get("success") for r in replies] == [True] * 4, replies  # init, two buckets, destroy
        assert replies[1]["remaining"] > 0 and replies[2]["version"] == "slime-v1"
        assert c.server_info().policy_version == "slime-v1"
        got = served(c)
        assert got[0] != before[0]
        assert_same(got, fresh(base_dir, first, tmp_path / "ref1"))

        run = group_trainer("client-wrong", server, second, "client-v2", tmp_path, group="ours")
        assert run.returncode == 0, run.stderr[-3000:]
        refused, reply = (json.loads(line) for line in run.stdout.strip().splitlines()[-2:])
        assert "wrong shapes" in refused["refused"] and "HTTP 400" in refused["refused"]
        assert reply["version"] == "client-v2"  # the refusal broadcast nothing: the same group pushes next
        assert c.server_info().policy_version == "client-v2"
        assert_same(served(c), fresh(base_dir, second, tmp_path / "ref2"))


def test_a_trainer_killed_mid_broadcast_changes_nothing(server, base_dir, tmp_path):
    base = checkpoint_tensors(base_dir)
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(base, "before-kill")
        before = served(c)
        run = group_trainer("die", server, perturbed(base, seed=43), "killed", tmp_path, group="dies")
        assert run.returncode == -9, run.stderr[-3000:]
        assert c.server_info().policy_version == "before-kill" and served(c) == before
        for _ in range(100):  # the server closes the dead group as soon as its broadcast fails
            r = httpx.post(f"{server.http_url}/destroy_weights_update_group", json={"group_name": "dies"},
                           headers=auth())
            if r.status_code == 400 and "no weight update group" in r.text:
                break
        else:
            pytest.fail(f"the dead trainer's group is still open: {r.text}")
        after = perturbed(base, seed=44)
        run = group_trainer("slime", server, after, "after-kill", tmp_path, group="dies")  # same name, new group
        assert run.returncode == 0, run.stderr[-3000:]
        assert c.server_info().policy_version == "after-kill"
        assert_same(served(c), fresh(base_dir, after, tmp_path / "ref"))


def closed(srv: BackgroundServer, group: str) -> bool:
    r = httpx.post(f"{srv.http_url}/destroy_weights_update_group", json={"group_name": group}, headers=auth())
    return r.status_code == 400 and "no weight update group" in r.text


@pytest.mark.parametrize("how", ["longer", "shorter"])
def test_a_broadcast_of_another_size_fails_its_call_not_the_server(server, base_dir, tmp_path, how):
    """More bytes than announced make gloo abort the receiving process (the server's child, not the server); fewer
    leave the end of the tensor unwritten, which the receiver notices. Either way the call fails with the reason,
    a stream running across the fault completes on the old weights, and the next group's push lands."""
    base = checkpoint_tensors(base_dir)
    path = tmp_path / "wrong.safetensors"
    save_file({k: v.contiguous() for k, v in perturbed(base, seed=45).items()}, str(path))
    env = trainer_env()
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(base, f"before-{how}")
        before = served(c)
        argv = [sys.executable, str(GROUP_TRAINER), how, server.http_url, str(path), f"wrong-{how}", how]
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

        def fault() -> str:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            return out

        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:] if proc.stderr else ""
            out, final = across(server, fault)
        finally:
            proc.kill()
        replies = json.loads(out.strip().splitlines()[-1])
        init, first, failed = (r for r in replies if "broadcast_failed" not in r)
        assert init["success"] and first["remaining"] > 0, replies
        assert failed["status"] == 400, replies
        body = json.loads(failed["body"])["error"]["message"]
        assert f"the broadcast of version wrong-{how} failed, nothing changed" in body, body
        assert ("the receiving process died" in body and "more bytes than the bucket announced" in body
                if how == "longer" else "fewer bytes than the bucket announced" in body), body
        assert httpx.get(f"{server.http_url}/health").json() == {"status": "ok"}
        assert isinstance(final, Sample) and final.finish_reason == "length" and len(final.token_ids) == 240
        assert [v.policy_version for v in final.version_spans] == [f"before-{how}"]
        assert c.server_info().policy_version == f"before-{how}" and served(c) == before
        assert closed(server, how)
        after = perturbed(base, seed=46)
        run = group_trainer("slime", server, after, f"after-{how}", tmp_path, group=how)  # same name, new group
        assert run.returncode == 0, run.stderr[-3000:]
        assert c.server_info().policy_version == f"after-{how}"
        assert_same(served(c), fresh(base_dir, after, tmp_path / "ref"))
