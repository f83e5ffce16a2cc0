"""vLLM's server conventions that RL clients rely on (TRL, SkyRL, prime-rl, AReaL's vLLM mode).

Token-in, token-out generation (/inference/v1/generate: token_ids and a vLLM sampling_params object; each choice
carries token_ids and, with logprobs, content entries named "token_id:N"), the cache and topology calls
(/reset_prefix_cache, /get_world_size, /is_paused) and /tokenize, /detokenize. /pause and /resume (query or
body) and /server_info's vllm_config are in http_admin; /v1/completions' vLLM fields in http_openai. Fields
and modes map onto the backend through `service/api/compat.py`.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict

from service.api.compat import (
    PENALTIES,
    VLLM_IGNORED,
    VLLM_NEUTRAL,
    check_known,
    check_neutral,
    penalties,
    reset_prefix_cache,
)
from service.api.context import ServiceContext
from service.api.deps import AdminCtx, ApiCtx
from service.api.disconnect import unless_disconnected
from service.api.generation import Generation, InvalidRequest, Sample, check_prompt, make_params, make_stop, run_all

router = APIRouter(tags=["vllm"])

_SAMPLING = frozenset({"n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
                       "stop_token_ids", "ignore_eos", "logprobs", *PENALTIES}) | VLLM_IGNORED | set(VLLM_NEUTRAL)


def token_name(token_id: int) -> str:
    """vLLM's name of a token when `return_tokens_as_token_ids` is set."""
    return f"token_id:{token_id}"


def content_logprobs(s: Sample, want: int | None, name: Any) -> dict[str, Any] | None:
    """Chat-style logprobs: one entry per output token with its top alternatives (`name` renders a token id)."""
    if want is None:
        return None
    content = []
    for j, (tok, lp) in enumerate(zip(s.token_ids, s.logprobs, strict=True)):
        tops = s.top_logprobs[j] if want and j < len(s.top_logprobs) else {}
        content.append({"token": name(tok), "logprob": lp, "bytes": None,
                        "top_logprobs": [{"token": name(k), "logprob": v, "bytes": None} for k, v in tops.items()]})
    return {"content": content}


class GenerateTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    token_ids: list[int]
    sampling_params: dict[str, Any] | None = None
    model: str | None = None
    request_id: str | None = None
    stream: bool = False
    cache_salt: str | None = None
    features: Any = None
    group_id: str | None = None
    metadata: dict[str, str] | None = None


def vllm_params(ctx: ServiceContext, sp: dict[str, Any], where: str) -> tuple[Any, list[str], int | None]:
    """specroll's SamplingParams, stop strings and the logprobs count from a vLLM sampling_params object."""
    check_known(sp, _SAMPLING, where)
    check_neutral(sp, VLLM_NEUTRAL, where)
    want = sp.get("logprobs")
    if want is not None and (isinstance(want, bool) or not isinstance(want, int) or want < 0):
        raise InvalidRequest(f"{where}logprobs must be an integer >= 0 or null, got {want!r}")
    params = make_params(ctx.limits, n=sp.get("n"), temperature=sp.get("temperature"), top_p=sp.get("top_p"),
                         top_k=sp.get("top_k"), min_p=sp.get("min_p"), seed=sp.get("seed"),
                         max_tokens=sp.get("max_tokens", 16), stop_token_ids=sp.get("stop_token_ids"),
                         ignore_eos=sp.get("ignore_eos"), top_logprobs=want or 0, **penalties(sp))
    return params, make_stop(sp.get("stop"), ctx.limits), want


@router.post("/inference/v1/generate")
async def generate_tokens(req: GenerateTokensRequest, ctx: ApiCtx, request: Request) -> dict[str, Any]:
    """Token ids in, token ids out (SkyRL's and vLLM's disaggregated-serving generate)."""
    if req.stream:
        raise InvalidRequest("stream=true is not supported on /inference/v1/generate: use /v1/completions")
    if req.features is not None:
        raise InvalidRequest("features (multimodal inputs) are not supported by this server")
    params, stop, want = vllm_params(ctx, req.sampling_params or {}, "sampling_params.")
    prompt = ctx.validate(req.token_ids, params)
    rid = req.request_id or uuid.uuid4().hex
    gen = Generation(ctx.backend, ctx.tokenizer(), prompt, params, rid, req.group_id, req.metadata, stop,
                     text=bool(stop), whole=True)
    [samples] = await unless_disconnected(request, run_all([gen]))
    choices = [{"index": s.index, "token_ids": s.token_ids, "finish_reason": s.finish_reason,
                "logprobs": content_logprobs(s, want, token_name), "rollout_id": s.rollout_id,
                "weight_version": s.policy_version} for s in samples]
    return {"request_id": rid, "choices": choices, "prompt_logprobs": None, "kv_transfer_params": None}


class ResetCacheBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    reset_running_requests: bool = False
    reset_external: bool = False


@router.post("/reset_prefix_cache")
async def reset_cache(ctx: AdminCtx, request: Request,
                      reset_running_requests: Annotated[bool, Query()] = False) -> dict[str, bool]:
    """Drop KV cached across requests. Running requests keep theirs: outputs are the same either way."""
    body = await request.body()
    if body.strip():
        ResetCacheBody.model_validate_json(body)
    return {"success": await reset_prefix_cache(ctx)}


@router.get("/get_world_size")
async def get_world_size(ctx: ApiCtx, include_dp: Annotated[bool, Query()] = True) -> dict[str, int]:
    tp, pp, dp = ctx.model().parallel
    return {"world_size": tp * pp * (dp if include_dp else 1)}


@router.get("/is_paused")
async def is_paused(ctx: ApiCtx) -> dict[str, bool]:
    ctx.model()
    return {"is_paused": ctx.backend.stats().paused}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str | None = None
    messages: list[Any] | None = None
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tokens: list[int]
    model: str | None = None


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, ctx: ApiCtx) -> dict[str, Any]:
    if req.messages is not None:
        raise InvalidRequest("messages are not tokenized here: /v1/chat/completions renders them with the model's "
                             "chat template and returns prompt_token_ids; send prompt to tokenize text")
    if req.prompt is None:
        raise InvalidRequest("give prompt")
    if not req.add_special_tokens:
        raise InvalidRequest("add_special_tokens=false is not supported: the tokenizer's post-processor decides")
    [tokens] = await ctx.tokenize([req.prompt])
    tok = ctx.tokenizer()
    strs = [tok.decode([t], skip_special_tokens=False) for t in tokens] if req.return_token_strs and tok else None
    return {"count": len(tokens), "max_model_len": ctx.model().max_model_len, "tokens": tokens, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, ctx: ApiCtx) -> dict[str, str]:
    tokens = check_prompt(req.tokens, ctx.model().vocab_size) if req.tokens else []
    tok = ctx.tokenizer()
    if tok is None:
        raise InvalidRequest("this model has no tokenizer: nothing to detokenize with")
    return {"prompt": tok.decode(tokens)}
