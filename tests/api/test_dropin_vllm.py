"""vLLM's server conventions, driven by the clients that rely on them: TRL 1.16's VLLMClient (generation and its
async GRPO client), the openai package, LiteLLM, and SkyRL's /inference/v1/generate payload.

SkyRL payloads: NovaSky-AI/SkyRL a9564572eb8e91076be43c1bd5e4615e3de17265,
skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py (`generate`: token_ids + sampling_params,
`sample`: logprobs 0 and output_kind 2; `pause`: /pause?mode=keep&clear_cache=false, no body).
AReaL's vLLM mode: inclusionAI/AReaL 4aef98d8d818af55b43621aaadba047ae10f4e77, areal/engine/vllm_remote.py
(`build_generation_request`: /v1/completions with return_tokens_as_token_ids, logprobs 0, use_beam_search false).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from probes import wait_for
from service_utils import running, start_server

from service.app import BackgroundServer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # the async GRPO client lives in trl.experimental
PROMPTS = [[5, 17, 42, 99, 7], [3, 8, 13]]
SEED = 4321


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[BackgroundServer]:
    yield from running(start_server(model_dir, control_auth="none", engine_kw={"enforce_eager": True}))


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        yield c


def plain_completions(http: httpx.Client, prompt: list[int], n: int, max_tokens: int) -> list[dict]:
    """What /v1/completions returns without any vLLM field: the reference the vLLM-style surfaces must equal."""
    r = http.post("/v1/completions", json={"prompt": prompt, "n": n, "max_tokens": max_tokens, "seed": SEED,
                                           "temperature": 0.9, "logprobs": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def import_trl(module: str) -> Any:
    """A TRL module, imported while pytest's tests/ folder (which holds a `vllm` test package that
    TRL's import check would take for vLLM itself) is off sys.path."""
    tests_dir = str(Path(__file__).resolve().parents[1])
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != tests_dir]
    try:
        return importlib.import_module(module)
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def trl_client(server):
    vllm_client = import_trl("trl.generation.vllm_client")
    # TRL's VLLMClient refuses to start unless the vllm package is installed; it only talks HTTP to the server, so
    # that check (and nothing else) is patched for this test.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
        yield vllm_client.VLLMClient(base_url=server.http_url, connection_timeout=60)


def test_trl_generate_equals_completions(trl_client, http):
    out = trl_client.generate(PROMPTS, n=2, temperature=0.9, max_tokens=12, logprobs=0,
                              generation_kwargs={"seed": SEED, "ignore_eos": True})
    assert out["prompt_ids"] == PROMPTS
    for j, prompt in enumerate(PROMPTS):
        want = plain_completions(http, prompt, 2, 12)
        for i, ref in enumerate(want):
            got = 2 * j + i
            assert out["completion_ids"][got] == ref["token_ids"]
            assert out["logprob_token_ids"][got] == [[t] for t in ref["token_ids"]]
            torch.testing.assert_close(torch.tensor(out["logprobs"][got]).squeeze(-1),
                                       torch.tensor(ref["logprobs"]["token_logprobs"]), atol=1e-6, rtol=0)


def test_trl_control_calls(trl_client, server):
    async_client = import_trl("trl.experimental.async_grpo.vllm_client")
    assert trl_client.get_world_size() == 1
    info = trl_client.get_server_info()
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"  # what GRPO's IS correction checks
    assert info["model_config"]["max_model_len"] == 256 and info["weight_transfer_config"] == {"backend": "gloo"}
    trl_client.reset_prefix_cache()
    client = async_client.VLLMClient(server.http_url)
    assert client.get_dtype() == "torch.float32" and client.get_world_size() == 1
    client.pause()  # POST /pause?mode=keep, no body
    assert server.server.backend.stats().paused
    client.resume()
    assert not server.server.backend.stats().paused


def test_keep_pause_by_query_keeps_running_requests(http, server):
    """SkyRL's pause: ?mode=keep&clear_cache=false with no body; the running request goes on where it was and its
    tokens are those of an unpaused run."""
    want = plain_completions(http, PROMPTS[0], 1, 240)[0]
    box: dict = {}

    def run() -> None:
        box["r"] = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 240, "seed": SEED,
                                                      "temperature": 0.9, "logprobs": 0, "ignore_eos": True})

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: server.server.backend.stats().num_running > 0 or not t.is_alive(), 60,
             "the engine to run the request", every=0.002)
    r = http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    assert r.status_code == 200 and r.json()["status"] == "paused" and r.json()["aborted"] == []
    assert server.server.backend.stats().num_running == 1  # kept, not aborted or finished
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").json()["status"] == "resumed"
    t.join(300)
    got = box["r"].json()["choices"][0]
    assert got["finish_reason"] == "length" and got["token_ids"] == want["token_ids"]
    r = http.post("/pause", params={"mode": "nap"})
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]


def test_skyrl_generate_payload(http):
    sampling = {"n": 2, "logprobs": 0, "output_kind": 2, "prompt_logprobs": None, "temperature": 0.9,
                "max_tokens": 12, "seed": SEED, "ignore_eos": True, "skip_special_tokens": True}
    r = http.post("/inference/v1/generate", json={"sampling_params": sampling, "model": "policy",
                                                  "token_ids": PROMPTS[0]})
    assert r.status_code == 200, r.text
    want = plain_completions(http, PROMPTS[0], 2, 12)
    for choice, ref in zip(r.json()["choices"], want, strict=True):
        assert choice["token_ids"] == ref["token_ids"]
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in ref["token_ids"]]
        torch.testing.assert_close(torch.tensor([c["logprob"] for c in content]),
                                   torch.tensor(ref["logprobs"]["token_logprobs"]), atol=1e-6, rtol=0)
    for bad in ({"presence_penalty": 3.0}, {"use_beam_search": True}, {"best_of": 3}, {"nonsense": 1}):
        r = http.post("/inference/v1/generate", json={"sampling_params": {"max_tokens": 2, **bad},
                                                      "token_ids": PROMPTS[0]})
        assert r.status_code == 400 and next(iter(bad)) in r.json()["error"]["message"], r.text


def test_areal_vllm_completions_payload(http):
    payload = {"top_p": 1.0, "top_k": 100000000, "max_tokens": 8, "temperature": 0.9, "stop_token_ids": [],
               "ignore_eos": True, "skip_special_tokens": True, "return_tokens_as_token_ids": True, "logprobs": 0,
               "use_beam_search": False, "stream": False, "prompt": PROMPTS[1], "seed": SEED}
    r = http.post("/v1/completions", json=payload)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # AReaL's parser: int(t.split(":")[1]) for each logprobs token
    assert [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]] == choice["token_ids"]
    assert choice["token_ids"] == plain_completions(http, PROMPTS[1], 1, 8)[0]["token_ids"]


def test_openai_and_litellm_vllm_fields(server):
    import litellm
    import openai

    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="none")
    out = client.completions.create(model="policy", prompt=PROMPTS[0], max_tokens=6, logprobs=0, seed=SEED,
                                    extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.model_extra["prompt_token_ids"] == PROMPTS[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert choice.logprobs.top_logprobs == [{f"token_id:{t}": lp} for t, lp in
                                            zip(ids, choice.logprobs.token_logprobs, strict=True)]
    resp = litellm.text_completion(model="text-completion-openai/policy", api_base=server.http_url + "/v1",
                                   api_key="none", prompt=PROMPTS[0], max_tokens=6, logprobs=0, seed=SEED,
                                   extra_body={"return_tokens_as_token_ids": True})
    assert resp.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]


def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"prompt": "hello world", "model": "policy"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == "hello world"
    assert http.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 400


def test_verl_server_manager_example(server, http):
    """examples/verl: verl's generate(request_id, prompt_ids, sampling_params) call returns the tokens and logprobs
    /v1/completions gives for the same prompt and seed."""
    import asyncio

    from examples.verl.server_manager import rollout_batch

    outs = asyncio.run(rollout_batch(server.http_url, [PROMPTS[0]], {"temperature": 0.9, "max_tokens": 12,
                                                                    "seed": SEED, "ignore_eos": True}))
    [ref] = plain_completions(http, PROMPTS[0], 1, 12)
    assert outs[0].response_ids == ref["token_ids"] and outs[0].response_mask == [1] * 12
    torch.testing.assert_close(torch.tensor(outs[0].response_logprobs),
                               torch.tensor(ref["logprobs"]["token_logprobs"]), atol=1e-6, rtol=0)


def test_openrlhf_loop_example(server):
    """examples/openrlhf: one step of the loop (generate, reward, update, push) against the server."""
    from examples.openrlhf.loop import LoopConfig, run

    before = server.server.backend.stats().policy_version
    means = run(LoopConfig(server=server.grpc_target, model=str(server.server.backend.info().model_path), steps=1,
                           prompts_per_step=1, n=2, max_tokens=8))
    assert len(means) == 1 and server.server.backend.stats().policy_version == "step-1" != before
