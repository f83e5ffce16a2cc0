"""Test helpers: tiny random Hugging Face checkpoints (and the named ones most tests use), tokenizers, processes.

Checkpoints are written with ``transformers``' ``save_pretrained`` (safetensors) so they exercise the
same on-disk format as real hub checkpoints. They are cached per process (and per root directory)
so a whole pytest session builds each distinct checkpoint once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from service.tokenizer import SPECIAL_TOKENS, train_bpe_tokenizer, write_tokenizer_files

logger = logging.getLogger(__name__)

FAMILIES = ("llama", "qwen2", "qwen3")
EOS_TOKEN_ID = 0
BOS_TOKEN_ID = 0
_MIN_BPE_VOCAB = len(SPECIAL_TOKENS) + 256 + 8

_root: Path | None = None
_cache: dict[str, Path] = {}


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def set_checkpoint_root(path: Path) -> None:
    """Directory under which :func:`make_checkpoint` writes (conftest points it at a session tmp dir)."""
    global _root
    _root = Path(path)
    _root.mkdir(parents=True, exist_ok=True)


def checkpoint_root() -> Path:
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="specroll-ckpts-"))
    return _root


def tiny_corpus() -> list[str]:
    """A small deterministic corpus for test tokenizers."""
    words = ["the", "cat", "dog", "sat", "on", "mat", "a", "red", "ball", "runs", "fast", "and", "jumps",
             "over", "hello", "world", "model", "token", "answer", "is"]
    docs: list[str] = []
    for i in range(400):
        a, b = (i * 7) % 100, (i * 13) % 100
        sentence = " ".join(words[(i + k * 3) % len(words)] for k in range(6))
        docs.append(f"{sentence}. {a} + {b} = {a + b}\n")
    return docs


def write_word_level_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A whitespace WordLevel tokenizer with exactly ``vocab_size`` ids (for very small vocabs)."""
    symbols = [*SPECIAL_TOKENS, "<unk>", *list("0123456789+=-*"), *[chr(c) for c in range(ord("a"), 123)]]
    symbols += [f"w{i}" for i in range(max(0, vocab_size - len(symbols)))]
    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size} too small for a tokenizer")
    vocab = {tok: i for i, tok in enumerate(symbols[:vocab_size])}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    write_tokenizer_files(tok, out_dir)


def write_test_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Byte-level BPE when the vocab allows it, otherwise a WordLevel tokenizer; ids < ``vocab_size``."""
    if vocab_size >= _MIN_BPE_VOCAB:
        train_bpe_tokenizer(tiny_corpus(), vocab_size, out_dir)
    else:
        write_word_level_tokenizer(out_dir, vocab_size)


def _config_class(family: str) -> type:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes: dict[str, type] = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return classes[family]


@torch.no_grad()
def _randomise(model: torch.nn.Module, *, seed: int, bias_std: float, norm_std: float) -> None:
    """Give biases and RMSNorm weights random values (HF initialises them to 0 and 1)."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.copy_(torch.randn(param.shape, generator=gen) * bias_std)
        elif name.endswith("norm.weight"):
            param.copy_(1.0 + torch.randn(param.shape, generator=gen) * norm_std)


def _to_legacy_config(config_path: Path) -> None:
    """Rewrite a transformers-5 config.json in the transformers-4 layout most hub checkpoints use."""
    cfg: dict[str, Any] = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    config_path.write_text(json.dumps(cfg, indent=2) + "\n")


def _cache_key(params: dict[str, Any]) -> str:
    blob = json.dumps(params, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def make_checkpoint(
    family: str,
    *,
    tied: bool,
    gqa: bool = True,
    vocab_size: int = 512,
    dtype: torch.dtype = torch.float32,
    rope_scaling: dict[str, Any] | None = None,
    sharded: bool = False,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    num_heads: int = 4,
    head_dim: int = 16,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    init_std: float = 0.02,
    bias_std: float = 0.1,
    norm_std: float = 0.1,
    with_tokenizer: bool = True,
    legacy_config: bool = False,
    root: Path | None = None,
) -> Path:
    """Build (or reuse) a tiny random ``family`` checkpoint and return its directory.

    ``gqa`` uses ``num_heads // 2`` KV heads; ``sharded`` splits the weights over several safetensors
    files with a ``model.safetensors.index.json``; ``legacy_config`` writes ``rope_theta`` /
    ``rope_scaling`` / ``torch_dtype`` like transformers 4 instead of ``rope_parameters`` / ``dtype``.
    Token ids 0 are eos and bos. The directory also holds a tokenizer when ``with_tokenizer``.
    """
    params = {k: v for k, v in locals().items() if k != "root"}
    base = Path(root) if root is not None else checkpoint_root()
    key = _cache_key(params)
    name = f"{family}-{'tied' if tied else 'untied'}-v{vocab_size}-{str(dtype).removeprefix('torch.')}-{key}"
    target = base / name
    cache_id = str(target)
    if cache_id in _cache and (target / "config.json").is_file():
        return _cache[cache_id]
    if not (target / ".complete").is_file():
        _build_checkpoint(target, params)
    _cache[cache_id] = target
    return target


def default_checkpoint(*, tied: bool = True) -> Path:
    """The tiny Qwen2 most tests serve (GQA, random biases, a 512-token vocabulary); `tied=False` unties embeddings."""
    return make_checkpoint("qwen2", tied=tied)


def peaked_checkpoint(seed: int = 1) -> Path:
    """A Qwen2 peaked enough (init_std 0.3) for varied, non-looping greedy output that other roundings keep."""
    return make_checkpoint("qwen2", tied=True, init_std=0.3, seed=seed)


def trainer_target_checkpoint() -> Path:
    """The Qwen2 target (init_std 0.1) the drafter-trainer tests serve and distil drafters against."""
    return make_checkpoint("qwen2", tied=True, init_std=0.1, seed=3)


def _build_checkpoint(target: Path, p: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    num_kv = p["num_heads"] // 2 if p["gqa"] else p["num_heads"]
    config_kwargs: dict[str, Any] = {
        "vocab_size": p["vocab_size"],
        "hidden_size": p["hidden_size"],
        "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_layers"],
        "num_attention_heads": p["num_heads"],
        "num_key_value_heads": num_kv,
        "head_dim": p["head_dim"],
        "max_position_embeddings": p["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_theta": p["rope_theta"],
        "tie_word_embeddings": p["tied"],
        "initializer_range": p["init_std"],
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
    }
    if p["rope_scaling"] is not None:
        config_kwargs["rope_scaling"] = dict(p["rope_scaling"])
    config = _config_class(p["family"])(**config_kwargs)

    torch.manual_seed(p["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed=p["seed"], bias_std=p["bias_std"], norm_std=p["norm_std"])
    model = model.to(p["dtype"]).eval()
    model.config.dtype = p["dtype"]

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        shard = f"{max(1, n_bytes // 4000)}KB" if p["sharded"] else "50GB"
        model.save_pretrained(tmp, max_shard_size=shard)
        if p["sharded"] and not (tmp / "model.safetensors.index.json").is_file():
            raise RuntimeError(f"sharded checkpoint was not sharded (max_shard_size={shard})")
        if p["legacy_config"]:
            _to_legacy_config(tmp / "config.json")
        if p["with_tokenizer"]:
            write_test_tokenizer(tmp, p["vocab_size"])
        (tmp / ".complete").write_text(json.dumps(p, default=str) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny %s checkpoint at %s", p["family"], target)


def assert_same(a, b, atol: float) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        torch.testing.assert_close(x.outputs[0].logprobs, y.outputs[0].logprobs, atol=atol, rtol=0)


def assert_same_up_to_near_ties(a, b, atol: float) -> None:
    """Greedy outputs agree token for token, logprobs within atol, until a step whose two choices were near-tied
    (both runs gave their own pick a logprob within atol of each other's): rounding may break a tie either way."""
    for x, y in zip(a, b, strict=True):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        lx, ly = x.outputs[0].logprobs, y.outputs[0].logprobs
        n = next((i for i, (u, v) in enumerate(zip(tx, ty, strict=True)) if u != v), len(tx))
        torch.testing.assert_close(lx[:n], ly[:n], atol=atol, rtol=0)
        if n < len(tx):
            assert abs(lx[n] - ly[n]) < atol, f"diverged at {n} without a near-tie: {lx[n]} vs {ly[n]}"


def perturbed_copy(src: Path, dst: Path, scale: float, seed: int = 0) -> Path:
    """A copy of a checkpoint with relative Gaussian noise on every tensor: a draft model that mostly agrees."""
    import torch
    from safetensors.torch import load_file, save_file

    if (dst / "config.json").exists():
        return dst
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({n: t + scale * t.std() * torch.randn(t.shape, generator=g) for n, t in tensors.items()}, str(f))
    return dst
