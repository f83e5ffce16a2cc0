"""The rollout service's generation APIs against a real server: gRPC, /v1/completions, /generate, openai."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
import torch
from probes import wait_for
from service_utils import ADMIN, auth, engine_config

from client import AsyncSpecrollClient, InvalidArgument, ServerInfo, SpecrollClient
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams
from service.tokenizer import Tokenizer

PROMPT = [5, 17, 42, 99, 7]
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234, "max_tokens": 24}


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server) -> Iterator[SpecrollClient]:
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.wait_until_ready(60)
        yield c


@pytest.fixture(scope="module")
def reference(model_dir):
    """What the engine itself returns for the seeded request (n=2)."""
    engine = LLMEngine(engine_config(model_dir))
    params = SamplingParams(n=2, ignore_eos=True, **SEEDED)
    [out] = engine.generate([PROMPT], params)
    return out.outputs


def sse(text: str) -> list[dict]:
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_same_tokens_over_every_api(client, http, reference):
    want = [o.token_ids for o in reference]
    [comp] = client.generate([PROMPT], n=2, ignore_eos=True, **SEEDED)
    assert [s.token_ids for s in comp.samples] == want
    for s, ref in zip(comp.samples, reference, strict=True):
        torch.testing.assert_close(s.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        assert s.finish_reason == "length" and s.num_output_tokens == 24 and s.rollout_id.endswith(f":{s.index}")

    body = {"prompt": PROMPT, "n": 2, "ignore_eos": True, **SEEDED}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c["token_ids"] for c in r.json()["choices"]] == want
    assert r.json()["usage"]["completion_tokens"] == 48

    sp = {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 1234, "max_new_tokens": 24, "n": 2, "ignore_eos": True}
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True})
    assert r.status_code == 200, r.text
    items = r.json()
    assert [it["output_ids"] for it in items] == want
    meta = items[0]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["weight_version"] == "0"
    assert [lp[1] for lp in meta["output_token_logprobs"]] == want[0]
    torch.testing.assert_close([lp[0] for lp in meta["output_token_logprobs"]], reference[0].logprobs, atol=1e-5,
                               rtol=0)


def test_streaming_gives_the_same_tokens(client, http, reference):
    want = [o.token_ids for o in reference]
    got: dict[int, list[int]] = {0: [], 1: []}
    finals = {}
    for ev in client.stream(PROMPT, n=2, ignore_eos=True, **SEEDED):
        if hasattr(ev, "rollout_id"):
            finals[ev.index] = ev
        else:
            got[ev.index] += ev.token_ids
            assert ev.policy_version == "0"
    assert [got[0], got[1]] == want and [finals[0].token_ids, finals[1].token_ids] == want

    r = http.post("/v1/completions", json={"prompt": PROMPT, "n": 2, "ignore_eos": True, "stream": True,
                                           "stream_options": {"include_usage": True}, **SEEDED})
    events = sse(r.text)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for e in events[:-1]:
        for c in e["choices"]:
            streamed[c["index"]] += c["token_ids"]
    assert [streamed[0], streamed[1]] == want
    assert events[-1]["usage"]["completion_tokens"] == 48

    sp = {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 1234, "max_new_tokens": 24, "ignore_eos": True}
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp, "stream": True})
    events = sse(r.text)
    assert events[-1]["output_ids"] == want[0] and events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_client_works_unchanged(server, model_dir, reference):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
    res = oa.completions.create(model="anything", prompt=PROMPT, n=2, logprobs=2, extra_body={"ignore_eos": True},
                                **SEEDED)
    assert [c.model_extra["token_ids"] for c in res.choices] == [o.token_ids for o in reference]
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 48
    assert len(res.choices[0].logprobs.token_logprobs) == 24 and len(res.choices[0].logprobs.top_logprobs[0]) <= 2

    assert [m.id for m in oa.models.list()] == [model_dir.name]
    stream = oa.completions.create(model="m", prompt="the cat sat", max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    full = oa.completions.create(model="m", prompt="the cat sat", max_tokens=12, temperature=0)
    assert text == full.choices[0].text

    tok = Tokenizer.from_dir(model_dir)
    words = full.choices[0].text
    if len(words) > 3:
        stop = words[2:4]
        cut = oa.completions.create(model="m", prompt="the cat sat", max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert stop not in cut.choices[0].text and words.startswith(cut.choices[0].text)
        assert tok.decode(cut.choices[0].model_extra["token_ids"]).find(stop) >= 0


def test_bad_input_is_refused_with_a_message(client, http):
    cases = [
        ({"prompt": [1, 100000]}, "out of range"),
        ({"prompt": [1, 2], "n": 1000}, "n=1000"),
        ({"prompt": [1, 2], "max_tokens": 100000}, "max_tokens=100000"),
        ({"prompt": [1, 2], "temperature": -1}, "temperature"),
        ({"prompt": [1, 2], "echo": True}, "echo"),
        ({"prompt": []}, "empty"),
        ({"max_tokens": 3}, "prompt"),
    ]
    for body, needle in cases:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert needle in r.json()["error"]["message"], (body, r.text)
    r = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 2.5}})
    assert r.status_code == 400 and "frequency_penalty must be in [-2, 2]" in r.text
    r = http.post("/v1/completions", content=b"x" * (17 * 2**20), headers={"content-type": "application/json"})
    assert r.status_code == 413
    chunked = (b"x" * 2**20 for _ in range(17))  # no content-length: counted as it arrives
    r = http.post("/v1/completions", content=chunked, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    with pytest.raises(InvalidArgument, match="out of range"):
        client.generate([[1, 99999]])
    with pytest.raises(InvalidArgument, match="top_p"):
        client.generate([[1, 2]], top_p=0.0)


def test_admin_calls_need_the_admin_token(http):
    for path, body in (("/pause", {"mode": "keep"}), ("/resume", None), ("/abort", {"all": True}),
                       ("/weights/load", {"path": "/nope", "version": "x"}), ("/rewards", {"rewards": {}})):
        assert http.post(path, json=body).status_code == 401
        assert http.post(path, json=body, headers=auth("wrong")).status_code == 401
    assert http.post("/resume", headers=auth()).status_code == 200


def test_pause_keep_and_abort(client, http):
    assert http.post("/pause", json={"mode": "keep"}, headers=auth()).json()["paused"] is True
    assert http.get("/ready").status_code == 200 and http.get("/ready").json()["paused"] is True
    assert client.server_info().paused
    client.resume()
    chunks = []
    for ev in client.stream(PROMPT, max_tokens=200, temperature=1.0, ignore_eos=True, request_id="to-abort"):
        if hasattr(ev, "rollout_id"):
            final = ev
            break
        chunks.append(ev)
        if len(chunks) == 3:
            assert client.abort("to-abort") == ["to-abort"]
    assert final.finish_reason == "abort" and 3 <= final.num_output_tokens < 200
    assert final.token_ids == [t for c in chunks for t in c.token_ids][: final.num_output_tokens]
    metrics = http.get("/metrics").text
    assert 'specroll:requests_aborted_total{reason="client"}' in metrics


def test_health_ready_openapi_reflection(server, http):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").json()["ready"] is True
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/generate", "/weights/upload", "/metrics", "/pause"} <= set(paths)
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "specroll.v1.Rollout"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=name)).status == 1
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        [resp] = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"specroll.v1.Rollout", "grpc.health.v1.Health"} <= names


def test_rollout_records_and_rewards(server, client):
    records, rewards = [], []
    server.server.hooks.on_rollout_finished.append(records.append)
    server.server.hooks.on_reward.append(lambda rid, r: rewards.append((rid, r)))
    try:
        [comp] = client.generate([[3, 4, 5]], n=2, max_tokens=6, temperature=1.0, seed=3, group_id="g1",
                                 metadata={"step": "7"})
        ids = [s.rollout_id for s in comp.samples]
        assert client.report_rewards({ids[0]: 1.0, ids[1]: 0.0}) == 2
        wait_for(lambda: len(records) >= 2 and len(rewards) >= 2, 5, "two rollout records and two rewards",
                 every=0.01)
    finally:
        server.server.hooks.on_rollout_finished.remove(records.append)
        server.server.hooks.on_reward.clear()
    by_id = {r.rollout_id: r for r in records}
    for s in comp.samples:
        rec = by_id[s.rollout_id]
        assert rec.group_id == "g1" and rec.metadata == {"step": "7"} and rec.prompt_token_ids == [3, 4, 5]
        assert rec.output_token_ids == s.token_ids and rec.logprobs == s.logprobs
        assert rec.version_spans[0].policy_version == "0" and rec.num_output_tokens == 6
    assert sorted(rewards) == sorted([(ids[0], 1.0), (ids[1], 0.0)])
    assert server.server.hooks.reward(ids[0]) == 1.0


def scrape(http: httpx.Client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def test_metrics_follow_the_traffic(client, http):
    before = scrape(http)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    client.generate(prompts, n=2, max_tokens=10, temperature=1.0, ignore_eos=True)
    after = scrape(http)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("specroll:generation_tokens_total") == 60
    assert delta("specroll:prompt_tokens_total") == 9
    assert delta("specroll:request_success_total{finished_reason=length}") == 6
    assert delta("specroll:time_to_first_token_seconds_count") == 6
    assert delta("specroll:e2e_request_latency_seconds_count") == 6
    assert delta("specroll:inter_token_latency_seconds_count") == 54
    assert delta("specroll:batch_size_count") == delta("specroll:engine_steps_total") > 0
    assert delta("specroll:batch_size_sum") == 60
    assert after["specroll:num_requests_running"] == 0 and after["specroll:paused"] == 0
    assert after["specroll:weight_version{role=target,version=0}"] == 1
    assert after["specroll:ready"] == 1
    for name in ("specroll:spec_decode_num_drafts_total", "specroll:spec_decode_num_draft_tokens_total",
                 "specroll:spec_decode_num_accepted_tokens_total", "specroll:spec_decode_mean_accepted_length"):
        assert name in after
    assert any(k.startswith("specroll:spec_decode_strategy{") for k in after)


def test_dashboard_and_deploy_files_match_the_metrics(http):
    import re
    from pathlib import Path

    import yaml
    from prometheus_client.parser import text_string_to_metric_families

    root = Path(__file__).resolve().parents[2]
    families = {f.name for f in text_string_to_metric_families(http.get("/metrics").text)}
    dashboard = (root / "deploy" / "grafana" / "specroll-dashboard.json").read_text()
    used = {re.sub(r"_(bucket|sum|count|total)$", "", m) for m in re.findall(r"specroll:[a-z0-9_]+", dashboard)}
    assert used and used <= families, used - families
    for f in (root / "deploy").rglob("*.y*ml"):
        assert list(yaml.safe_load_all(f.read_text())), f


def test_client_disconnect_aborts_the_request(server, client, http):
    before = scrape(http).get('specroll:requests_aborted_total{reason=client}', 0.0)
    stream = client.stream(PROMPT, max_tokens=200, temperature=1.0, ignore_eos=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()

    async def stop_early() -> None:
        async with AsyncSpecrollClient(server.grpc_target) as ac:
            events = ac.stream(PROMPT, max_tokens=200, temperature=1.0, ignore_eos=True)
            async for _ in events:
                break
            await events.aclose()

    asyncio.run(stop_early())
    with httpx.stream("POST", http.base_url.join("/v1/completions"),
                      json={"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
        next(r.iter_lines())

    def idle() -> ServerInfo | None:
        info = client.server_info()
        return info if info.num_running == 0 and info.num_waiting == 0 else None

    info = wait_for(idle, 10, "no request running or waiting")
    assert info.num_running == 0
    assert scrape(http)['specroll:requests_aborted_total{reason=client}'] - before == 3
