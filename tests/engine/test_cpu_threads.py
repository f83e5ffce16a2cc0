"""Threads other than the engine's keep torch to themselves (service/cpu_threads.py): no OpenMP team of their
own, which would make every engine step slower for the rest of the process; a push's own threads run behind
the engine's."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from helpers import make_checkpoint
from probes import wait_for
from service_utils import ADMIN, checkpoint_tensors, perturbed, start_server, write_checkpoint

from client import SpecrollClient
from drafter_trainer.config import TrainerConfig
from service.buffer import BufferConfig
from service.cpu_threads import BEHIND_NICE, EngineTeam, behind_generation, one_cpu_thread, push_cpus, usable_cpus


@pytest.fixture(autouse=True)
def two_threads():
    """The suite runs torch on one thread (conftest.py), where no thread makes a team: serve with two here."""
    count = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(count)


def runtime_threads(nice: int | None = None) -> set[int]:
    """Threads of this process that Python did not start and that carry the process's own name: the OpenMP
    runtime's team members (gRPC's threads have names of their own); with `nice`, those at that niceness (a
    thread's team members inherit its niceness)."""
    name = Path("/proc/self/comm").read_text()
    python = {t.native_id for t in threading.enumerate()}
    found = set()
    for t in map(int, os.listdir("/proc/self/task")):
        try:
            comm, stat = Path(f"/proc/self/task/{t}/comm").read_text(), Path(f"/proc/self/task/{t}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        if t not in python and comm == name and (nice is None or int(stat.rsplit(")", 1)[1].split()[16]) == nice):
            found.add(t)
    return found


def in_thread(fn) -> dict:
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(fn()))
    th.start()
    th.join()
    return out


def test_a_thread_runs_its_torch_ops_alone_and_leaves_the_others_their_count():
    big = torch.randn(512, 1024)

    def work(fix: bool) -> dict:
        ok = one_cpu_thread() if fix else None
        before = runtime_threads()
        (big.to(torch.bfloat16) @ big.T.to(torch.bfloat16)).float().sum()  # conversions and a matmul
        return {"ok": ok, "threads": torch.get_num_threads(), "new": runtime_threads() - before}

    main_count = torch.get_num_threads()  # 2
    plain = in_thread(lambda: work(False))
    assert plain["threads"] == main_count and plain["new"]  # the control: a team of its own (the bug)
    fixed = in_thread(lambda: work(True))
    assert fixed == {"ok": True, "threads": 1, "new": set()}
    assert torch.get_num_threads() == main_count and in_thread(lambda: {"n": torch.get_num_threads()})["n"] > 1


def test_a_converting_load_gives_the_server_no_second_team(tmp_path):
    """A float32 server loads folders (a bf16 one converted where it is staged, on a pooled thread that lives
    on): before the fix its decoding ran 1.6x slower from then on (demo model, 2 cores)."""
    base = make_checkpoint("qwen2", tied=False, hidden_size=256, intermediate_size=512)
    tensors = checkpoint_tensors(base)
    f32 = write_checkpoint(base, tensors, tmp_path / "f32")
    bf16 = write_checkpoint(base, {k: v.to(torch.bfloat16) for k, v in tensors.items()}, tmp_path / "bf16")
    srv = start_server(base, load_root=str(tmp_path), engine_kw={"drafter": "none", "spec": "off",
                                                                                "num_threads": 2})
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            c.generate_one([1, 2, 3], max_tokens=4, temperature=0.0)
            before = runtime_threads()  # the engine's team
            assert c.load_weights(str(bf16), "bf16", cast=True).version == "bf16"
            assert c.load_weights(str(f32), "f32").version == "f32"
            assert runtime_threads() - before == set()
            assert len(c.generate_one([1, 2, 3], max_tokens=4, temperature=0.0).samples[0].token_ids) == 4
    finally:
        srv.stop()


def test_the_in_process_drafter_trainer_gives_the_server_no_second_team(tmp_path):
    """Its thread trains between rollouts: before the fix its team halved the engine's tokens/s in every batch
    bucket of bench/e2e.py's GRPO run, training or not."""
    target = make_checkpoint("qwen2", tied=True, hidden_size=256, intermediate_size=512, seed=3)
    draft = write_checkpoint(target, perturbed(checkpoint_tensors(target), seed=5), tmp_path / "draft")
    trainer = TrainerConfig(gate="always", min_new=8, max_wait_s=0.1, block_ms=50, min_heldout=4,
                            info_interval_s=0.1, consumer="in-process")
    srv = start_server(target, buffer=BufferConfig(embedded_trainer=True, trainer=trainer),
                       engine_kw={"drafter": str(draft), "spec": "fixed", "spec_k": 2, "num_threads": 2})
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            deadline = time.monotonic() + 120
            while srv.server.trainer.trainer is None or srv.server.trainer.trainer.round < 2:
                assert time.monotonic() < deadline, "the in-process trainer did not train two rounds"
                c.generate([[7 + i, 11 + (i * 5) % 97, 13] for i in range(16)], max_tokens=32, temperature=1.0,
                           ignore_eos=True)
            assert srv.server.trainer.one_thread is True
            tid = srv.server.trainer._thread.native_id
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE  # below every normal thread (embedded.py)
            assert runtime_threads(nice=srv.server.trainer.niceness) == set()  # a team it made would share its nice
    finally:
        srv.stop()


def test_a_casting_push_from_the_blocking_client_gives_its_loop_thread_no_team():
    """The blocking client casts on the caller's thread: a cast on its own loop thread, which lives as long as the
    client, would give that thread a team, and a CPU trainer's every op would wait for its own team to wake."""
    base = make_checkpoint("qwen2", tied=False, hidden_size=256, intermediate_size=512)
    weights = {k: v.float() for k, v in checkpoint_tensors(base).items()}
    srv = start_server(base, engine_kw={"drafter": "none", "spec": "off", "num_threads": 2})
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            c.generate_one([1, 2, 3], max_tokens=4, temperature=0.0)
            torch.randn(512, 1024).to(torch.bfloat16)  # the caller's own team, made before counting
            before = runtime_threads()
            assert c.push_weights(weights, "bf16", dtype="bfloat16", cast=True).version == "bf16"
            assert runtime_threads() - before == set()
            assert c.server_info().policy_version == "bf16"
    finally:
        srv.stop()


def _nice(tid: int) -> int | None:
    try:
        return int(Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])
    except OSError:  # ended meanwhile
        return None


def test_a_thread_behind_generation_yields_and_the_others_keep_their_priority():
    mine = _nice(threading.get_native_id())

    def behind() -> dict:
        with behind_generation(cpus=2) as ok:
            return {"ok": ok, "nice": _nice(threading.get_native_id()), "held": push_cpus()}

    assert in_thread(behind) == {"ok": True, "nice": min(19, mine + BEHIND_NICE), "held": 2}
    assert _nice(threading.get_native_id()) == mine
    assert push_cpus() == 0  # given back when the block ends


TWO_CPUS = pytest.mark.skipif(usable_cpus() < 2, reason="needs two usable CPUs: a team of one leaves a push nothing")


@contextmanager
def a_push_holding_a_cpu() -> Iterator[None]:
    """A thread inside `behind_generation` (as a push's staging thread is) until the block ends."""
    holding, release = threading.Event(), threading.Event()

    def push() -> None:
        with behind_generation():
            holding.set()
            release.wait(60)

    pusher = threading.Thread(target=push)
    pusher.start()
    holding.wait(30)
    try:
        yield
    finally:
        release.set()
        pusher.join()


@TWO_CPUS
def test_the_engine_team_leaves_a_push_thread_its_cpu_until_the_push_ends():
    """A team member sharing a CPU with a push thread holds the whole team back at every parallel op: the
    engine's team runs one thread fewer per CPU a push holds, and its full count again once the push ends."""
    def engine() -> dict:
        team = EngineTeam()
        before = (team.fit(), torch.get_num_threads())
        with a_push_holding_a_cpu():
            during = (team.fit(), torch.get_num_threads(), in_thread(lambda: {"n": torch.get_num_threads()})["n"])
        return {"before": before, "during": during, "after": (team.fit(), torch.get_num_threads())}

    # during: the engine thread's own count shrinks; a thread started meanwhile keeps torch's count
    assert in_thread(engine) == {"before": (2, 2), "during": (1, 1, 2), "after": (2, 2)}
    assert torch.get_num_threads() == 2


@TWO_CPUS
def test_compiled_forwards_keep_the_whole_team_beside_a_push_and_compile_nothing_again():
    """Dynamo guards the thread count a forward compiled at: a compiled engine keeps its team while a push holds
    a CPU, so a push compiles no variant again on the engine thread."""
    from service.config import EngineConfig
    from service.engine import compiled
    from service.engine.llm_engine import LLMEngine
    from service.params import SamplingParams

    if not compiled.available():
        pytest.skip("no C++ compiler: nothing compiles here")
    base = make_checkpoint("qwen2", tied=False, hidden_size=64, intermediate_size=128)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    def serve() -> dict:
        engine = LLMEngine(EngineConfig(model=str(base), max_model_len=64, max_num_seqs=4, drafter="none",
                                        spec="off"))
        assert engine.runner.target.compiled is not None
        alone = engine.generate([[1, 2, 3], [4, 5]], greedy)
        start = compiled.compiles()
        with a_push_holding_a_cpu():
            beside = engine.generate([[1, 2, 3], [4, 5]], greedy)
            team = engine._team._now
        return {"compiled again": compiled.compiles() - start, "team": team,
                "same tokens": [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in beside]}

    assert in_thread(serve) == {"compiled again": 0, "team": 2, "same tokens": True}


@TWO_CPUS
def test_the_serving_engine_runs_one_thread_fewer_while_a_push_stages_and_all_of_them_after(tmp_path):
    """End to end: while a pushed folder stages on its own thread, the steps of a rollout being decoded run on a
    team of one; the steps after the swap run on the full team again, and the rollout is whole."""
    base = make_checkpoint("qwen2", tied=False, hidden_size=256, intermediate_size=512)
    folder = write_checkpoint(base, perturbed(checkpoint_tensors(base), seed=5), tmp_path / "new")
    srv = start_server(base, load_root=str(tmp_path), engine_kw={"drafter": "none", "spec": "off",
                                                                "enforce_eager": True, "num_threads": 2})
    team = srv.server.backend.loop.engine._team
    stager = srv.server.backend.stager
    stage, seen = stager.stage, {}

    def recorded(*args, **kw):
        wait_for(lambda: team._now == 1, timeout=30, what="a step on a team of one")
        seen["during"] = team._now
        return stage(*args, **kw)

    stager.stage = recorded
    stop = threading.Event()
    lengths: list[int] = []

    def decode() -> None:
        with SpecrollClient(srv.grpc_target) as g:
            while not stop.is_set():
                out = g.generate([[1, 2, 3 + i] for i in range(4)], max_tokens=64, temperature=0.0, ignore_eos=True)
                lengths.extend(len(r.samples[0].token_ids) for r in out)

    decoder = threading.Thread(target=decode)
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            c.generate_one([1, 2, 3], max_tokens=4, temperature=0.0)
            assert team._now == 2
            decoder.start()
            assert c.load_weights(str(folder), "folder").version == "folder"
            assert seen == {"during": 1}
            wait_for(lambda: team._now == 2, timeout=30, what="the full team back after the swap")
    finally:
        stop.set()
        decoder.join(60)
        srv.stop()
    assert lengths and set(lengths) == {64}


def test_every_push_path_stages_behind_the_engine_and_leaves_no_thread_behind(tmp_path):
    """gRPC chunks, a folder load and an HTTP upload stage on threads of their own at +BEHIND_NICE, so where
    decoding and staging both want the two CPUs decoding comes first; the engine thread and the loop's shared
    pool (which renders chat prompts) keep the process's priority."""
    base = make_checkpoint("qwen2", tied=False, hidden_size=256, intermediate_size=512)
    new = perturbed(checkpoint_tensors(base), seed=5)
    folder = write_checkpoint(base, new, tmp_path / "new")
    srv = start_server(base, load_root=str(tmp_path), engine_kw={"drafter": "none", "spec": "off",
                                                                "enforce_eager": True})
    own = _nice(threading.get_native_id())
    seen: list[int | None] = []
    stager = srv.server.backend.stager
    stage = stager.stage

    def recorded(*args, **kw):
        seen.append(_nice(threading.get_native_id()))
        return stage(*args, **kw)

    stager.stage = recorded
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            c.generate_one([1, 2, 3], max_tokens=4, temperature=0.0)
            assert c.push_weights(new, "grpc").version == "grpc"
            assert c.load_weights(str(folder), "folder").version == "folder"
            body = (folder / "model.safetensors").read_bytes()
            r = httpx.post(f"{srv.http_url}/weights/upload", params={"version": "http"}, content=body,
                           headers={"authorization": f"Bearer {ADMIN}"}, timeout=60)
            assert r.status_code == 200, r.text
            assert seen == [min(19, own + BEHIND_NICE)] * 3
            engine = next(t for t in threading.enumerate() if t.name == "specroll-engine")
            assert _nice(engine.native_id) == own
            assert len(c.generate_one([1, 2, 3], max_tokens=4, temperature=0.0).samples[0].token_ids) == 4
        wait_for(lambda: all(_nice(t.native_id) in (own, None) for t in threading.enumerate()), timeout=10,
                 what="every push thread ended (no pooled thread kept the lower priority)")
    finally:
        srv.stop()
