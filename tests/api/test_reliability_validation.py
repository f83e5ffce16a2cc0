"""Bad requests against a real server: one shared validation of sampling parameters for gRPC, OpenAI and SGLang
(400 / INVALID_ARGUMENT with a message, never 500), requests the model cannot honour refused at submission, and
one bad request never failing the others."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from helpers import default_checkpoint
from service_utils import ADMIN, MAX_MODEL_LEN, auth

from client import AsyncSpecrollClient
from client.errors import InvalidArgument
from service.config import EngineConfig
from service.engine.llm_engine import LLMEngine
from service.params import SamplingError, SamplingParams

GOOD: dict[str, Any] = {"temperature": 1.0, "seed": 9, "max_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_checkpoint(tied=False)


def test_top_logprobs_over_vocab_fails_only_its_own_request(server):
    async def run() -> tuple[list[Any], Any]:
        async with AsyncSpecrollClient(server.grpc_target, admin_token=ADMIN, retries=0) as c:
            vocab = (await c.server_info()).vocab_size
            good = [asyncio.ensure_future(c.generate_one([1, 2, i], **GOOD)) for i in range(8)]
            bad = [asyncio.ensure_future(c.generate_one([3, 4], top_logprobs=vocab + 1, **GOOD)) for _ in range(3)]
            return await asyncio.gather(*good), await asyncio.gather(*bad, return_exceptions=True)

    good, bad = asyncio.run(run())
    assert all(len(c.samples[0].token_ids) == GOOD["max_tokens"] for c in good)
    for err in bad:
        assert isinstance(err, InvalidArgument) and "vocabulary" in str(err), err


def test_engine_refuses_top_logprobs_over_vocab(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=64, max_num_seqs=4))
    with pytest.raises(SamplingError, match="vocabulary"):
        engine.add_request([1, 2], SamplingParams(top_logprobs=engine.model_config.vocab_size + 1))


def test_prompt_plus_max_tokens_over_context_is_refused_on_every_api(server):
    prompt = list(range(1, 201))
    too_many = MAX_MODEL_LEN - len(prompt) + 1

    async def grpc_call() -> None:
        async with AsyncSpecrollClient(server.grpc_target, admin_token=ADMIN, retries=0) as c:
            with pytest.raises(InvalidArgument, match="max_model_len"):
                await c.generate_one(prompt, max_tokens=too_many)
            ok = await c.generate_one(prompt, max_tokens=too_many - 1, ignore_eos=True)  # exactly fits
            assert len(ok.samples[0].token_ids) == too_many - 1
            assert ok.samples[0].finish_reason == "length"

    asyncio.run(grpc_call())
    with httpx.Client(base_url=server.http_url, headers=auth(), timeout=60) as h:
        r = h.post("/v1/completions", json={"prompt": prompt, "max_tokens": too_many})
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
        r = h.post("/v1/completions", json={"prompt": prompt, "max_tokens": too_many, "stream": True})
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
        r = h.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": too_many}})
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
        r = h.post("/generate", json={"input_ids": prompt[:10], "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200


BAD_SGLANG = [
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop": 5}, "stop"), ({"stop": ["a", 3]}, "stop"),
    ({"n": 1.7}, "n must be an integer"), ({"top_k": 2.5}, "top_k"), ({"top_k": 1e30}, "top_k"),
    ({"top_k": 10**30}, "top_k"), ({"ignore_eos": "yes"}, "ignore_eos"), ({"temperature": "hot"}, "temperature"),
    ({"max_new_tokens": "8"}, "max_tokens"), ({"sampling_seed": 1.5}, "seed"), ({"min_p": None, "top_p": 2}, "top_p"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"), ({"stop_token_ids": [10**9]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("sp", "needle"), BAD_SGLANG, ids=[str(sp) for sp, _ in BAD_SGLANG])
def test_sglang_sampling_params_are_type_checked(server, sp, needle):
    r = httpx.post(server.http_url + "/generate", headers=auth(), timeout=60,
                   json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, **sp}})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


BAD_OPENAI = [
    ({"stop_token_ids": [1, "x"]}, "stop_token_ids"), ({"n": 1.5}, "n"), ({"top_k": 10**30}, "top_k"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("body", "needle"), BAD_OPENAI, ids=[str(b) for b, _ in BAD_OPENAI])
def test_openai_bad_params_are_400(server, body, needle):
    r = httpx.post(server.http_url + "/v1/completions", headers=auth(), timeout=60,
                   json={"prompt": [1, 2, 3], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_grpc_bad_params_are_invalid_argument(server):
    async def run() -> None:
        async with AsyncSpecrollClient(server.grpc_target, admin_token=ADMIN, retries=0) as c:
            for kw, needle in (({"temperature": -1.0}, "temperature"), ({"stop_token_ids": [10**6]}, "stop_token_ids"),
                               ({"max_tokens": 0}, "max_tokens")):
                with pytest.raises(InvalidArgument, match=needle):
                    await c.generate_one([1, 2], **kw)

    asyncio.run(run())


def test_sampling_params_types_are_checked_once_for_all():
    for kw in ({"n": 1.7}, {"top_k": 2.5}, {"ignore_eos": "yes"}, {"stop_token_ids": 5}, {"raw_logprobs": 1},
               {"temperature": float("nan")}, {"max_tokens": True}):
        with pytest.raises(SamplingError):
            SamplingParams(**kw)
    assert SamplingParams(temperature=1, top_k=-1).top_k == 0


def test_grpc_status_code_is_invalid_argument_not_internal(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        call = ch.unary_stream("/specroll.v1.Rollout/Generate", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            list(call(b"\x0a\x05\xff\xff", metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "corrupt" in err.value.details()
    with grpc.insecure_channel(server.grpc_target) as ch:
        call = ch.unary_unary("/specroll.v1.Rollout/GetServerInfo", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            call(b"\x0a\x05\xff", metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_request_failing_in_the_step_ends_alone(model_dir, monkeypatch):
    """Fault injection: postprocessing raises for one request; it ends (abort, error kept), the others finish
    with exactly the tokens they get without it."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=64, max_num_seqs=8))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    want = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    real = engine._append

    def failing(seq, tokens, *rest):
        if seq.request_id == "bad" and len(seq.output_token_ids) >= 3:
            raise RuntimeError("injected")
        real(seq, tokens, *rest)

    monkeypatch.setattr(engine, "_append", failing)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.add_request([5, 5, 5], params, request_id="bad")
    reqs = {rid: engine.requests[rid] for rid in [*ids, "bad"]}
    failures: dict[str, str] = {}
    while engine.has_unfinished():
        engine.step()
        failures.update(engine.take_failures())
    assert [reqs[rid].seqs[0].output_token_ids for rid in ids] == want
    assert reqs["bad"].seqs[0].finish_reason.value == "abort"
    assert failures == {"bad": "request failed: injected"}


def test_a_rollout_the_buffer_cannot_take_is_counted():
    from service.backend.hooks import Hooks
    from service.backend.metrics import Metrics
    from service.engine.loop import EngineLoop

    metrics, hooks = Metrics(), Hooks()
    EngineLoop(lambda: None, metrics, hooks)  # wires the hooks to the metrics; never started
    taken: list[Any] = []

    def flaky(record: Any) -> None:
        if record == "unencodable":
            raise ValueError("cannot encode")
        taken.append(record)

    hooks.on_rollout_finished.append(flaky)
    hooks.start()
    delivered: list[str] = []
    for rec in ("a", "unencodable", "b"):
        hooks.rollout_finished(rec, lambda rec=rec: delivered.append(rec))  # type: ignore[arg-type]
    hooks.stop()
    assert taken == ["a", "b"]
    assert delivered == ["a", "unencodable", "b"]  # the client still gets every sample
    assert "specroll:rollouts_unrecorded_total 1.0" in metrics.render().decode()


def test_admin_token_from_a_file_and_fractional_upload_limit(tmp_path, monkeypatch, caplog):
    from service.cli import build_parser, read_secret

    monkeypatch.delenv("SPECROLL_ADMIN_TOKEN", raising=False)
    secret = tmp_path / "admin.token"
    secret.write_text("from-a-file\n")
    args = build_parser().parse_args(["serve", "--admin-token-file", str(secret), "--max-upload-gb", "0.5"])
    assert read_secret(args, "admin_token") == "from-a-file"
    assert args.max_upload_gb == 0.5
    monkeypatch.setenv("SPECROLL_ADMIN_TOKEN_FILE", str(secret))
    assert read_secret(build_parser().parse_args(["serve"]), "admin_token") == "from-a-file"
    monkeypatch.delenv("SPECROLL_ADMIN_TOKEN_FILE")
    with caplog.at_level("WARNING"):
        assert read_secret(build_parser().parse_args(["serve", "--admin-token", "on-argv"]), "admin_token") == "on-argv"
    assert "process table" in caplog.text


def test_openapi_schema_matches_what_the_server_sends(server):
    schema = httpx.get(server.http_url + "/openapi.json").json()
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (path, method)
    assert "400" in schema["paths"]["/v1/completions"]["post"]["responses"]
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    body = schema["paths"]["/weights/upload"]["post"]["requestBody"]
    assert "application/octet-stream" in body["content"]
    r = httpx.post(server.http_url + "/v1/completions", headers=auth(), json={"prompt": [1], "max_tokens": "x"})
    assert r.status_code == 400


def test_streaming_completion_chunks_carry_the_rollout_id(server):
    import json

    with httpx.stream("POST", server.http_url + "/v1/completions", headers=auth(), timeout=60,
                      json={"prompt": [1, 2, 3], "max_tokens": 6, "n": 2, "stream": True, "request_id": "rid-s"}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for ch in chunks for c in ch["choices"]]
    assert choices and all(c["rollout_id"] == f"rid-s:{c['index']}" for c in choices)
