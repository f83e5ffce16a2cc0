"""POST /generate, compatible with SGLang's native API for trainers already written against it.

One prompt with n=1 returns one object; a batch or n>1 returns a list (prompt-major, then sample). Each has
``text``, ``output_ids`` and ``meta_info`` (finish_reason {type: stop|length|abort}, weight_version,
version_spans, output_token_logprobs as [logprob, token_id, null] when return_logprob). Streams send
cumulative text and output_ids per sample (with ``index``), then ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

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
from service.api.sse import sse, stream_updates

router = APIRouter(tags=["sglang"])

_IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
_NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_new_tokens": 0}
_KNOWN = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop_token_ids", "n", "sampling_seed",
          "stop", "ignore_eos"}


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    group_id: str | None = None
    metadata: dict[str, str] | None = None


def _params(ctx: ServiceContext, sp: Any) -> tuple[Any, list[str]]:
    if not isinstance(sp, dict):
        raise InvalidRequest(f"sampling_params must be an object, got {sp!r}")
    for key, value in sp.items():
        if key in _KNOWN or key in _IGNORED:
            continue
        if key in _NEUTRAL and value in (None, _NEUTRAL[key]):
            continue
        raise InvalidRequest(f"sampling_params.{key} is not supported by this server")
    stop = make_stop(sp.get("stop"), ctx.limits)
    params = make_params(ctx.limits, n=sp.get("n"), temperature=sp.get("temperature"), top_p=sp.get("top_p"),
                         top_k=sp.get("top_k"), min_p=sp.get("min_p"), seed=sp.get("sampling_seed"),
                         max_tokens=sp.get("max_new_tokens", 128), stop_token_ids=sp.get("stop_token_ids"),
                         ignore_eos=sp.get("ignore_eos"))
    return params, stop


async def _prompts(ctx: ServiceContext, req: GenerateRequest) -> list[list[int]]:
    """The prompts as token ids (texts tokenized off the event loop), not yet validated."""
    if (req.text is None) == (req.input_ids is None):
        raise InvalidRequest("give exactly one of text and input_ids")
    texts: list[str] = []
    if req.input_ids is not None:
        ids: Any = req.input_ids
        prompts = list(ids) if ids and isinstance(ids[0], list) else [list(ids)]
    else:
        texts = [req.text] if isinstance(req.text, str) else list(req.text or [])
        prompts = texts  # type: ignore[assignment]  # counted here, tokenized below
    if not prompts or len(prompts) > ctx.limits.max_prompts:
        raise InvalidRequest(f"give 1 to {ctx.limits.max_prompts} prompts, got {len(prompts)}")
    return await ctx.tokenize(texts) if texts else prompts


def _finish(s: Sample) -> dict[str, Any] | None:
    if s.finish_reason == "length":
        return {"type": "length", "length": len(s.token_ids)}
    if s.finish_reason == "stop":
        return {"type": "stop", "matched": s.matched_stop}
    if s.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return None


def _item(gen: Generation, s: Sample, logprob: bool, started: float, index: int | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": gen.request_id, "rollout_id": s.rollout_id or f"{gen.request_id}:{s.index}",
        "finish_reason": _finish(s), "prompt_tokens": len(gen.prompt), "completion_tokens": len(s.token_ids),
        "cached_tokens": 0, "weight_version": s.policy_version,
        "version_spans": [asdict(v) for v in s.version_spans], "e2e_latency": time.monotonic() - started,
    }
    if logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.logprobs, s.token_ids, strict=True)]
    item: dict[str, Any] = {"text": s.text, "output_ids": list(s.token_ids), "meta_info": meta}
    if index is not None:
        item["index"] = index
    return item


@router.post("/generate")
async def generate(req: GenerateRequest, ctx: ApiCtx, request: Request) -> Any:
    started = time.monotonic()
    prompts = await _prompts(ctx, req)
    sps = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params or {}] * len(prompts)
    if len(sps) != len(prompts):
        raise InvalidRequest(f"{len(sps)} sampling_params for {len(prompts)} prompts")
    rids = req.rid if isinstance(req.rid, list) else None
    if rids is not None and len(rids) != len(prompts):
        raise InvalidRequest(f"{len(rids)} rids for {len(prompts)} prompts")
    base = req.rid if isinstance(req.rid, str) else uuid.uuid4().hex
    tok = ctx.tokenizer()
    gens = []
    for j, (prompt, sp) in enumerate(zip(prompts, sps, strict=True)):
        params, stop = _params(ctx, sp)
        prompt = ctx.validate(prompt, params)
        rid = rids[j] if rids is not None else (base if len(prompts) == 1 else f"{base}-{j}")
        gens.append(Generation(ctx.backend, tok, prompt, params, rid, req.group_id, req.metadata, stop,
                               whole=not req.stream))
    single = len(gens) == 1 and gens[0].params.n == 1
    if req.stream:
        return await _stream(gens, req.return_logprob, started, single)
    results = await unless_disconnected(request, run_all(gens))  # a client that left: aborted
    items = [_item(g, s, req.return_logprob, started, None) for g, r in zip(gens, results, strict=True) for s in r]
    return items[0] if single else items


async def _stream(gens: list[Generation], logprob: bool, started: float, single: bool) -> StreamingResponse:
    offsets = [0]
    for g in gens[:-1]:
        offsets.append(offsets[-1] + g.params.n)

    def render(j: int, upd: Update) -> bytes:
        s = gens[j].samples[upd.index]
        return sse(_item(gens[j], s, logprob, started, None if single else offsets[j] + upd.index))

    return await stream_updates(gens, render)
