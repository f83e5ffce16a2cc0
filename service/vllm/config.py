"""Settings of the vLLM backend, and how specroll's `--drafter` maps onto vLLM's speculative methods.

Nothing here imports vllm: the CLI and the server build and check this config whether or not the optional
extra is installed; `service/vllm/engine.py` turns it into vLLM's engine arguments.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.drafter_spec import HEADS, MODEL_FREE, NO_DRAFTER, DrafterItem, DrafterSpec

# Speculative settings never allowed: they change what is sampled (forced acceptance, relaxed checks).
LOSSY = {"rejection_sample_method": ("synthetic", "fly"), "synthetic_acceptance_rates": None,
         "synthetic_acceptance_length": None}


class VllmConfigError(ValueError):
    """A vLLM setting this backend refuses; the message says why."""


@dataclass(slots=True)
class VllmConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # mp | ray (multi-node) | None (vLLM's choice)
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = False  # no CUDA graphs (GPU); vLLM's CPU build decides on its own
    num_speculative_tokens: int = 4  # the deepest k; the per-batch-size table picks k <= this
    # [(first batch size, last, k)]; "default": the heuristic table; None: from --spec (adaptive: profiled)
    spec_table: list[tuple[int, int, int]] | str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more AsyncEngineArgs fields (JSON object)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "num_speculative_tokens"):
            if int(getattr(self, name)) < 1:
                raise VllmConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.distributed_executor_backend not in (None, "mp", "ray", "uni"):
            raise VllmConfigError(f"distributed_executor_backend must be mp, ray or uni, got "
                                  f"{self.distributed_executor_backend!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise VllmConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for key in ("speculative_config", "logprobs_mode", "model", "tokenizer", "seed", "worker_extension_cls",
                    "scheduler_cls"):
            if key in self.extra:
                raise VllmConfigError(f"--vllm-arg {key} is set by specroll itself (use --drafter, --spec, --model, "
                                      "--seed); logprobs are always those of the processed distribution; its "
                                      "workers carry specroll's extension (drafter weight pushes)")
        if self.spec_table in ("profile", None):
            self.spec_table = None
        elif self.spec_table != "default":
            if not isinstance(self.spec_table, list):
                raise VllmConfigError(f"--spec-table is profile, default or JSON rows, got {self.spec_table!r}")
            self.spec_table = check_table(self.spec_table, self.num_speculative_tokens)


AUTO_FIT = -1  # vLLM's max_model_len that means: the checkpoint's context length, cut to what the KV cache holds


def engine_max_model_len(max_model_len: int | None) -> int:
    """vLLM's max_model_len for specroll's: a set value as is; unset, vLLM's auto-fit (it derives the context length
    from the checkpoint, caps it by the KV cache and logs why)."""
    return AUTO_FIT if max_model_len is None else max_model_len


def check_table(table: list[Any], max_k: int) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for row in table:
        if len(row) != 3 or not all(isinstance(v, int) and v >= 0 for v in row):
            raise VllmConfigError(f"speculation table rows are [first batch size, last, k] of integers >= 0, "
                                  f"got {row!r}")
        lo, hi, k = row
        if lo < 1 or hi < lo or k > max_k:
            raise VllmConfigError(f"bad speculation table row {row}: need 1 <= first <= last and k <= {max_k}")
        if out and lo != out[-1][1] + 1:
            raise VllmConfigError(f"speculation table rows must cover consecutive batch sizes, got {table}")
        out.append((lo, hi, k))
    return out


def vllm_drafter(spec: DrafterSpec, model_dir: Path) -> DrafterItem:
    """`--drafter` on the vLLM backend: none | ngram | suffix | mtp | eagle:DIR | eagle3:DIR | a draft-model
    folder (relative: to the model folder if it is there). "auto" is ngram (model-free: sibling rollouts of a
    GRPO group repeat each other), plus nothing else: vLLM runs one speculative method per engine."""
    items = spec.expand_auto(DrafterItem("ngram")).items
    if not items:
        return NO_DRAFTER
    if len(items) > 1:
        raise VllmConfigError(f"the vLLM backend runs one drafter per engine; got {[i.as_flag() for i in items]} "
                              "(the native backend chooses among several per step)")
    item = items[0]
    if item.method in (*MODEL_FREE, "mtp"):
        return item
    if item.method in HEADS:
        if item.path is None:
            raise VllmConfigError(f"--drafter {item.method}: vLLM needs a trained head folder, {item.method}:DIR")
        if not (Path(item.path) / "config.json").is_file():
            raise VllmConfigError(f"--drafter {item.as_flag()}: no EAGLE head folder with config.json at "
                                  f"{item.path!r}")
        return DrafterItem(item.method, str(Path(item.path).resolve()))
    flag = item.as_flag()
    folder = Path(flag) if Path(flag).is_absolute() else (model_dir / flag if (model_dir / flag).is_dir()
                                                           else Path(flag))
    if item.method != "draft_model" or not (folder / "config.json").is_file():
        raise VllmConfigError(f"--drafter {flag!r} is none, auto, ngram, suffix, mtp, eagle:DIR, eagle3:DIR or a "
                              "draft-model folder with config.json")
    return DrafterItem("draft_model", str(folder.resolve()))


def speculative_config(drafter: DrafterItem, cfg: VllmConfig, table: list[tuple[int, int, int]] | None,
                       ) -> dict[str, Any] | None:
    """vLLM's speculative_config for this drafter and per-batch-size table (None: no speculation)."""
    if drafter.method == "none":
        return None
    spec: dict[str, Any] = {"method": drafter.method, "num_speculative_tokens": cfg.num_speculative_tokens}
    if drafter.method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=4)
    if drafter.path is not None:
        spec["model"] = drafter.path
    if drafter.method == "draft_model":
        spec["draft_sample_method"] = "probabilistic"  # q is the draft's processed distribution: min(1, p/q)
    if table:
        spec["num_speculative_tokens_per_batch_size"] = [list(row) for row in table]
    for key, bad in LOSSY.items():
        if key in spec and (bad is None or spec[key] in bad):
            raise VllmConfigError(f"speculative setting {key}={spec[key]!r} is lossy; specroll never enables it")
    return spec


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    g = p.add_argument_group("vLLM backend (--backend vllm)")
    g.add_argument("--tensor-parallel-size", type=int, default=int(env("SPECROLL_TENSOR_PARALLEL_SIZE", "1")))
    g.add_argument("--pipeline-parallel-size", type=int, default=int(env("SPECROLL_PIPELINE_PARALLEL_SIZE", "1")))
    g.add_argument("--data-parallel-size", type=int, default=int(env("SPECROLL_DATA_PARALLEL_SIZE", "1")))
    g.add_argument("--distributed-executor-backend", default=env("SPECROLL_DISTRIBUTED_EXECUTOR_BACKEND"),
                   choices=["mp", "ray", "uni"], help="ray for a model across nodes")
    g.add_argument("--gpu-memory-utilization", type=float,
                   default=float(env("SPECROLL_GPU_MEMORY_UTILIZATION", "0.85")))
    g.add_argument("--spec-table", default=env("SPECROLL_SPEC_TABLE"),
                   help="vLLM's per-batch-size draft depth: JSON [[first, last, k], ...], 'default' (deep in the "
                        "tail, shallow when full) or 'profile' (measured at start-up, cached; what --spec adaptive "
                        "does unless this is set); --spec fixed = --spec-k at every batch size")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=JSON",
                   help="another AsyncEngineArgs field, e.g. --vllm-arg max_num_batched_tokens=8192")


def vllm_config_from_args(args: argparse.Namespace) -> VllmConfig:
    extra: dict[str, Any] = {}
    for item in args.vllm_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise VllmConfigError(f"--vllm-arg takes KEY=VALUE, got {item!r}")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    table = args.spec_table if args.spec_table in (None, "", "profile", "default") else json.loads(args.spec_table)
    return VllmConfig(args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size,
                      args.distributed_executor_backend, args.gpu_memory_utilization, args.enforce_eager,
                      max(args.spec_k, 1), table, extra)
