"""The one mapping from SGLang's and vLLM's request fields and control calls onto specroll's backend interface.

Each framework's route module (http_sglang, http_vllm, http_openai, http_admin) parses its own payload, then calls
these: pause modes map onto `RolloutBackend.pause` modes, fields that mean nothing here are accepted at their
neutral value and refused otherwise (400 naming the field), and an SGLang disk update without a version gets the
next number. SGLang's `retract` (requeue running requests, recompute their KV on resume) maps to `keep`: the
requests stay and go on where they were on resume, and their outputs are the same as after a requeue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from service.api.collective import default_backend
from service.api.context import ServiceContext
from service.api.generation import InvalidRequest

# framework pause mode -> RolloutBackend.pause mode
SGLANG_PAUSE = {"abort": "abort", "retract": "keep", "in_place": "keep"}
VLLM_PAUSE = {"abort": "abort", "wait": "wait", "keep": "keep"}

# The penalties every API passes to SamplingParams (which validates them).
PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")
# vLLM sampling fields with no effect here at these values (vLLM's defaults); others are refused naming the field.
VLLM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,), "min_tokens": (0,), "include_stop_str_in_output": (False,),
    "prompt_logprobs": (), "logit_bias": ({},), "allowed_token_ids": (), "bad_words": ([],),
    "truncate_prompt_tokens": (), "structured_outputs": (), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "length_penalty": (1, 1.0), "best_of": (1,),
    "echo": (False,), "suffix": (), "add_special_tokens": (True,), "output_kind": (0, 1, 2),
    "logprobs_mode": ("processed_logprobs",), "response_format": (), "cache_salt": (), "priority": (0,),
}
# Fields that only shape text or transport and change no token: accepted with any value.
VLLM_IGNORED = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "detokenize", "model", "user",
                          "stream_options", "kv_transfer_params", "extra_args", "session_id", "features"})
# SGLang sampling fields with no effect here at these values.
SGLANG_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (0,), "json_schema": (), "regex": (), "ebnf": (), "logit_bias": ({},),
}
SGLANG_IGNORED = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                            "custom_params"})  # custom_params: read by custom logit processors only, none here


def check_neutral(fields: Mapping[str, Any], neutral: Mapping[str, tuple[Any, ...]], where: str) -> None:
    """Refuse a field of `neutral` set to anything but None or one of its neutral values, naming it."""
    for key, ok in neutral.items():
        value = fields.get(key)
        if value is None or any(value == v and type(value) is type(v) for v in ok):
            continue
        raise InvalidRequest(f"{where}{key}={value!r} is not supported by this server")


def penalties(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The penalty fields a request gives (absent or null: the default), for `make_params`."""
    return {key: fields[key] for key in PENALTIES if fields.get(key) is not None}


def check_known(fields: Mapping[str, Any], known: frozenset[str] | set[str], where: str) -> None:
    """Refuse fields this server does not know at all (a typo, or a feature it lacks), naming them."""
    unknown = sorted(k for k in fields if k not in known)
    if unknown:
        raise InvalidRequest(f"{where}{unknown[0]} is not supported by this server")


def pause_mode(mode: str | None, table: Mapping[str, str], default: str) -> str:
    mode = default if mode is None else str(mode).lower()
    if mode not in table:
        raise InvalidRequest(f"mode must be one of {sorted(table)}, got {mode!r}")
    return table[mode]


async def pause(ctx: ServiceContext, mode: str, clear_cache: bool = False) -> list[str]:
    """Pause in a backend mode; `clear_cache` then drops cached KV (never with keep: kept requests need theirs)."""
    aborted = await ctx.pause(mode)
    if clear_cache and mode != "keep":
        await reset_prefix_cache(ctx)
    return aborted


async def reset_prefix_cache(ctx: ServiceContext) -> bool:
    ctx.model()
    return await asyncio.wrap_future(ctx.backend.reset_prefix_cache())


def next_version(current: str) -> str:
    """The version an update without one gets: the next integer after a numeric one, else a suffix."""
    return str(int(current) + 1) if current.isdecimal() else f"{current}+1"


def loads(ctx: ServiceContext) -> dict[str, Any]:
    """SGLang's /v1/loads: one data-parallel rank with its running and waiting requests."""
    info = ctx.model()
    stats = ctx.backend.stats()
    admission = ctx.backend.admission
    load = {"dp_rank": 0, "num_running_reqs": stats.num_running, "num_waiting_reqs": stats.num_waiting,
            "num_total_reqs": stats.num_running + stats.num_waiting, "num_used_tokens": admission.tokens,
            "max_running_requests": info.num_slots, "max_total_num_tokens": info.num_slots * info.max_model_len}
    return {"dp_rank_count": 1, "loads": [load],
            "aggregate": {k: v for k, v in load.items() if k.startswith("num_")}}


def vllm_config(ctx: ServiceContext) -> dict[str, Any]:
    """The parts of vLLM's VllmConfig dump (`/server_info?config_format=json`) that clients read."""
    info = ctx.model()
    tp, pp, dp = info.parallel
    return {
        "model_config": {"model": ctx.name(), "served_model_name": ctx.name(), "tokenizer": ctx.name(),
                         "dtype": f"torch.{info.dtype.removeprefix('torch.')}", "max_model_len": info.max_model_len,
                         "logprobs_mode": "processed_logprobs", "seed": None},
        "parallel_config": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "data_parallel_size": dp,
                            "world_size": tp * pp},
        "scheduler_config": {"max_num_seqs": info.num_slots},
        "cache_config": {"enable_prefix_caching": info.backend == "vllm"},
        "lora_config": None,
        "weight_transfer_config": {"backend": default_backend()},  # /init_weight_transfer_engine and the rest
    }


def sglang_server_info(ctx: ServiceContext) -> dict[str, Any]:
    """The fields of SGLang's /server_info that slime reads (topology, the model, its context)."""
    info = ctx.model()
    tp, pp, dp = info.parallel
    return {"tp_size": tp, "pp_size": pp, "dp_size": dp, "ep_size": 1, "num_gpus": tp * pp,
            "disaggregation_mode": "null", "encoder_only": False, "context_length": info.max_model_len,
            "served_model_name": ctx.name(), "weight_version": ctx.backend.stats().policy_version,
            "max_total_num_tokens": info.num_slots * info.max_model_len, "skip_server_warmup": True}
