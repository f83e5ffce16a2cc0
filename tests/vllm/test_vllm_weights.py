"""Weight pushes on the vLLM backend: the same protocol and modes as on the native backend, validated before vLLM
is touched, version spans on every token and in the rollout records; refused pushes leave the old weights
serving and the engine alive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from safetensors.torch import save_file
from service_utils import ADMIN, checkpoint_tensors, perturbed, write_checkpoint
from vllm_utils import MAX_LEN, check_cut_at_push, hf_greedy, hf_of, start_vllm

from client import SpecrollClient
from client.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unauthenticated

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 4, 5]]


@pytest.fixture(scope="module")
def server(vllm_model):
    srv = start_vllm(vllm_model)
    records: list = []
    srv.server.hooks.on_rollout_finished.append(records.append)
    yield srv, records
    srv.stop()


def greedy(c: SpecrollClient, n: int = 10) -> list[list[int]]:
    return [d.samples[0].token_ids for d in c.generate(PROMPTS, max_tokens=n, temperature=0.0, ignore_eos=True)]


@pytest.mark.parametrize("path", ["grpc", "memfd"])
def test_push_switches_outputs_and_versions(server, vllm_model, tmp_path, path):
    """Over gRPC chunks, and through a sealed memfd on the same host (checked and read like a folder)."""
    if path == "memfd" and not hasattr(os, "memfd_create"):
        pytest.skip("memfd is Linux only")
    srv, records = server
    base = checkpoint_tensors(vllm_model)
    new = perturbed(base, seed=1)
    with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
        before = greedy(c)
        res = c.push_weights(new, "v1") if path == "grpc" else c.push_weights_memfd(new, "v1")
        assert res.version == "v1" and c.server_info().policy_version == "v1"
        after = greedy(c)
        assert after != before
        ref = hf_of(write_checkpoint(vllm_model, new, tmp_path / "v1"))
        assert after == [hf_greedy(ref, p, 10) for p in PROMPTS]
        last = c.generate_one(PROMPTS[0], max_tokens=4, temperature=1.0, ignore_eos=True).samples[0]
        assert [(v.policy_version, v.start, v.end) for v in last.version_spans] == [("v1", 0, 4)]
        assert records and records[-1].version_spans[-1].policy_version == "v1"
        c.push_weights(base, "v2")  # back to the original weights for the other tests
        assert greedy(c) == before



def test_refused_pushes_leave_the_old_weights_serving(server, vllm_model):
    srv, _ = server
    base = checkpoint_tensors(vllm_model)
    with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
        before, version = greedy(c), c.server_info().policy_version
        wrong = dict(base)
        name = next(n for n in base if n.endswith("mlp.up_proj.weight"))
        wrong[name] = base[name][:, :-1].contiguous()
        with pytest.raises(InvalidArgument, match="wrong shapes"):
            c.push_weights(wrong, "bad1")
        with pytest.raises(InvalidArgument, match="missing tensors"):
            c.push_weights({k: v for k, v in base.items() if k != name}, "bad2")
        with pytest.raises(FailedPrecondition, match="no weights"):
            c.push_weights(base, "bad3", role="drafter")
        with pytest.raises(FailedPrecondition, match="full pushes only"):  # deltas: the native backend only
            c.push_delta(perturbed(base, seed=2), "bad5", base=base, base_version=version)
        assert greedy(c) == before and c.server_info().policy_version == version
    with SpecrollClient(srv.grpc_target) as anon:
        with pytest.raises((Unauthenticated, PermissionDenied)):
            anon.push_weights(base, "bad4")
        assert greedy(anon) == before


def test_the_one_weight_validation_runs_before_vllm_is_touched(server, vllm_model, tmp_path):
    """NaN weights, a dtype other than the served one without a cast, a header that lies: refused on the gRPC and
    the folder path alike (issue 49), the old weights serving on; asked for, a cast is done."""
    srv, _ = server
    base = checkpoint_tensors(vllm_model)
    nan = {k: v.clone() for k, v in base.items()}
    nan["model.norm.weight"][1] = float("nan")
    half = {k: v.half() for k, v in base.items()}
    lying = write_checkpoint(vllm_model, base, tmp_path / "lying") / "model.safetensors"
    lying.write_bytes(lying.read_bytes()[:-32])
    with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
        before, version = greedy(c), c.server_info().policy_version
        with pytest.raises(InvalidArgument, match="NaN or infinite"):
            c.push_weights(nan, "nan")
        with pytest.raises(InvalidArgument, match="ask for a cast explicitly"):
            c.push_weights(half, "f16")
        with pytest.raises(InvalidArgument, match="NaN or infinite"):
            c.load_weights(str(write_checkpoint(vllm_model, nan, tmp_path / "nan")), "nan-folder")
        with pytest.raises(InvalidArgument, match="past the"):
            c.load_weights(str(lying.parent), "lying-folder")
        assert greedy(c) == before and c.server_info().policy_version == version
        assert c.push_weights(half, "f16-cast", cast=True).version == "f16-cast"
        assert c.push_weights(base, "back").version == "back"
        assert greedy(c) == before


def _stream_in_background(srv, results: list, started: threading.Event, n: int = 64) -> threading.Thread:
    def run() -> None:
        with SpecrollClient(srv.grpc_target) as c:
            for ev in c.stream([1, 2, 3], n=n, max_tokens=MAX_LEN - 3, temperature=1.0, ignore_eos=True):
                started.set()
                if hasattr(ev, "finish_reason"):
                    results.append(ev)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("mode", ["abort", "keep", "wait"])
def test_push_modes(server, vllm_model, mode):
    """`keep`: a rollout in flight when the push lands goes on with the new weights, its tokens tagged by version.
    64 rows of 61 tokens on a tiny model can all finish before the push lands (the push is a race with them):
    such a try shows no rollout in flight, so `keep` tries again, up to 5 times, until one does."""
    srv, _ = server
    base = checkpoint_tensors(vllm_model)
    for attempt in range(5 if mode == "keep" else 1):
        results: list = []
        started = threading.Event()
        thread = _stream_in_background(srv, results, started)
        assert started.wait(60)
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            old, new = c.server_info().policy_version, f"{mode}-v{attempt}"
            res = c.push_weights(base, new, mode=mode)
        thread.join(120)
        assert len(results) == 64
        reasons = {s.finish_reason for s in results}
        spans = [[v.policy_version for v in s.version_spans] for s in results]
        if mode == "abort":
            assert res.aborted and "abort" in reasons
            assert all(v == [old] for s, v in zip(results, spans, strict=True) if s.finish_reason == "abort")
        elif mode == "keep":
            assert reasons == {"length"} and all(v in ([old], [old, new], [new]) for v in spans), spans
            if [old, new] in spans:
                break
        else:
            assert reasons == {"length"} and all(v == [old] for v in spans)
    else:
        assert mode != "keep", "no rollout was in flight when the push landed, in 5 tries"


def test_an_abort_push_leaves_waiting_requests_to_the_new_weights(server, vllm_model):
    """Mode abort ends the running rows only: 300 rows (5 requests of 60) on a server of 256 sequences leave some
    waiting, and no waiting row is ended (vLLM's own abort pause ends them with no token). Rows that finished
    before the push lands, or whose first tokens had not reached the server when the pause took effect, run to
    their length. On a loaded machine every row can finish before the push lands (a race with 61-token rows):
    such a try aborts nothing, so the test tries again, up to 3 times, until one does."""
    srv, _ = server
    base = checkpoint_tensors(vllm_model)
    for attempt in range(3):
        results: list = []
        threads, started = [], [threading.Event() for _ in range(5)]
        for ev in started:
            threads.append(_stream_in_background(srv, results, ev, n=60))
        assert all(ev.wait(60) for ev in started[:4])  # 240 rows running
        new = f"abort-waiting-{attempt}"
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            old = c.server_info().policy_version
            c.push_weights(base, new, mode="abort")
        for t in threads:
            t.join(120)
        assert len(results) == 300
        spans = [[v.policy_version for v in s.version_spans] for s in results]
        aborted = [v for s, v in zip(results, spans, strict=True) if s.finish_reason == "abort"]
        kept = [(s, v) for s, v in zip(results, spans, strict=True) if s.finish_reason != "abort"]
        # every token is tagged with the weights that made it: no aborted row's with the new version, even where
        # its outputs reached the server after the push committed (a backlog of 256 rows)
        assert all(v == [old] for v in aborted), sorted({tuple(v) for v in aborted})
        kept_spans = sorted({tuple(v) for _, v in kept})
        assert all(s.finish_reason == "length" and v in ([old], [old, new], [new]) for s, v in kept), kept_spans
        if aborted:
            break
    else:
        raise AssertionError("no row was running when the abort push landed, in 3 tries")


def test_tokens_are_tagged_by_the_weights_that_made_them(server, vllm_model, tmp_path):
    """256 greedy rows of one prompt through a keep push (the new weights perturbed): outputs made before the
    pause can reach the server after the push committed. Each row's tokens tagged old must be the old weights'
    greedy output and the rest the new weights' greedy continuation of that prefix."""
    srv, _ = server
    base = checkpoint_tensors(vllm_model)
    new = perturbed(base, seed=4)
    prompt, rows = [2, 9, 4], []
    started = [threading.Event() for _ in range(4)]

    def run(ev: threading.Event) -> None:
        with SpecrollClient(srv.grpc_target) as c:
            for out in c.stream(prompt, n=64, max_tokens=MAX_LEN - 3, temperature=0.0, ignore_eos=True):
                ev.set()
                if hasattr(out, "finish_reason"):
                    rows.append(out)

    threads = [threading.Thread(target=run, args=(ev,)) for ev in started]
    for t in threads:
        t.start()
    assert all(ev.wait(60) for ev in started)
    with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
        old = c.server_info().policy_version
        c.push_weights(new, "tagged", mode="keep")
        for t in threads:
            t.join(120)
        c.push_weights(base, "tagged-back")  # the original weights for the other tests
    assert len(rows) == 256
    assert all([v.policy_version for v in r.version_spans] in ([old], [old, "tagged"], ["tagged"]) for r in rows)
    new_model = hf_of(write_checkpoint(vllm_model, new, tmp_path / "tagged"))
    check_cut_at_push(rows, old, prompt, hf_of(vllm_model), new_model, MAX_LEN - 3)


def test_a_push_over_vllms_weight_transfer_endpoints(server, vllm_model, tmp_path):
    """vLLM's trainer-engine payloads, packed over gloo (tests/api/transfer_trainer.py), on the vLLM backend."""
    srv, _ = server
    base = checkpoint_tensors(vllm_model)
    new = perturbed(base, seed=9)
    path = tmp_path / "new.safetensors"
    save_file({k: v.contiguous() for k, v in new.items()}, str(path))
    trainer = Path(__file__).resolve().parents[1] / "api" / "transfer_trainer.py"
    env = {**os.environ, "SPECROLL_ADMIN_TOKEN": ADMIN, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
        before = greedy(c)
        run = subprocess.run([sys.executable, str(trainer), "vllm", srv.http_url, str(path), "transfer-v1", "wait",
                              "60"], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert json.loads(run.stdout.splitlines()[-1])[-1]["version"] == "transfer-v1"
        assert c.server_info().policy_version == "transfer-v1"
        after = greedy(c)
        assert after != before
        ref = hf_of(write_checkpoint(vllm_model, new, tmp_path / "ref"))
        assert after == [hf_greedy(ref, p, 10) for p in PROMPTS]
        c.push_weights(base, "after-transfer")  # the original weights for the other tests
        assert greedy(c) == before
