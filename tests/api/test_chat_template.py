"""service.chat_template renders real models' chat templates exactly as transformers' apply_chat_template does.

The fixtures in tests/api/chat_templates/ are the published templates, taken from public repositories:
- qwen2.5-instruct.jinja: chujiezheng/chat_templates, chat_templates/qwen2.5-instruct.jinja,
  commit 06e8a5b80195d2906d6ec81056ea564c2f86622e (Qwen2.5-Instruct's template)
- qwen3.jinja: ye-NX/llama.cpp, models/templates/Qwen-Qwen3-0.6B.jinja, commit b354d7c9ecb76c97c07098617cdebbdfffa2583e
- llama-3.2-instruct.jinja: ye-NX/llama.cpp, models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja,
  commit b354d7c9ecb76c97c07098617cdebbdfffa2583e
- mistral-nemo-instruct.jinja: ye-NX/llama.cpp, models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja,
  commit b354d7c9ecb76c97c07098617cdebbdfffa2583e
- deepseek-r1-distill-qwen.jinja: ggml-org/llama.cpp, models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja,
  commit 20bdc4fac4e8779e5b73646f4b3b24a9964aa566
Both sides load the same model folder (tokenizer.json, tokenizer_config.json, the template), so the template
lookup, the special tokens and the tokenization are compared too, not only the Jinja rendering.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from service.chat_template import ChatTemplateError, ChatTemplates
from service.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "chat_templates"
# template file -> (bos, eos, other special tokens the template writes)
FAMILIES = {
    "qwen2.5-instruct.jinja": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
    "qwen3.jinja": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>", "<think>", "</think>"]),
    "llama-3.2-instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
    "mistral-nemo-instruct.jinja": ("<s>", "</s>", ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    "deepseek-r1-distill-qwen.jinja": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                       ["<｜User｜>", "<｜Assistant｜>", "<think>"]),
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, <b>now</b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Zürich or any"}},
                   "required": ["city"]}}}]
CALL = {"id": "call00001", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
CALL_TEXT = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
CONVERSATIONS = {
    "user": ([{"role": "user", "content": "hello there"}], None, {}),
    "system_user": ([{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "2 + 2 = ?"}],
                    None, {}),
    "multi_turn": ([{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "1 + 1"},
                    {"role": "assistant", "content": "2"}, {"role": "user", "content": "and 2 + 2 <é>?"}],
                   None, {}),
    "tools": ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "weather in Zürich?"},
               {"role": "assistant", "content": "", "tool_calls": [CALL]},
               {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call00001", "name": "get_weather"}],
              TOOLS, {}),
    "tools_text_arguments": ([{"role": "user", "content": "weather?"},
                              {"role": "assistant", "content": None, "tool_calls": [CALL_TEXT]},
                              {"role": "tool", "content": "sunny", "tool_call_id": "call00001"},
                              {"role": "assistant", "content": "It is sunny."},
                              {"role": "user", "content": "thanks"}], TOOLS, {}),
    "reasoning": ([{"role": "user", "content": "think"},
                   {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nyes"},
                   {"role": "user", "content": "again"},
                   {"role": "assistant", "content": "ok", "reasoning_content": "let me see"}],
                  None, {"enable_thinking": False}),
}


def _model_dir(root: Path, template: str, where: str) -> Path:
    bos, eos, extra = FAMILIES[template]
    symbols = ["<unk>", *[chr(c) for c in range(33, 127)], "é", "ü", "Z"]
    tok = HFTokenizer(models.WordLevel(vocab={s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens([t for t in (bos, eos, *extra) if t is not None])
    if bos is not None:  # like Llama 3's tokenizer.json: plain encoding adds the bos, a rendered template has its own
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    folder = root / f"{template}-{where}"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    text = (FIXTURES / template).read_text(encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "unk_token": "<unk>", "clean_up_tokenization_spaces": False}
    if where == "config":
        config["chat_template"] = text
    elif where == "named":
        config["chat_template"] = [{"name": "default", "template": text},
                                   {"name": "other", "template": "{{ messages | length }} messages"}]
    else:
        (folder / "chat_template.jinja").write_text(text, encoding="utf-8")
        config["chat_template"] = "{{ 'the file wins over this' }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_rendering_equals_transformers(template, tmp_path):
    for where in ("config", "file", "named"):
        folder = _model_dir(tmp_path, template, where)
        ours, tok = ChatTemplates.from_dir(folder), Tokenizer.from_dir(folder)
        ref = transformers.AutoTokenizer.from_pretrained(str(folder))
        assert ours is not None and tok is not None
        compared = 0
        for name, (messages, tools, kwargs) in CONVERSATIONS.items():
            kwargs = {**kwargs, "date_string": "26 Jul 2024"}
            for agp in (True, False):
                try:
                    want = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=False,
                                                   **kwargs)
                except Exception as exc:  # the template refuses this conversation: so must we
                    with pytest.raises(ChatTemplateError):
                        ours.render(messages, tools=tools, add_generation_prompt=agp, variables=kwargs)
                    assert not isinstance(exc, AssertionError)
                    continue
                got = ours.render(messages, tools=tools, add_generation_prompt=agp, variables=kwargs)
                assert got == want, (template, where, name, agp)
                ids = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=True,
                                              return_dict=False, **kwargs)
                assert tok.encode(got, add_special_tokens=False) == list(ids), (template, name, agp)
                compared += 1
        assert compared >= 8, (template, where, compared)  # most conversations render on every template


def test_llama_date_defaults_to_today_and_qwen_thinking_switch(tmp_path):
    llama = ChatTemplates.from_dir(_model_dir(tmp_path, "llama-3.2-instruct.jinja", "file"))
    before = datetime.now().strftime("%d %b %Y")
    text = llama.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    after = datetime.now().strftime("%d %b %Y")
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert f"Today Date: {before}\n" in text or f"Today Date: {after}\n" in text  # strftime_now
    qwen3 = ChatTemplates.from_dir(_model_dir(tmp_path, "qwen3.jinja", "config"))
    msgs = [{"role": "user", "content": "hi"}]
    assert qwen3.render(msgs, add_generation_prompt=True, variables={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.render(msgs, add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_named_templates_and_refusals(tmp_path):
    ours = ChatTemplates.from_dir(_model_dir(tmp_path, "qwen2.5-instruct.jinja", "named"))
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.render(msgs, template="other") == "1 messages"
    with pytest.raises(ChatTemplateError, match="no chat template named 'nope'"):
        ours.render(msgs, template="nope")
    with pytest.raises(ChatTemplateError, match="empty"):
        ours.render([])
    with pytest.raises(ChatTemplateError, match="chat_template_kwargs cannot set"):
        ours.render(msgs, add_generation_prompt=True, variables={"messages": []})
    mistral = ChatTemplates.from_dir(_model_dir(tmp_path, "mistral-nemo-instruct.jinja", "file"))
    with pytest.raises(ChatTemplateError, match="alternate user/assistant"):
        mistral.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert ChatTemplates.from_dir(tmp_path / "nothing-here") is None


def test_the_sandbox_holds(tmp_path):
    escapes = ["{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__subclasses__() }}",
               "{% set ns = namespace() %}{% set ns._x = 1 %}", "{{ messages.append(1) }}",
               "{{ dict.__call__.__globals__ }}", "{{ raise_exception('refused here') }}"]
    for src in escapes:
        with pytest.raises(ChatTemplateError):
            ChatTemplates({"default": src}).render([{"role": "user", "content": "x"}])
    safe = ChatTemplates({"default": "{{ messages[0].content | tojson }}|{{ dict(a=1) | tojson }}"
                                     "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
                                     "{{ m.content }}{% endfor %}"})
    assert safe.render([{"role": "user", "content": "<é>"}, {"role": "user", "content": "!"}]) == \
        '"<é>"|{"a": 1}!'
    blocks = ChatTemplates({"default": "{% for m in messages %}\n  {% if m %}\n{{ m.content }}\n  {% endif %}\n"
                                       "{% endfor %}"})
    assert blocks.render([{"role": "user", "content": "x"}]) == "x\n"  # trim_blocks and lstrip_blocks


@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_history_continuation_is_the_rendered_rest_on_every_template(template, tmp_path):
    """history_token_ids (the ids of turn 1's prompt + the model's reply, ending with the template's stop token)
    continued with the next messages: the history as it is, then exactly the ids of the text the whole
    conversation's rendering has after it."""
    from service.api.http_chat import ChatRequest, _continuation, _Render

    folder = _model_dir(tmp_path, template, "file")
    templates, tok = ChatTemplates.from_dir(folder), Tokenizer.from_dir(folder)
    _, eos, _ = FAMILIES[template]
    said = "2"
    follow = [{"role": "user", "content": "and 3 + 3?"}]
    if template.startswith("qwen"):
        follow = [{"role": "tool", "content": "6"}, *follow]
    turn1 = [{"role": "user", "content": "1 + 1?"}]
    conv = [*turn1, {"role": "assistant", "content": said}, *follow]
    before = templates.render(turn1, add_generation_prompt=True)
    history = [*tok.encode(before, add_special_tokens=False), *tok.encode(said, add_special_tokens=False),
               tok.token_to_id(eos)]
    full = templates.render(conv, add_generation_prompt=True)
    # DeepSeek-R1 re-renders the reply without the "<think>\n" its generation prompt wrote: the drift a
    # re-tokenized history would have; the continuation keeps the model's own tokens
    assert full.startswith(before + said + eos) == (not template.startswith("deepseek")), template
    rest = full[full.index(said + eos) + len(said + eos):]
    render = _Render(templates, ChatRequest(messages=conv))
    got = _continuation(render, tok, conv, history, True)
    assert got == history + tok.encode(rest, add_special_tokens=False), template
