"""The embedded default model: the trained demo model, built on first use without any model hub.

``specroll serve`` without ``--model`` serves it. It is a small Qwen2-architecture model trained by
``service.demo`` on worked solutions of the demo task (running sums, ``service/demo/task.py``), with a
2-layer draft model in ``draft/`` and an EAGLE-style head in ``eagle/`` next to it. It is built once,
deterministically (fixed seeds, deterministic kernels; a tqdm bar shows progress), into the cache directory
(``$SPECROLL_CACHE`` or ``~/.cache/specroll``) and reused. The full size also ships inside the package
(``service/demo/weights``, built by ``python3 -m service.demo.ship``): when its files match their SHA256SUMS
it is served as it is, so the first start takes seconds, not the minutes of training.
``$SPECROLL_DEMO_SIZE=tiny`` builds a tiny untrained-quality variant in seconds (tests), cached under its own name.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from service.config import default_cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default-v2"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "demo.json", "draft/model.safetensors", "eagle/model.safetensors")
WEIGHT_SEED = 0
INIT_STD = 0.02
BIAS_STD = 0.01


def model_name(size: str | None = None) -> str:
    """Folder name of the default model of a demo size (``full`` is plain ``default-v2``)."""
    from service.demo.build import demo_size

    name = demo_size(size).name
    return DEFAULT_MODEL_NAME if name == "full" else f"{DEFAULT_MODEL_NAME}-{name}"


def default_model_dir() -> Path:
    """Where the default model lives (it may not have been built yet)."""
    return default_cache_root() / model_name()


def init_qwen2_weights(config: dict[str, Any], seed: int = WEIGHT_SEED) -> dict[str, torch.Tensor]:
    """Random Qwen2 weights keyed by HF parameter names (tied embeddings: no ``lm_head.weight``)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    head_dim = int(config["head_dim"])
    q_dim = int(config["num_attention_heads"]) * head_dim
    kv_dim = int(config["num_key_value_heads"]) * head_dim

    def normal(*shape: int, std: float = INIT_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(int(config["vocab_size"]), hidden),
    }
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        weights.update({
            f"{p}.self_attn.q_proj.weight": normal(q_dim, hidden),
            f"{p}.self_attn.q_proj.bias": normal(q_dim, std=BIAS_STD),
            f"{p}.self_attn.k_proj.weight": normal(kv_dim, hidden),
            f"{p}.self_attn.k_proj.bias": normal(kv_dim, std=BIAS_STD),
            f"{p}.self_attn.v_proj.weight": normal(kv_dim, hidden),
            f"{p}.self_attn.v_proj.bias": normal(kv_dim, std=BIAS_STD),
            f"{p}.self_attn.o_proj.weight": normal(hidden, q_dim),
            f"{p}.mlp.gate_proj.weight": normal(inter, hidden),
            f"{p}.mlp.up_proj.weight": normal(inter, hidden),
            f"{p}.mlp.down_proj.weight": normal(hidden, inter),
            f"{p}.input_layernorm.weight": torch.ones(hidden),
            f"{p}.post_attention_layernorm.weight": torch.ones(hidden),
        })
    weights["model.norm.weight"] = torch.ones(hidden)
    return weights


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds every file the default model consists of."""
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the default model directory, building it first if it is missing.

    ``cache_dir`` is the cache root (default: :func:`default_cache_root`); the model lives in
    ``cache_dir / model_name()``. The build happens in a temporary sibling directory that is renamed into
    place, so concurrent callers never observe a half-written model.
    """
    from service.demo.build import build_demo, demo_size
    from service.demo.ship import shipped_dir

    size = demo_size()
    name = model_name(size.name)
    shipped = shipped_dir(name)
    if shipped is not None and is_complete(shipped):
        logger.debug("default model shipped at %s", shipped)
        return shipped
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / name
    if is_complete(target):
        logger.debug("default model found at %s", target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    logger.info("building the default model (demo size %s) into %s", size.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        build_demo(tmp, size)
        if target.exists() and not is_complete(target):
            stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale-", dir=root))
            logger.warning("replacing incomplete default model directory %s", target)
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):
                raise
            logger.info("default model was built concurrently; using %s", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("default model ready at %s", target)
    return target


def default_drafters(model_dir: Path) -> dict[str, str]:
    """The ``--drafter`` values for the default model's own drafters."""
    return {"draft": str(model_dir / "draft"), "eagle": f"eagle:{model_dir / 'eagle'}", "suffix": "suffix"}


__all__ = ["DEFAULT_MODEL_NAME", "default_cache_root", "default_drafters", "default_model_dir",
           "ensure_default_model", "init_qwen2_weights", "is_complete", "model_name"]
