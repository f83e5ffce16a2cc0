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


def start_vllm(model: Path, drafter: str = "none", spec: str = "off", k: int = 3, max_num_seqs: int = 256,
               max_len: int = MAX_LEN, **kw: Any) -> BackgroundServer:
    engine_kw = {"drafter": drafter, "spec": spec, "spec_k": k, "max_model_len": max_len,
                 "max_num_seqs": max_num_seqs, "kv_cache_memory_gb": 0.125}
    srv = start_server(model, engine_kw=engine_kw, backend="vllm",
                       vllm=VllmConfig(num_speculative_tokens=k, gpu_memory_utilization=0.3), **kw)
    return srv


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_of(folder: Path):
    """transformers' model of a checkpoint folder, float32, eval mode: the reference greedy decoder."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def check_cut_at_push(rows, old: str, prompt: list[int], old_model, new_model, length: int) -> None:
    """Greedy rows that ran through a push: each one's tokens tagged `old` are the old weights' greedy output, and
    the rest is the new weights' greedy continuation of that prefix. A token tagged by when it reached the server
    rather than by the weights that made it breaks the first or the second."""
    old_greedy = hf_greedy(old_model, prompt, length)
    continuation: dict[int, list[int]] = {}
    for r in rows:
        spans = [(v.policy_version, v.start, v.end) for v in r.version_spans]
        cut, tokens = (spans[0][2] if spans[0][0] == old else 0), list(r.token_ids)
        assert tokens[:cut] == old_greedy[:cut], spans
        if cut not in continuation:
            continuation[cut] = hf_greedy(new_model, prompt + old_greedy[:cut], length - cut)
        assert tokens[cut:] == continuation[cut], spans
