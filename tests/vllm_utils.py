"""Helpers of the vLLM backend tests: tiny checkpoints vLLM's CPU kernels accept (head_dim 32) and real servers
(`--backend vllm`) on loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from service_utils import start_server

from service.app import BackgroundServer
from service.vllm.config import VllmConfig

# A 16-token vocabulary with peaky next-token distributions: exact joint distributions are enumerable.
TINY = {"tied": False, "vocab_size": 16, "init_std": 0.2, "head_dim": 32, "hidden_size": 128, "num_heads": 4}
MAX_LEN = 64


def start_vllm(model: Path, drafter: str = "none", spec: str = "off", k: int = 3, **kw: Any) -> BackgroundServer:
    engine_kw = {"drafter": drafter, "spec": spec, "spec_k": k, "max_model_len": MAX_LEN, "max_num_seqs": 256,
                 "kv_cache_memory_gb": 0.125}
    srv = start_server(model, engine_kw=engine_kw, backend="vllm",
                       vllm=VllmConfig(num_speculative_tokens=k, gpu_memory_utilization=0.3), **kw)
    return srv


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
