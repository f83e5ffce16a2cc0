"""A fleet behind sglang-router (PyPI): two specroll servers behind the router's binary serve slime's /generate
payloads, and slime's abort sequence works through the router's worker list.

slime's sequence: THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515, slime/rollout/sglang_rollout.py `abort`
(GET {router}/workers, each worker's url) and slime/backends/sglang_utils/server_control.py
`abort_server_until_idle` (POST {worker}/abort_request {"abort_all": true}, GET {worker}/v1/loads?include=core
until it reads 0).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest
from helpers import default_checkpoint, stop_process
from probes import wait_for
from service_utils import start_server
from test_dropin_sglang import SLIME_SP, num_requests_from_load

from service.app import BackgroundServer
from service.netutil import free_port

ROUTER_START_TIMEOUT_S = 60.0


def router_command(port: int, workers: list[str]) -> list[str]:
    exe = shutil.which("sglang-router")
    head = [exe, "launch"] if exe else [sys.executable, "-m", "sglang_router.launch_router"]
    return [*head, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--worker-urls", *workers]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, list[BackgroundServer]]]:
    pytest.importorskip("sglang_router", reason="needs sglang-router (pip install sglang-router)")
    model = default_checkpoint()
    servers = [start_server(model, control_auth="none", engine_kw={"enforce_eager": True}) for _ in range(2)]
    port = free_port()
    proc = subprocess.Popen(router_command(port, [s.http_url for s in servers]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        def answering() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"sglang-router exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
            return httpx.get(f"{url}/workers", timeout=2).status_code == 200

        wait_for(answering, ROUTER_START_TIMEOUT_S, "sglang-router to answer /workers", every=0.2,
                 ignoring=(httpx.HTTPError,))
        yield url, servers
    finally:
        stop_process(proc)
        for s in servers:
            s.stop()


def test_slime_generate_through_the_router(fleet):
    url, servers = fleet
    before = [s.server.backend.stats().num_steps for s in servers]
    with httpx.Client(base_url=url, timeout=120) as c:
        for _ in range(4):
            r = c.post("/generate", json={"input_ids": [5, 17, 42], "return_logprob": True,
                                          "sampling_params": {**SLIME_SP, "max_new_tokens": 8}})
            assert r.status_code == 200, r.text
            assert len(r.json()["meta_info"]["output_token_logprobs"]) == 8
    assert all(s.server.backend.stats().num_steps > b for s, b in zip(servers, before, strict=True))


def test_slime_abort_sequence_through_the_worker_list(fleet):
    url, servers = fleet
    results: list[httpx.Response] = []
    with httpx.Client(base_url=url, timeout=120) as c:
        threads = [threading.Thread(target=lambda: results.append(c.post("/generate", json={
            "input_ids": [5, 17, 42], "sampling_params": {**SLIME_SP, "max_new_tokens": 240}})))
            for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: sum(s.server.backend.stats().num_running for s in servers) >= 2, 60,
                 "both workers to run a request", every=0.005)
        workers = [w["url"] for w in c.get("/workers").json()["workers"]]
        assert sorted(workers) == sorted(s.http_url for s in servers)
        for worker in workers:
            assert httpx.post(f"{worker}/abort_request", json={"abort_all": True}).status_code == 200
            wait_for(lambda w=worker: not num_requests_from_load(httpx.get(f"{w}/v1/loads",
                                                                           params={"include": "core"}).json()),
                     60, f"{worker}'s /v1/loads to count no request", every=0.01)
        for t in threads:
            t.join(60)
    assert [r.json()["meta_info"]["finish_reason"]["type"] for r in results] == ["abort", "abort"]
