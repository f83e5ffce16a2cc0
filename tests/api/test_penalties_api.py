"""Penalties through every API of a real server with speculative decoding on, driven by the frameworks' own clients
(the openai package, TRL 1.16's VLLMClient, specroll's gRPC client) and SGLang's and SkyRL's payloads: each
returns the tokens and logprobs the offline engine gives without speculation, and out-of-range values are
refused with a message naming the field. TRL sends `repetition_penalty` in every request (1.0 by default)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from service_utils import start_server
from test_chat_completions import CHAT, chat_model
from test_dropin_vllm import import_trl

from client import SpecrollClient
from client.errors import InvalidArgument
from service.app import BackgroundServer
from service.config import EngineConfig
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams

PROMPT = [5, 17, 42, 99, 7, 5, 17]
NEW = 16
PEN = {"frequency_penalty": 1.25, "presence_penalty": 0.5, "repetition_penalty": 1.5}  # exact in float32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return chat_model(tmp_path_factory.mktemp("penalties"))


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[BackgroundServer]:
    """The target drafting for itself, three drafts a step: penalised verify positions on every request."""
    srv = start_server(model_dir, control_auth="none", engine_kw={
        "max_model_len": 1024, "drafter": str(model_dir), "spec": "fixed", "spec_k": 3, "enforce_eager": True})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(model_dir):
    """The target alone (no speculation): greedy tokens and logprobs of a prompt, with or without PEN."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=1024, drafter="none", enforce_eager=True))

    def run(prompt: list[int], penalised: bool = True) -> tuple[list[int], list[float]]:
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **(PEN if penalised else {}))
        [out] = engine.generate([prompt], params)
        return out.outputs[0].token_ids, out.outputs[0].logprobs

    return run


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) < 1e-4 for a, b in zip(got, want, strict=True))


def test_every_api_applies_the_penalties(server, http, offline):
    want, want_lp = offline(PROMPT)
    assert want != offline(PROMPT, penalised=False)[0]  # the penalties change these tokens
    oa = openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0)
    r = oa.completions.create(model="m", prompt=PROMPT, max_tokens=NEW, temperature=0, logprobs=0,
                              frequency_penalty=PEN["frequency_penalty"], presence_penalty=PEN["presence_penalty"],
                              extra_body={"repetition_penalty": PEN["repetition_penalty"], "ignore_eos": True})
    choice = r.choices[0].model_dump()
    assert choice["token_ids"] == want and close(choice["logprobs"]["token_logprobs"], want_lp)

    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True, **PEN}
    out = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True}).json()
    assert out["output_ids"] == want
    assert close([x[0] for x in out["meta_info"]["output_token_logprobs"]], want_lp)

    sky = {"token_ids": PROMPT, "sampling_params": {"max_tokens": NEW, "temperature": 0, "ignore_eos": True, **PEN}}
    assert http.post("/inference/v1/generate", json=sky).json()["choices"][0]["token_ids"] == want

    with SpecrollClient(server.grpc_target) as c:
        s = c.generate_one(PROMPT, max_tokens=NEW, temperature=0.0, ignore_eos=True, **PEN).samples[0]
    assert s.token_ids == want and close(s.logprobs, want_lp)

    vllm_client = import_trl("trl.generation.vllm_client")
    with pytest.MonkeyPatch.context() as mp:  # TRL's check that vllm is installed (it only talks HTTP here)
        mp.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
        trl = vllm_client.VLLMClient(base_url=server.http_url, connection_timeout=60)
        got = trl.generate([PROMPT], temperature=0.0, max_tokens=NEW, logprobs=0,
                           repetition_penalty=PEN["repetition_penalty"],
                           generation_kwargs={"ignore_eos": True, "frequency_penalty": PEN["frequency_penalty"],
                                              "presence_penalty": PEN["presence_penalty"]})
    assert got["completion_ids"] == [want] and close([x[0] for x in got["logprobs"][0]], want_lp)
    # TRL's default (repetition_penalty=1.0, no others) is plain decoding
    plain = trl.generate([PROMPT], temperature=0.0, max_tokens=NEW, generation_kwargs={"ignore_eos": True})
    assert plain["completion_ids"] == [offline(PROMPT, penalised=False)[0]]


def test_chat_applies_the_penalties(server, offline):
    oa = openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0)
    r = oa.chat.completions.create(model="m", messages=CHAT, max_tokens=NEW, temperature=0,
                                   frequency_penalty=PEN["frequency_penalty"],
                                   presence_penalty=PEN["presence_penalty"],
                                   extra_body={"repetition_penalty": PEN["repetition_penalty"], "ignore_eos": True})
    body = r.model_dump()
    assert body["choices"][0]["token_ids"] == offline(body["prompt_token_ids"])[0]


def test_out_of_range_penalties_are_refused_on_every_api(server, http):
    bad = (("frequency_penalty", 2.5, "[-2, 2]"), ("presence_penalty", -3, "[-2, 2]"),
           ("repetition_penalty", 0, "> 0"), ("frequency_penalty", "high", "number"))
    for key, value, words in bad:
        for path, body in (
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, key: value}),
                ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, key: value}),
                ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, key: value}}),
                ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, key: value}})):
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, key, r.text)
            assert key in r.json()["error"]["message"] and words in r.json()["error"]["message"], r.text
        with SpecrollClient(server.grpc_target) as c:
            if isinstance(value, str):
                continue  # a proto float field cannot hold a string
            with pytest.raises(InvalidArgument, match=key):
                c.generate_one(PROMPT, max_tokens=2, **{key: value})
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200  # still up
