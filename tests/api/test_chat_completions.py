"""/v1/chat/completions against a real server (native backend) with a checkpoint that ships Qwen2.5's chat template:
the same tokens and logprobs as /v1/completions for the rendered prompt, streams, token-id continuations of a
multi-turn conversation, the rollout buffer's records, refusals, and the openai and LiteLLM clients unchanged."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import default_checkpoint, make_checkpoint
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from probes import wait_for
from service_utils import running, start_server

from service.api.generation import Limits
from service.app import BackgroundServer
from service.chat_template import ChatTemplates
from service.tokenizer import IM_END, Tokenizer

KEY = "chat-api-key"
TEMPLATES = Path(__file__).parent / "chat_templates"
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 77, "max_tokens": 12, "ignore_eos": True}
CHAT = [{"role": "system", "content": "the cat sat"}, {"role": "user", "content": "1 + 2 = ?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


def chat_model(root: Path, template: str = "qwen2.5-instruct.jinja") -> Path:
    """The tiny test checkpoint with a real model's chat template beside its tokenizer."""
    folder = root / f"chat-{template}"
    if not folder.exists():
        shutil.copytree(make_checkpoint("qwen2", tied=True, max_position_embeddings=1024), folder)
        shutil.copy(TEMPLATES / template, folder / "chat_template.jinja")
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[BackgroundServer]:
    yield from running(start_server(model_dir, api_token=KEY, limits=Limits(max_tokens=256),
                                    engine_kw={"max_model_len": 1024}))


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=60, headers={"authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    t = Tokenizer.from_dir(model_dir)
    assert t is not None
    return t


def events(text: str) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


def post(http: httpx.Client, body: dict, status: int = 200) -> dict:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    return r.json()


def test_chat_is_completions_on_the_rendered_prompt(http, model_dir, tok):
    """The prompt is transformers' apply_chat_template(tokenize=True) of the checkpoint; the tokens and logprobs
    (top ones too) are /v1/completions' for that prompt and seed."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    want_prompt = list(ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))
    chat = post(http, {"messages": CHAT, "n": 2, "logprobs": True, "top_logprobs": 3, **SEEDED})
    assert chat["object"] == "chat.completion" and chat["prompt_token_ids"] == want_prompt
    comp = http.post("/v1/completions", json={"prompt": want_prompt, "n": 2, "logprobs": 3, **SEEDED}).json()
    assert [c["token_ids"] for c in chat["choices"]] == [c["token_ids"] for c in comp["choices"]]
    for c, d in zip(chat["choices"], comp["choices"], strict=True):
        content = c["logprobs"]["content"]
        assert len(content) == len(c["token_ids"]) == 12 and c["finish_reason"] == "length"
        for entry, lp, top in zip(content, d["logprobs"]["token_logprobs"], d["logprobs"]["top_logprobs"],
                                  strict=True):
            assert abs(entry["logprob"] - lp) <= 1e-6
            assert {t["token"]: t["logprob"] for t in entry["top_logprobs"]} == pytest.approx(top, abs=1e-6)
            assert len(entry["top_logprobs"]) == 3 and entry["bytes"] == list(entry["token"].encode())
        assert c["message"] == {"role": "assistant", "content": d["text"]}
        assert c["rollout_id"].endswith(f":{c['index']}") and c["version_spans"][0]["policy_version"] == "0"
    assert chat["usage"]["prompt_tokens"] == 2 * len(want_prompt) and chat["usage"]["completion_tokens"] == 24


def test_streaming_gives_the_same_choices(http):
    body = {"messages": CHAT, "n": 2, "logprobs": True, **SEEDED}
    whole = post(http, body)
    r = http.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert all(e["object"] == "chat.completion.chunk" for e in evs)
    assert evs[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text, ids, lps, finish = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}, {}
    for e in evs[:-1]:
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content", "")
            ids[c["index"]] += c.get("token_ids", [])
            lps[c["index"]] += [x["logprob"] for x in (c["logprobs"] or {}).get("content", [])]
            if c["finish_reason"]:
                finish[c["index"]] = c
    for c in whole["choices"]:
        j = c["index"]
        assert ids[j] == c["token_ids"] and text[j] == c["message"]["content"]
        assert lps[j] == [x["logprob"] for x in c["logprobs"]["content"]]
        assert finish[j]["finish_reason"] == "length" and finish[j]["version_spans"] == c["version_spans"]
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == 24


def test_history_token_ids_continue_without_retokenizing(http, model_dir, tok):
    """Turn 2 sends turn 1's prompt_token_ids + token_ids as the history: the new prompt starts with them
    exactly, and its text is the whole conversation rendered (the model's own tokens kept)."""
    templates = ChatTemplates.from_dir(model_dir)
    one = post(http, {"messages": CHAT, **SEEDED})
    gen = one["choices"][0]["token_ids"]
    history = one["prompt_token_ids"] + gen
    said = tok.decode(gen)
    tool_turn = [{"role": "assistant", "content": said}, {"role": "tool", "content": "3"}]
    two = post(http, {"messages": [*CHAT, *tool_turn], "history_token_ids": history, **SEEDED})
    prompt = two["prompt_token_ids"]
    assert prompt[: len(history)] == history
    full = templates.render([*CHAT, *tool_turn], add_generation_prompt=True)
    assert tok.decode(prompt, skip_special_tokens=False) == full  # cut by length: the template's <|im_end|>\n added
    # The history ends with the stop token the model generated: only the newline after it is added
    im_end = tok.token_to_id(IM_END)
    stopped = post(http, {"messages": [*CHAT, *tool_turn], "history_token_ids": [*history, im_end], **SEEDED})
    assert stopped["prompt_token_ids"][: len(history) + 2] == [*history, im_end, *tok.encode("\n")]
    assert tok.decode(stopped["prompt_token_ids"], skip_special_tokens=False) == full
    # Turn 3 continues turn 2 the same way; the whole prompt can also be given as it is
    three_msgs = [*CHAT, *tool_turn, {"role": "assistant", "content": "x"}, {"role": "user", "content": "again"}]
    three = post(http, {"messages": three_msgs, "history_token_ids": prompt + two["choices"][0]["token_ids"],
                        **SEEDED})
    assert three["prompt_token_ids"][: len(prompt)] == prompt
    given = post(http, {"messages": CHAT, "prompt_token_ids": three["prompt_token_ids"], **SEEDED})
    assert given["prompt_token_ids"] == three["prompt_token_ids"]
    assert given["choices"][0]["token_ids"] == three["choices"][0]["token_ids"]
    err = post(http, {"messages": CHAT, "history_token_ids": history}, status=400)
    assert "assistant message" in err["error"]["message"]


def test_prime_rl_tokens_route(http):
    one = post(http, {"messages": CHAT, **SEEDED})
    r = http.post("/v1/chat/completions/tokens", json={"messages": CHAT, "tokens": one["prompt_token_ids"], **SEEDED})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == one["choices"][0]["token_ids"]


def test_chat_rollouts_reach_the_buffer_hooks(server, http):
    records = []
    server.server.hooks.on_rollout_finished.append(records.append)
    try:
        res = post(http, {"messages": CHAT, "n": 2, "group_id": "chat-g", "metadata": {"step": "3"}, "logprobs": True,
                          **SEEDED})
        wait_for(lambda: len(records) >= 2, 5, "two rollout records", every=0.01)
    finally:
        server.server.hooks.on_rollout_finished.remove(records.append)
    by_id = {r.rollout_id: r for r in records}
    for c in res["choices"]:
        rec = by_id[c["rollout_id"]]
        assert rec.group_id == "chat-g" and rec.metadata == {"step": "3"}
        assert rec.prompt_token_ids == res["prompt_token_ids"] and rec.output_token_ids == c["token_ids"]
        assert rec.logprobs == pytest.approx([x["logprob"] for x in c["logprobs"]["content"]], abs=1e-6)
        assert rec.num_output_tokens == 12


def test_tools_and_kwargs_reach_the_template_and_bad_input_is_refused(http, tok):
    with_tools = post(http, {"messages": CHAT, "tools": TOOLS, "tool_choice": "auto", **SEEDED})
    text = tok.decode(with_tools["prompt_token_ids"], skip_special_tokens=False)
    assert '"name": "add"' in text and "<tools>" in text
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    tool_msgs = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "content": "3", "tool_call_id": "c1"}]
    called = post(http, {"messages": tool_msgs, "tools": TOOLS, **SEEDED})
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in tok.decode(
        called["prompt_token_ids"], skip_special_tokens=False)
    no_gen = post(http, {"messages": CHAT, "add_generation_prompt": False, **SEEDED})
    assert not tok.decode(no_gen["prompt_token_ids"], skip_special_tokens=False).endswith("assistant\n")
    cut = post(http, {"messages": CHAT, "max_completion_tokens": 3, "temperature": 0})
    assert len(cut["choices"][0]["token_ids"]) == 3
    for body, words in (
            ({"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
            ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs without logprobs"),
            ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"messages": []}, "messages"),
            ({"messages": [{"content": "no role"}]}, "role"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "text content"),
            ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
             "not JSON"),
            ({"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
            ({"messages": CHAT, "prompt_token_ids": [1, 99999]}, "out of range"),
            ({"messages": CHAT, "max_tokens": 100000}, "max_tokens"),
            ({"messages": CHAT, "frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]")):
        err = post(http, body, status=400)["error"]
        assert words in err["message"] and err["type"] == "invalid_request_error", (body, err)
    r = httpx.post(http.base_url.join("/v1/chat/completions"), json={"messages": CHAT})
    assert r.status_code == 401


FLOATS = st.floats(allow_nan=False, allow_infinity=False)  # what JSON can carry
JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | FLOATS | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]) | JSON},
                                optional={"content": JSON | st.text(max_size=12), "tool_calls": JSON,
                                          "reasoning_content": JSON, "tool_call_id": JSON})


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate],
          derandomize=True)
@given(messages=st.lists(MESSAGE, min_size=1, max_size=4), tools=st.none() | st.lists(JSON, max_size=2),
       kwargs=st.none() | st.dictionaries(st.text(max_size=6), JSON, max_size=2),
       history=st.none() | st.lists(st.integers(0, 600), max_size=5))
def test_odd_conversations_are_answered_never_with_a_server_error(http, messages, tools, kwargs, history):
    """Whatever JSON a conversation holds, the template's failures are the request's 400, never a 5xx."""
    body = {"messages": messages, "tools": tools, "chat_template_kwargs": kwargs, "history_token_ids": history,
            "max_tokens": 2}
    r = http.post("/v1/chat/completions", json={k: v for k, v in body.items() if v is not None})
    assert r.status_code in (200, 400), r.text
    assert r.status_code == 200 or r.json()["error"]["type"] == "invalid_request_error"


def test_a_model_without_a_template_is_refused(tmp_path):
    srv = start_server(default_checkpoint())
    try:
        r = httpx.post(srv.http_url + "/v1/chat/completions", json={"messages": CHAT}, timeout=60)
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert "chat_template.jinja" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_openai_client_chat(server, http):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=server.http_url + "/v1", api_key=KEY, max_retries=0)
    res = oa.chat.completions.create(model="m", messages=CHAT, n=2, logprobs=True, top_logprobs=2, seed=77,
                                     max_tokens=12, temperature=0.9, top_p=0.95, tools=TOOLS,
                                     extra_body={"ignore_eos": True})
    raw = post(http, {"messages": CHAT, "n": 2, "logprobs": True, "top_logprobs": 2, "tools": TOOLS, **SEEDED})
    assert [c.model_extra["token_ids"] for c in res.choices] == [c["token_ids"] for c in raw["choices"]]
    assert res.model_extra["prompt_token_ids"] == raw["prompt_token_ids"]
    lp = res.choices[0].logprobs.content
    assert len(lp) == 12 and len(lp[0].top_logprobs) == 2 and lp[0].bytes == list(lp[0].token.encode())
    assert res.choices[1].message.content == raw["choices"][1]["message"]["content"]
    assert res.usage.completion_tokens == 24

    stream = oa.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    full = oa.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0)
    assert text == full.choices[0].message.content and full.choices[0].finish_reason == "length"
    words = full.choices[0].message.content
    if len(words) > 3:
        cut = oa.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, stop=[words[2:4]])
        assert cut.choices[0].finish_reason == "stop" and words.startswith(cut.choices[0].message.content)


def test_litellm_completion(server, http, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price list: no fetch from GitHub
    litellm = pytest.importorskip("litellm")
    kw = {"model": "openai/m", "api_base": server.http_url + "/v1", "api_key": KEY, "messages": CHAT,
          "max_tokens": 8, "temperature": 0}
    res = litellm.completion(**kw)
    raw = post(http, {"messages": CHAT, "max_tokens": 8, "temperature": 0})
    assert res.choices[0].message.content == raw["choices"][0]["message"]["content"]
    assert res.usage.completion_tokens == 8
    streamed = "".join(ch.choices[0].delta.content or "" for ch in litellm.completion(**kw, stream=True))
    assert streamed == raw["choices"][0]["message"]["content"]
