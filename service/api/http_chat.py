"""POST /v1/chat/completions, compatible with OpenAI's API, rendered with the checkpoint's own chat template.

The prompt is the template's text (service.chat_template) tokenized without the post-processor's special tokens,
as transformers' apply_chat_template does. Every response carries ``prompt_token_ids`` and each choice its
``token_ids``, ``rollout_id`` and ``version_spans``. A multi-turn agent never re-tokenizes its own history:
``history_token_ids`` (a previous turn's prompt_token_ids + the choice's token_ids) are kept as they are and only
the messages after the last assistant message are rendered and appended. ``prompt_token_ids`` (or ``tokens``,
prime-rl's /v1/chat/completions/tokens) give the whole prompt and skip rendering. A model without a chat template
is refused with a 400 naming the files it lacks. Generation, stop strings and streams are /v1/completions' own
(service.api.generation, service.api.sse), so the tokens and logprobs are the same for the same prompt and seed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field

from service.api.context import ServiceContext
from service.api.deps import ApiCtx
from service.api.disconnect import unless_disconnected
from service.api.generation import (
    Generation,
    InvalidRequest,
    Sample,
    Update,
    check_prompt,
    check_text_size,
    make_params,
    make_stop,
    run_all,
)
from service.api.http_openai import SamplingFields
from service.api.sse import sse, stream_updates
from service.chat_template import ChatTemplateError, ChatTemplates
from service.tokenizer import Tokenizer

router = APIRouter(tags=["openai"])

# The assistant message a continuation ends with is rendered with this content, to find the text the template
# writes after an assistant message (e.g. "<|im_end|>\n") and where the new messages start.
_MARK = "\u2063specroll-assistant-end\u2063"


class ChatRequest(SamplingFields):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    response_format: dict[str, Any] | None = None
    history_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    tokens: list[int] | None = None


def _unsupported(req: ChatRequest) -> None:
    choice = req.tool_choice
    for ok, what in ((not req.logit_bias, "logit_bias"),
                     (not req.continue_final_message, "continue_final_message"),
                     (req.chat_template is None, "a chat_template in the request (the model's own is used)"),
                     (req.response_format in (None, {"type": "text"}), "response_format other than text"),
                     (choice in (None, "auto", "none"), f"tool_choice={choice!r} (forcing a tool call would "
                                                        "sample from another distribution than the policy's: use "
                                                        "auto or none)"),
                     (req.top_logprobs in (None, 0) or req.logprobs, "top_logprobs without logprobs=true")):
        if not ok:
            raise InvalidRequest(f"{what} is not supported by this server")
    if sum(x is not None for x in (req.history_token_ids, req.prompt_token_ids, req.tokens)) > 1:
        raise InvalidRequest("give at most one of history_token_ids, prompt_token_ids and tokens")


def templates_of(request: Request, ctx: ServiceContext) -> ChatTemplates:
    """The model's chat templates, read once per app; a 400 when it has none."""
    state = request.app.state
    cached = getattr(state, "chat_templates", None)
    if cached is None:
        cached = (ChatTemplates.from_dir(ctx.model().model_path),)
        state.chat_templates = cached
    if cached[0] is None:
        raise InvalidRequest(f"the model {ctx.name()!r} has no chat template (tokenizer_config.json "
                             "\"chat_template\" or chat_template.jinja): use /v1/completions")
    return cached[0]


def _content(value: Any) -> Any:
    """OpenAI content parts -> the string templates expect (text parts joined by newlines)."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"only text content parts are supported, got {part!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _arguments(call: Any) -> Any:
    """Tool-call arguments as a JSON object, the form templates write with tojson (OpenAI sends a string)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"tool call arguments are not JSON: {args[:80]!r}") from exc
    elif args is None:
        fn["arguments"] = {}
    return {**call, "function": fn}


def _messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in raw:
        if not isinstance(m.get("role"), str):
            raise InvalidRequest(f"each message needs a role, got {m!r}"[:200])
        msg = {**m, "content": _content(m.get("content"))}
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_arguments(c) for c in msg["tool_calls"]]
        out.append(msg)
    return out


class _Render:
    def __init__(self, templates: ChatTemplates, req: ChatRequest) -> None:
        self.templates, self.req = templates, req

    def __call__(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        req = self.req
        try:
            return self.templates.render(messages, tools=req.tools, documents=req.documents,
                                         add_generation_prompt=generation_prompt,
                                         variables=req.chat_template_kwargs)
        except ChatTemplateError as exc:
            raise InvalidRequest(str(exc)) from exc


def _continuation(render: _Render, tok: Tokenizer, messages: list[dict[str, Any]], history: list[int],
                  generation_prompt: bool) -> list[int]:
    """`history` (the ids up to the end of the last assistant message's generated tokens) + the rest rendered:
    the text the template writes after that message (minus a stop token the history already ends with) and
    the messages after it."""
    last = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise InvalidRequest("history_token_ids continue a conversation: messages must include the assistant "
                             "message the history ends with")
    marked = {"role": "assistant", "content": _MARK}
    head = render([*messages[:last], marked], False)
    full = render([*messages[:last], marked, *messages[last + 1:]], generation_prompt)
    if head.count(_MARK) != 1 or full.count(_MARK) != 1:
        raise InvalidRequest("the chat template does not write the assistant message's content as it is: send "
                             "prompt_token_ids instead")
    closing = head[head.index(_MARK) + len(_MARK):]
    rest = full[full.index(_MARK) + len(_MARK):]
    if not rest.startswith(closing):
        raise InvalidRequest("the chat template closes the assistant message differently once messages follow "
                             "it: send prompt_token_ids instead")
    rest = rest[len(closing):]
    ended = tok.decode(history[-1:], skip_special_tokens=False)
    if ended and closing.startswith(ended):  # the generated stop token (e.g. <|im_end|>) is already in the history
        closing = closing[len(ended):]
    return list(history) + tok.encode(closing + rest, add_special_tokens=False)


def _prompt(request: Request, ctx: ServiceContext, req: ChatRequest) -> list[int]:
    vocab = ctx.model().vocab_size
    given = req.prompt_token_ids if req.prompt_token_ids is not None else req.tokens
    if given is not None:
        return check_prompt(given, vocab)
    tok = ctx.tokenizer()
    if tok is None:
        raise InvalidRequest("this model has no tokenizer: send prompt_token_ids")
    render = _Render(templates_of(request, ctx), req)
    messages = _messages(req.messages)
    if req.history_token_ids is not None:
        history = check_prompt(req.history_token_ids, vocab)
        return check_prompt(_continuation(render, tok, messages, history, req.add_generation_prompt), vocab)
    text = render(messages, req.add_generation_prompt)
    check_text_size(text, ctx.model().max_model_len, ctx.limits)  # before tokenizing: its cost grows with the text
    return check_prompt(tok.encode(text, add_special_tokens=False), vocab)


def _entry(gen: Generation, token: int, logprob: float) -> dict[str, Any]:
    text = gen.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}


def _logprobs(gen: Generation, ids: list[int], lps: list[float], tops: list[dict[int, float]],
              want: bool) -> dict[str, Any] | None:
    if not want:
        return None
    content = []
    for j, (t, lp) in enumerate(zip(ids, lps, strict=True)):
        top = tops[j] if j < len(tops) else {}
        content.append({**_entry(gen, t, lp), "top_logprobs": [_entry(gen, k, v) for k, v in top.items()]})
    return {"content": content}


def _choice(gen: Generation, s: Sample, want: bool) -> dict[str, Any]:
    return {
        "index": s.index, "message": {"role": "assistant", "content": s.text},
        "logprobs": _logprobs(gen, s.token_ids, s.logprobs, s.top_logprobs, want),
        "finish_reason": s.finish_reason, "stop_reason": s.matched_stop,
        "token_ids": s.token_ids, "rollout_id": s.rollout_id, "version_spans": [asdict(v) for v in s.version_spans],
    }


@router.post("/v1/chat/completions")
@router.post("/v1/chat/completions/tokens")
async def chat_completions(req: ChatRequest, ctx: ApiCtx, request: Request) -> Any:
    _unsupported(req)
    prompt = await asyncio.to_thread(_prompt, request, ctx, req)  # rendering and tokenizing: off the event loop
    info = ctx.model()
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # as much as the context and the server limit leave
        max_tokens = max(1, min(ctx.limits.max_tokens, info.max_model_len - len(prompt)))
    stop = make_stop(req.stop, ctx.limits)
    params = make_params(ctx.limits, n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                         min_p=req.min_p, seed=req.seed, max_tokens=max_tokens, stop_token_ids=req.stop_token_ids,
                         ignore_eos=req.ignore_eos, top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
                         **req.penalties())
    prompt = ctx.validate(prompt, params)
    base = req.request_id or uuid.uuid4().hex
    gen = Generation(ctx.backend, ctx.tokenizer(), prompt, params, base, req.group_id, req.metadata, stop,
                     whole=not req.stream)
    head = {"id": f"chatcmpl-{base}", "created": int(time.time()), "model": ctx.name()}
    if req.stream:
        return await _stream(gen, head, req)
    [samples] = await unless_disconnected(request, run_all([gen]))  # a client that left: aborted
    completion = sum(len(s.token_ids) for s in samples)
    prompt_tokens = len(prompt) * req.n
    return {**head, "object": "chat.completion", "choices": [_choice(gen, s, req.logprobs) for s in samples],
            "prompt_token_ids": prompt,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}


async def _stream(gen: Generation, head: dict[str, Any], req: ChatRequest) -> StreamingResponse:
    chunk_head = {**head, "object": "chat.completion.chunk"}
    started: set[int] = set()

    def render(_: int, upd: Update) -> bytes:
        out = b""
        s = gen.samples[upd.index]
        if upd.index not in started:  # the first chunk of a choice names the role; the first of all the prompt
            first = {**chunk_head, "choices": [{"index": upd.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}
            if not started:
                first["prompt_token_ids"] = gen.prompt
            started.add(upd.index)
            out += sse(first)
        choice: dict[str, Any] = {
            "index": upd.index, "delta": {"content": upd.text},
            "logprobs": _logprobs(gen, upd.token_ids, upd.logprobs, upd.top_logprobs, req.logprobs),
            "finish_reason": upd.finish_reason, "token_ids": upd.token_ids, "rollout_id": s.rollout_id}
        if upd.finish_reason is not None:
            choice["stop_reason"] = s.matched_stop
            choice["version_spans"] = [asdict(v) for v in s.version_spans]
        return out + sse({**chunk_head, "choices": [choice]})

    def usage() -> list[bytes]:
        if not (req.stream_options and req.stream_options.get("include_usage")):
            return []
        completion = sum(len(s.token_ids) for s in gen.samples)
        prompt_tokens = len(gen.prompt) * req.n
        return [sse({**chunk_head, "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                     "completion_tokens": completion, "total_tokens": prompt_tokens + completion}})]

    return await stream_updates([gen], render, usage)
