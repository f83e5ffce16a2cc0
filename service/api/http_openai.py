"""POST /v1/completions, compatible with OpenAI's API (and its official Python client).

Extensions (send them with the client's ``extra_body``): top_k, min_p, repetition_penalty, stop_token_ids,
ignore_eos, group_id, request_id, metadata. Every choice also carries ``token_ids``, ``prompt_token_ids``,
``rollout_id`` and ``version_spans``; the response carries ``prompt_token_ids``. vLLM's fields:
``return_tokens_as_token_ids`` names tokens "token_id:N" in logprobs; at ``logprobs=0`` each top_logprobs entry
holds the sampled token (vLLM's convention); vLLM sampling fields with no effect here are accepted at their
neutral value (`compat.py`). Logprobs are those of the distribution each token was drawn from (after the
penalties, temperature, top-k, top-p, min-p).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from service.api.compat import VLLM_NEUTRAL, check_neutral
from service.api.context import ServiceContext
from service.api.deps import ApiCtx
from service.api.disconnect import unless_disconnected
from service.api.generation import (
    Generation,
    InvalidRequest,
    Sample,
    Update,
    make_params,
    make_stop,
    run_all,
)
from service.api.http_vllm import token_name
from service.api.sse import sse, stream_updates

router = APIRouter(tags=["openai"])


class SamplingFields(BaseModel):
    """The OpenAI sampling fields and specroll's extras that completions and chat completions share."""

    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    group_id: str | None = None
    request_id: str | None = None
    metadata: dict[str, str] | None = None

    def penalties(self) -> dict[str, float | None]:
        return {"frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                "repetition_penalty": self.repetition_penalty}


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")  # vLLM's extra fields are checked against compat's neutral values

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    return_token_ids: bool | None = None  # vLLM: token ids per choice (always sent here)
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens "token_id:N"


def _unsupported(req: CompletionRequest) -> None:
    for ok, what in ((not req.echo, "echo"), (req.best_of in (None, req.n), "best_of != n"),
                     (not req.logit_bias, "logit_bias"), (req.suffix is None, "suffix")):
        if not ok:
            raise InvalidRequest(f"{what} is not supported by this server")
    check_neutral(req.model_extra or {}, VLLM_NEUTRAL, "")


async def _prompts(ctx: ServiceContext, prompt: Any) -> list[list[int]]:
    """The prompts as token ids (texts tokenized off the event loop), not yet validated."""
    texts: list[str] = []
    prompts: list[Any] = []
    if isinstance(prompt, str):
        texts = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)
    elif prompt and all(isinstance(p, list) for p in prompt):
        prompts = list(prompt)
    else:
        prompts = [list(prompt)]
    if len(texts) + len(prompts) > ctx.limits.max_prompts:
        raise InvalidRequest(f"{len(texts) + len(prompts)} prompts exceed the server limit of "
                             f"{ctx.limits.max_prompts}")
    return await ctx.tokenize(texts) if texts else prompts


def _logprobs(gen: Generation, ids: list[int], lps: list[float], tops: list[dict[int, float]],
              offset: int, want: int | None, as_ids: bool = False) -> dict[str, Any] | None:
    if want is None:
        return None
    text = [gen.decode([t]) for t in ids]
    offsets, pos = [], offset
    for t in text:
        offsets.append(pos)
        pos += len(t)
    name = token_name if as_ids else (lambda t: gen.decode([t]))
    tokens = [name(t) for t in ids] if as_ids else text
    if want:
        top = [{name(k): v for k, v in d.items()} for d in tops]
    else:  # vLLM's convention at logprobs=0: the sampled token alone
        top = [{name(t): lp} for t, lp in zip(ids, lps, strict=True)]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def _choice(gen: Generation, s: Sample, index: int, req: CompletionRequest) -> dict[str, Any]:
    return {
        "index": index, "text": s.text, "finish_reason": s.finish_reason,
        "logprobs": _logprobs(gen, s.token_ids, s.logprobs, s.top_logprobs, 0, req.logprobs,
                              req.return_tokens_as_token_ids),
        "token_ids": s.token_ids, "prompt_token_ids": gen.prompt, "rollout_id": s.rollout_id,
        "version_spans": [asdict(v) for v in s.version_spans],
    }


@router.get("/v1/models")
async def models(ctx: ApiCtx) -> dict[str, Any]:
    info = ctx.model()
    return {"object": "list", "data": [{"id": ctx.name(), "object": "model", "created": 0, "owned_by": "specroll",
                                        "max_model_len": info.max_model_len,
                                        "weight_version": ctx.backend.stats().policy_version}]}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, ctx: ApiCtx, request: Request) -> Any:
    _unsupported(req)
    stop = make_stop(req.stop, ctx.limits)
    params = make_params(ctx.limits, n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                         min_p=req.min_p, seed=req.seed, max_tokens=req.max_tokens,
                         stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, top_logprobs=req.logprobs or 0,
                         **req.penalties())
    prompts = [ctx.validate(p, params) for p in await _prompts(ctx, req.prompt)]
    base = req.request_id or uuid.uuid4().hex
    tok = ctx.tokenizer()
    gens = [Generation(ctx.backend, tok, p, params, base if len(prompts) == 1 else f"{base}-{j}",
                       req.group_id, req.metadata, stop, whole=not req.stream) for j, p in enumerate(prompts)]
    head = {"id": f"cmpl-{base}", "object": "text_completion", "created": int(time.time()), "model": ctx.name()}
    if req.stream:
        return await _stream(gens, head, req)
    results = await unless_disconnected(request, run_all(gens))  # a client that left: aborted
    choices = [_choice(g, s, j * req.n + s.index, req) for j, (g, r) in enumerate(zip(gens, results, strict=True))
               for s in r]
    completion = sum(len(s.token_ids) for r in results for s in r)
    prompt_tokens = sum(len(p) * req.n for p in prompts)
    return {**head, "choices": choices, "prompt_token_ids": prompts if len(prompts) > 1 else prompts[0],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}


async def _stream(gens: list[Generation], head: dict[str, Any], req: CompletionRequest) -> StreamingResponse:
    offsets = [[0] * req.n for _ in gens]

    def render(j: int, upd: Update) -> bytes:
        gen = gens[j]
        lp = _logprobs(gen, upd.token_ids, upd.logprobs, upd.top_logprobs, offsets[j][upd.index], req.logprobs,
                       req.return_tokens_as_token_ids)
        offsets[j][upd.index] += len(upd.text)
        choice = {"index": j * req.n + upd.index, "text": upd.text, "logprobs": lp,
                  "finish_reason": upd.finish_reason, "token_ids": upd.token_ids,
                  "rollout_id": gen.samples[upd.index].rollout_id}
        return sse({**head, "choices": [choice]})

    def usage() -> list[bytes]:
        if not (req.stream_options and req.stream_options.get("include_usage")):
            return []
        completion = sum(len(s.token_ids) for g in gens for s in g.samples)
        prompt_tokens = sum(len(g.prompt) * req.n for g in gens)
        return [sse({**head, "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                     "completion_tokens": completion, "total_tokens": prompt_tokens + completion}})]

    return await stream_updates(gens, render, usage)
