"""Our decoder <-> Hugging Face layout: config.json for an architecture, weights under HF names, model folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from service.config import ModelConfig
from service.models.llama import CausalLM
from service.models.loader import hf_state_dict

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def qwen2_config(arch: dict[str, Any], vocab_size: int, eos_token_id: int, bos_token_id: int | None,
                 max_positions: int) -> dict[str, Any]:
    """A Hugging Face Qwen2 ``config.json`` (tied embeddings, q/k/v biases)."""
    layers = int(arch["num_hidden_layers"])
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **arch,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": max_positions,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def init_weights(model: CausalLM, gen: torch.Generator, std: float = 0.02) -> None:
    """GPT-2 style initialisation from `gen`: N(0, std) matrices, residual outputs scaled by 1/sqrt(2L),
    zero biases, unit norms."""
    out_std = std / (2 * max(model.config.num_layers, 1)) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def write_model_folder(out: Path, model: CausalLM, config: dict[str, Any], tokenizer_dir: Path | None) -> Path:
    """A complete HF folder: config.json, generation_config.json, model.safetensors and the tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    if ModelConfig.from_dict(config) != model.config:
        raise ValueError("config.json does not describe the model being saved")
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"bos_token_id": config["bos_token_id"],
                                                 "eos_token_id": config["eos_token_id"], "do_sample": True})
    save_file(hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir is not None and tokenizer_dir != out:
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def save_head(out: Path, head: torch.nn.Module) -> Path:
    """An EAGLE head as ``out/model.safetensors`` (its state_dict: fc.weight, layer.*, norm.weight)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
