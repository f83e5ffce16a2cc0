"""SGLang's RL control surface with slime's and AReaL's own payloads, and the control-auth choice.

slime payloads: THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515 — slime/rollout/sglang_rollout.py
(`GenerateState`: custom_params {"return_top_p_token_ids": true} whenever top_p != 1, no_stop_trim,
spaces_between_special_tokens; `generate`: input_ids, return_logprob), slime/backends/sglang_utils/server_control.py
(`abort_server_until_idle`: POST /abort_request {"abort_all": true}, then GET /v1/loads?include=core until
`num_requests_from_load` reads 0), slime/backends/sglang_utils/sglang_engine.py (pause_generation {},
continue_generation {}, GET /flush_cache, GET /health_generate), slime/backends/sglang_utils/external.py
(`discover_external_engines` reads tp_size, pp_size, num_gpus, disaggregation_mode, encoder_only of /server_info).
AReaL payloads: inclusionAI/AReaL 4aef98d8d818af55b43621aaadba047ae10f4e77, areal/engine/sglang_remote.py
(`build_generation_request`, `build_disk_weight_update_requests`: {"model_path", "abort_all_requests": true}).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from probes import wait_for
from service_utils import ADMIN, auth, running, start_server

from service.api.auth import Auth
from service.api.http_server import create_app
from service.app import BackgroundServer

PROMPT = [5, 17, 42, 99, 7]
SLIME_SP = {"temperature": 0.9, "top_p": 0.9, "top_k": -1, "max_new_tokens": 200, "stop": None,
            "stop_token_ids": None, "skip_special_tokens": True, "no_stop_trim": True,
            "spaces_between_special_tokens": False, "custom_params": {"return_top_p_token_ids": True},
            "sampling_seed": 77}


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[BackgroundServer]:
    yield from running(start_server(model_dir, control_auth="none", engine_kw={"enforce_eager": True}))


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        yield c


def num_requests_from_load(load: Any) -> int:
    """slime's reading of /v1/loads (server_control.py), restated: the first count key it finds."""
    if isinstance(load, list):
        return sum(num_requests_from_load(x) for x in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return int(load[key])
    return int(load.get("num_running_reqs", 0)) + int(load.get("num_waiting_reqs", 0))


def in_background(http: httpx.Client, server: BackgroundServer, payload: dict) -> tuple[threading.Thread, dict]:
    """POST /generate on a thread; returns once the engine runs it."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=http.post("/generate", json=payload)))
    t.start()
    wait_for(lambda: server.server.backend.stats().num_running > 0 or not t.is_alive(), 60,
             "the engine to run the request", every=0.002)
    return t, box


def slime_payload(max_new_tokens: int = 200) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {**SLIME_SP, "max_new_tokens": max_new_tokens},
            "return_logprob": True}


def test_slime_generate_with_custom_params(http):
    r = http.post("/generate", json=slime_payload(16))
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert [x[1] for x in meta["output_token_logprobs"]] == r.json()["output_ids"]
    bad = {**slime_payload(4), "sampling_params": {**SLIME_SP, "custom_params": "x"}}
    assert "custom_params" in http.post("/generate", json=bad).json()["error"]["message"]
    for key, value in (("regex", "a+"), ("nonsense", 1)):
        r = http.post("/generate", json={**slime_payload(4), "sampling_params": {**SLIME_SP, key: value}})
        assert r.status_code == 400 and f"sampling_params.{key}" in r.json()["error"]["message"], r.text


def test_slime_abort_all_then_poll_loads(http, server):
    t, box = in_background(http, server, slime_payload(240))
    assert num_requests_from_load(http.get("/v1/loads", params={"include": "core"}).json()) == 1
    r = http.post("/abort_request", json={"abort_all": True})  # no Authorization header, as slime sends it
    assert r.status_code == 200, r.text
    wait_for(lambda: not num_requests_from_load(http.get("/v1/loads", params={"include": "core"}).json()), 60,
             "/v1/loads to count no request", every=0.01)
    t.join(60)
    meta = box["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 240


def test_abort_request_by_rid(http, server):
    t, box = in_background(http, server, {**slime_payload(240), "rid": "slime-7"})
    assert http.post("/abort_request", json={"rid": "slime-7"}).json()["aborted"] == ["slime-7"]
    t.join(60)
    assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert http.post("/abort_request", json={}).status_code == 400


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_requests_and_their_outputs(http, server, mode):
    want = http.post("/generate", json=slime_payload(240)).json()["output_ids"]
    t, box = in_background(http, server, slime_payload(240))
    r = http.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200 and r.json()["aborted"] == []
    assert server.server.backend.stats().num_running == 1  # kept, its KV with it
    assert http.get("/health_generate").status_code == 200  # paused is serving: slime's monitor must not kill it
    assert http.post("/continue_generation", json={}).status_code == 200
    t.join(120)
    assert box["r"].json()["output_ids"] == want


def test_pause_default_aborts(http, server):
    """slime and AReaL send /pause_generation {}: SGLang's default mode, abort."""
    t, box = in_background(http, server, slime_payload(240))
    r = http.post("/pause_generation", json={})
    assert r.status_code == 200 and len(r.json()["aborted"]) == 1
    http.post("/continue_generation", json={})
    t.join(60)
    assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert http.post("/pause_generation", json={"mode": "nap"}).status_code == 400


def test_areal_update_weights_from_disk(http, model_dir):
    before = http.get("/get_weight_version").json()["weight_version"]
    for step in (1, 2):
        r = http.post("/update_weights_from_disk", json={"model_path": str(model_dir), "abort_all_requests": True})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert http.get("/get_weight_version").json()["weight_version"] == str(int(before) + step)
    r = http.post("/update_weights_from_disk", json={"model_path": str(model_dir), "weight_version": "v9",
                                                     "flush_cache": False})
    assert r.json()["version"] == "v9"


def test_probes_and_info(http):
    assert http.get("/flush_cache").status_code == 200 and http.post("/flush_cache").json() == {"success": True}
    assert http.get("/health_generate").json() == {"status": "ok"}
    assert http.get("/get_model_info").json()["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert (info["tp_size"], info["pp_size"], info["num_gpus"], info["encoder_only"]) == (1, 1, 1, False)
        assert info["disaggregation_mode"] not in ("prefill", "decode") and info["control_auth"] == "none"


def test_control_needs_the_admin_token_by_default(server):
    """The same app with the default auth: control calls without the admin token are refused."""
    ctx = dataclasses.replace(server.server.ctx, auth=Auth(ADMIN))
    with TestClient(create_app(ctx)) as c:
        for method, path in (("post", "/abort_request"), ("post", "/pause_generation"), ("get", "/flush_cache"),
                             ("post", "/pause"), ("post", "/reset_prefix_cache")):
            r = c.request(method.upper(), path, json={"abort_all": True})
            assert r.status_code == 401, (path, r.text)
        assert c.get("/server_info").json()["control_auth"] == "token"
        assert c.post("/abort_request", json={"abort_all": True}, headers=auth()).status_code == 200
    with pytest.raises(ValueError, match="control auth"):
        Auth(ADMIN, control_auth="open")
