"""Faults against a real server on loopback: admin calls (push / pause in mode wait) whose client gives up while
the server waits for running requests. The engine must survive, nothing is applied half, and the admission hold
is released (see README, "An admin call whose client leaves")."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from helpers import default_checkpoint
from safetensors.torch import save
from service_utils import ADMIN, auth, checkpoint_tensors, perturbed, running, start_server

from client import AsyncSpecrollClient
from service.api.generation import Limits
from service.app import BackgroundServer
from service.protogen import pb2

LONG_LEN = 4096
LONG: dict[str, Any] = {"temperature": 1.0, "seed": 3, "max_tokens": LONG_LEN - 16, "ignore_eos": True}
SHORT: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
N_LONG = 8


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return default_checkpoint(tied=False)


@pytest.fixture(scope="module")
def new(base_dir) -> dict[str, torch.Tensor]:
    return perturbed(checkpoint_tensors(base_dir), seed=11)


@pytest.fixture(scope="module")
def server(base_dir) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir, limits=Limits(max_tokens=LONG_LEN),
                                    engine_kw={"max_model_len": LONG_LEN, "max_num_seqs": 16}))


async def _until(c: AsyncSpecrollClient, cond: Callable[[Any], bool], what: str) -> None:
    for _ in range(2000):
        if cond(await c.server_info()):
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"never saw {what}: {await c.server_info()}")


async def _until_held(srv: BackgroundServer) -> None:
    async with httpx.AsyncClient(base_url=srv.http_url) as h:
        for _ in range(3000):
            if "specroll:admission_held 1.0" in (await h.get("/metrics")).text:
                return
            await asyncio.sleep(0.01)
    pytest.fail("the admin call never held admission")


async def _abandon_while_held(srv: BackgroundServer, start_admin: Callable[[AsyncSpecrollClient], Awaitable[Any]],
                              give_up: Callable[[asyncio.Task[Any]], Awaitable[None]]) -> tuple[str, bool]:
    """Long requests run; the admin call holds admission; a request queues behind it; the admin client gives up.
    The queued request finishes while the long ones still run (the hold is gone); then they are aborted.
    Returns the version and paused flag once everything has finished."""
    async with AsyncSpecrollClient(srv.grpc_target, admin_token=ADMIN, retries=0) as c:
        before = (await c.server_info()).policy_version
        longs = [asyncio.ensure_future(c.generate_one([1, 2, 3, i], **LONG)) for i in range(N_LONG)]
        await _until(c, lambda i: i.num_running >= N_LONG, "the long requests running")
        admin = asyncio.ensure_future(start_admin(c))
        await _until_held(srv)
        queued = asyncio.ensure_future(c.generate_one([5, 6, 7], **SHORT))
        # slots are free, so a request that waits is held back by the admin call
        await _until(c, lambda i: i.num_waiting >= 1 and i.num_running >= N_LONG, "the request queued behind the hold")
        await give_up(admin)
        queued_done = await asyncio.wait_for(queued, 120)
        assert len(queued_done.samples[0].token_ids) == SHORT["max_tokens"]
        assert not any(t.done() for t in longs)
        await c.abort(all=True)
        for done in await asyncio.gather(*longs):
            assert done.samples[0].finish_reason == "abort"
            assert done.samples[0].version_spans[-1].policy_version == before
        after = await c.generate_one([4, 4, 4], **SHORT)  # new requests are served
        assert len(after.samples[0].token_ids) == SHORT["max_tokens"]
        info = await c.server_info()
    assert httpx.get(srv.http_url + "/health").status_code == 200
    return info.policy_version, info.paused


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _deadline(task: asyncio.Task[Any]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await task
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_grpc_push_wait_cancelled_is_not_applied(server, new):
    before = asyncio.run(_info(server)).policy_version

    async def push(c: AsyncSpecrollClient) -> Any:
        return await c.push_weights(new, "abandoned-grpc", mode="wait")

    version, paused = asyncio.run(_abandon_while_held(server, push, _cancel))
    assert version == before and not paused
    metrics = httpx.get(server.http_url + "/metrics").text
    assert "specroll:admission_held 0.0" in metrics


def test_grpc_pause_wait_cancelled_and_deadline_leave_server_running(server):
    async def pause(c: AsyncSpecrollClient) -> Any:
        return await c.pause("wait")

    async def pause_deadline(c: AsyncSpecrollClient) -> Any:
        return await c._stub.Pause(pb2.PauseRequest(mode="wait"), metadata=c._admin, timeout=0.3)

    _, paused = asyncio.run(_abandon_while_held(server, pause, _cancel))
    assert not paused
    _, paused = asyncio.run(_abandon_while_held(server, pause_deadline, _deadline))
    assert not paused


def test_push_after_abandoned_push_still_applies(server, new):
    async def push(c: AsyncSpecrollClient) -> Any:
        return await c.push_weights(new, "abandoned-2", mode="wait")

    asyncio.run(_abandon_while_held(server, push, _cancel))

    async def push_now() -> str:
        async with AsyncSpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
            await c.push_weights(new, "applied-after", mode="wait")
            return (await c.server_info()).policy_version

    assert asyncio.run(push_now()) == "applied-after"


def _http_admin(srv: BackgroundServer, method_path: str, **kw: Any) -> Callable[[Any], Awaitable[Any]]:
    async def call(_: AsyncSpecrollClient) -> Any:
        async with httpx.AsyncClient(base_url=srv.http_url, headers=auth(), timeout=120) as h:
            return await h.post(method_path, **kw)

    return call


def test_http_upload_wait_client_disconnects_is_not_applied(server, new):
    before = asyncio.run(_info(server)).policy_version
    body = save({k: v.contiguous() for k, v in new.items()})
    upload = _http_admin(server, "/weights/upload", params={"version": "abandoned-http", "mode": "wait"},
                         content=body)
    version, paused = asyncio.run(_abandon_while_held(server, upload, _cancel))
    assert version == before and not paused


def test_http_pause_wait_client_disconnects_leaves_server_running(server):
    _, paused = asyncio.run(_abandon_while_held(server, _http_admin(server, "/pause", json={"mode": "wait"}),
                                                _cancel))
    assert not paused


async def _info(srv: BackgroundServer) -> Any:
    async with AsyncSpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
        return await c.server_info()


def test_abort_mode_aborts_running_requests_only(server, new):
    async def run() -> tuple[list[Any], list[Any], Any]:
        async with AsyncSpecrollClient(server.grpc_target, admin_token=ADMIN, retries=0) as c:
            running = [asyncio.ensure_future(c.generate_one([1, 2, i], **LONG)) for i in range(16)]
            await _until(c, lambda i: i.num_running >= 16, "every slot running")
            waiting = [asyncio.ensure_future(c.generate_one([3, 2, i], **SHORT)) for i in range(2)]
            await _until(c, lambda i: i.num_waiting >= 2, "two requests waiting for a slot")
            result = await c.push_weights(new, "abort-mode", mode="abort")
            return await asyncio.gather(*running), await asyncio.gather(*waiting), result

    running, waiting, result = asyncio.run(run())
    assert all(r.samples[0].finish_reason == "abort" for r in running)
    assert sorted(result.aborted) == sorted(r.request_id for r in running)
    for w in waiting:
        assert len(w.samples[0].token_ids) == SHORT["max_tokens"]
        assert [s.policy_version for s in w.samples[0].version_spans] == ["abort-mode"]


def test_server_info_reveals_the_model_path_to_the_admin_only(server, base_dir):
    async def info_as(token: str | None) -> Any:
        async with AsyncSpecrollClient(server.grpc_target, api_token=token) as c:
            return await c.server_info()

    assert asyncio.run(info_as(None)).model_path == base_dir.name
    assert asyncio.run(info_as("not-the-admin")).model_path == base_dir.name
    assert asyncio.run(info_as(ADMIN)).model_path == str(base_dir)  # a co-located sidecar loads the target from it
    assert httpx.get(server.http_url + "/server_info").json()["model_path"] == base_dir.name
    assert httpx.get(server.http_url + "/server_info", headers=auth()).json()["model_path"] == str(base_dir)


def test_upload_without_checksum_refuses_mixed_dtypes_and_corrupt_values(server, new):
    before = asyncio.run(_info(server)).policy_version
    mixed = {k: (v.half() if i == 0 else v).contiguous() for i, (k, v) in enumerate(new.items())}
    nan = {k: v.clone().contiguous() for k, v in new.items()}
    next(iter(nan.values())).view(-1)[7] = float("nan")
    whole = save({k: v.contiguous() for k, v in new.items()})
    for body, needle in ((save(mixed), "mixes dtypes"), (save(nan), "NaN or infinite"),
                         (whole[:-5], "not a valid safetensors"), (whole + b"\0" * 5, "not a valid safetensors")):
        r = httpx.post(server.http_url + "/weights/upload", params={"version": "bad-upload", "mode": "keep"},
                       content=body, headers=auth(), timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert asyncio.run(_info(server)).policy_version == before


def test_streamed_upload_over_the_limit_is_413(base_dir, new):
    body = save({k: v.contiguous() for k, v in new.items()})  # a valid upload: its header passes, its size not
    srv = start_server(base_dir, limits=Limits(max_tokens=64, max_upload_bytes=len(body) // 2),
                       engine_kw={"max_model_len": 128, "max_num_seqs": 4})
    try:
        step = 2**16
        chunked = (body[i : i + step] for i in range(0, len(body), step))  # no content-length: counted as it streams
        r = httpx.post(srv.http_url + "/weights/upload", params={"version": "big"}, content=chunked, headers=auth(),
                       timeout=60)
        assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
        assert httpx.get(srv.http_url + "/health").status_code == 200
    finally:
        srv.stop()


def test_a_shutdown_stores_the_started_samples_only(base_dir, redis_server, tmp_path):
    """At a shutdown the running samples end as aborted rollouts with their tokens; the queued ones that never
    started end too (their clients get a final message) but are no rollouts: nothing empty reaches the buffer."""
    import redis

    from service.buffer import BufferConfig
    from service.buffer.codec import decode_entry

    stream = "shutdown-rollouts"
    srv = start_server(base_dir, engine_kw={"max_num_seqs": 2}, redis_url=redis_server,
                       buffer=BufferConfig(redis_url=redis_server, stream=stream, spool_dir=str(tmp_path / "spool")))

    async def run() -> tuple[set[str], int]:
        async with AsyncSpecrollClient(srv.grpc_target, admin_token=ADMIN, retries=0) as c:
            started: set[str] = set()
            finals: list[Any] = []

            async def consume(i: int) -> None:
                async for ev in c.stream([3, 4, 5 + i], request_id=f"r{i}", max_tokens=200, ignore_eos=True):
                    if hasattr(ev, "rollout_id"):
                        finals.append(ev)
                    else:
                        started.add(f"r{i}")

            tasks = [asyncio.ensure_future(consume(i)) for i in range(6)]
            while len(started) < 2:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(srv.stop)  # what SIGTERM runs
            await asyncio.gather(*tasks, return_exceptions=True)
            return started, len(finals)

    started, num_finals = asyncio.run(run())
    assert num_finals == 6  # every client has its final message
    records = [decode_entry(i.decode(), f) for i, f in redis.Redis.from_url(redis_server).xrange(stream)]
    assert {r.rollout_id.split(":")[0] for r in records} == started and len(started) == 2
    assert all(r.finish_reason == "abort" and r.output_token_ids for r in records)
