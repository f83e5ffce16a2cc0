"""vLLM's own counters (its Prometheus collectors live in this process) under specroll's snapshot fields, so the
metrics endpoint and the Grafana dashboard read the same names on both backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

NAMES = {
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:spec_decode_num_drafts": "spec_drafts",
    "vllm:spec_decode_num_draft_tokens": "spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "spec_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_counters() -> dict[str, Any]:
    """Totals over vLLM's engines (data parallel ranks included); empty before the engine registered them."""
    from prometheus_client import REGISTRY

    out: dict[str, Any] = {}
    per_pos: dict[int, float] = {}
    for metric in REGISTRY.collect():
        field = NAMES.get(metric.name)
        if field is None and metric.name != PER_POSITION:
            continue
        for s in metric.samples:
            if not s.name.endswith("_total"):
                continue
            if field is not None:
                out[field] = out.get(field, 0) + int(s.value)
            else:
                pos = int(s.labels.get("position", 0))
                per_pos[pos] = per_pos.get(pos, 0) + s.value
    if per_pos:
        out["accepted_per_position"] = tuple(int(per_pos[i]) for i in sorted(per_pos))
    if out.get("spec_drafts"):
        out["mean_accepted_length"] = 1 + out.get("spec_accepted_tokens", 0) / out["spec_drafts"]
    return out


def step_logger(on_step: Callable[[int, str], None], method: str) -> Any:
    """A vLLM stat-logger factory: `on_step(batch size, strategy)` once per engine step, the strategy named as
    on the native backend ("plain" or "<drafter>:k=<k>"), so `specroll:batch_size` and
    `specroll:spec_decode_strategy_steps` mean the same on both backends. vLLM calls it on AsyncLLM's output
    loop, in this process."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SpecrollSteps(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None or not scheduler_stats.num_running_reqs:
                return
            spec = scheduler_stats.spec_decoding_stats
            k = spec.num_draft_tokens // spec.num_drafts if spec is not None and spec.num_drafts else 0
            on_step(scheduler_stats.num_running_reqs, f"{method}:k={k}" if k else "plain")

        def log_engine_initialized(self) -> None:
            pass

    return SpecrollSteps
