"""Building vLLM's AsyncLLM from specroll's settings, and the per-batch-size speculation table.

Adaptive speculation on vLLM: vLLM fixes the method and the deepest k when the engine is built and offers one
live knob, `num_speculative_tokens_per_batch_size` (k chosen in its scheduler from the live batch size). So the
table is where adaptation happens: deep when the batch has drained to the long tail (draft work is cheap next to
a memory-bound verify pass), shallow as it fills, off when it is full (verification would spend compute the
batch needs). `--spec adaptive` measures step costs at start-up (`service/vllm/profile.py`) and re-chooses the
table from live acceptance while serving (`service/vllm/online.py`, run by specroll's scheduler subclass in
vLLM's engine core); `--spec fixed` gives one k everywhere, `--spec off` none; `--spec-table` passes a table
(JSON rows, or `default` for a fixed heuristic) that stays as given.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from service.config import EngineConfig
from service.drafter_spec import DrafterItem
from service.vllm.config import VllmConfig, check_table, engine_max_model_len, speculative_config
from service.vllm.sampling import MAX_TOP_LOGPROBS

logger = logging.getLogger(__name__)
WORKER_EXTENSION = "service.vllm.worker_ext.SpecrollWorkerExtension"  # imported by name in vLLM's workers
ONLINE_SCHEDULER = "service.vllm.scheduler.OnlineScheduler"  # ... and in its engine-core process
ONLINE_ASYNC_SCHEDULER = "service.vllm.scheduler.OnlineAsyncScheduler"


def default_table(max_num_seqs: int, max_k: int) -> list[tuple[int, int, int]]:
    """Deep in the tail, shallower as the batch fills, none when it is nearly full."""
    cuts = [(1, 4, max_k), (5, 16, max(max_k // 2, 1)), (17, 64, 1)]
    rows = [(lo, min(hi, max_num_seqs), k) for lo, hi, k in cuts if lo <= max_num_seqs]
    if max_num_seqs > 64:
        rows.append((65, max_num_seqs, 0))
    return rows


def spec_table_for(drafter: DrafterItem, config: EngineConfig, vcfg: VllmConfig) -> list[tuple[int, int, int]]:
    """The per-batch-size k table the engine is built with ([] without speculation; the heuristic table where a
    start-up profile will replace it, see `wants_profile`)."""
    if drafter.method == "none" or config.spec == "off":
        return []
    if isinstance(vcfg.spec_table, list):
        return check_table(vcfg.spec_table, vcfg.num_speculative_tokens)
    if config.spec == "fixed":
        return [(1, config.max_num_seqs, vcfg.num_speculative_tokens)]
    return default_table(config.max_num_seqs, vcfg.num_speculative_tokens)


def wants_profile(drafter: DrafterItem, config: EngineConfig, vcfg: VllmConfig) -> bool:
    return drafter.method != "none" and config.spec == "adaptive" and vcfg.spec_table is None


def engine_args(config: EngineConfig, vcfg: VllmConfig, drafter: DrafterItem,
                table: list[tuple[int, int, int]], online: dict[str, Any] | None = None) -> dict[str, Any]:
    """AsyncEngineArgs' keywords. `online` (an `OnlineDepth` as JSON) puts specroll's scheduler in vLLM's
    engine core: it re-chooses the table's k per batch size from live acceptance (`service/vllm/online.py`)."""
    spec = speculative_config(drafter, vcfg, table) if table else None
    args: dict[str, Any] = {
        "model": str(config.model), "tokenizer": str(config.model), "dtype": config.dtype,
        "max_model_len": engine_max_model_len(config.max_model_len), "max_num_seqs": config.max_num_seqs,
        "seed": config.seed,
        "logprobs_mode": "processed_logprobs", "max_logprobs": MAX_TOP_LOGPROBS,
        "tensor_parallel_size": vcfg.tensor_parallel_size, "pipeline_parallel_size": vcfg.pipeline_parallel_size,
        "data_parallel_size": vcfg.data_parallel_size, "enforce_eager": vcfg.enforce_eager,
        "gpu_memory_utilization": vcfg.gpu_memory_utilization, "speculative_config": spec,
        "enable_prefix_caching": True, "worker_extension_cls": WORKER_EXTENSION,
    }
    if not any((config.model and (Path(config.model) / f).is_file()) for f in ("tokenizer.json",
                                                                             "tokenizer_config.json")):
        args["skip_tokenizer_init"] = True  # token ids in and out: a checkpoint without a tokenizer serves too
    if vcfg.distributed_executor_backend:
        args["distributed_executor_backend"] = vcfg.distributed_executor_backend
    if str(config.device).startswith("cpu"):
        # vLLM's CPU build sizes its KV cache from a fraction of host memory; ours comes from --kv-cache-gb.
        args["kv_cache_memory_bytes"] = int(config.kv_cache_memory_gb * 2**30)
        args["gpu_memory_utilization"] = min(vcfg.gpu_memory_utilization, 0.5)
    user_additional = dict(vcfg.extra.get("additional_config") or {})
    args.update(vcfg.extra)
    if online is not None and table:
        # vLLM runs its scheduler asynchronously on GPUs (draft models included), never on CPU.
        sync = str(config.device).startswith("cpu") or vcfg.extra.get("async_scheduling") is False
        args["scheduler_cls"] = ONLINE_SCHEDULER if sync else ONLINE_ASYNC_SCHEDULER
        args["additional_config"] = user_additional | {"specroll_online": online}
    return args


def build_engine(config: EngineConfig, vcfg: VllmConfig, drafter: DrafterItem,
                 table: list[tuple[int, int, int]], stat_loggers: list[Any] | None = None,
                 online: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(the vllm module, a started AsyncLLM). Call on the event loop that will drive it."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    try:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as exc:
        raise RuntimeError("--backend vllm needs vLLM: pip install 'specroll[vllm]' (CPU machines: "
                           "bash bench/setup_vllm_venv.sh, see DEVELOPERS.md)") from exc
    if drafter.method == "suffix":
        try:
            import arctic_inference  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("--drafter suffix on vLLM needs arctic-inference, which this platform lacks; use "
                               "--drafter ngram (model-free) or the native backend's suffix drafter") from exc
    args = engine_args(config, vcfg, drafter, table, online)
    logger.info("starting vLLM %s: %s", vllm.__version__, {k: v for k, v in args.items() if k != "model"})
    return vllm, AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=stat_loggers)
