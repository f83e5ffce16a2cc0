"""Build the embedded default model without any model hub and without ``transformers``.

The default model is a small Qwen2-architecture checkpoint: a byte-level BPE tokenizer trained on a
deterministic synthetic corpus (English-like sentences and worked arithmetic) plus randomly
initialised weights drawn from a fixed seed, stored with the exact Hugging Face Qwen2 parameter names.
It is built once into the cache directory (``$SPECROLL_CACHE`` or ``~/.cache/specroll``) and reused.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from service.tokenizer import ENDOFTEXT, IM_END, IM_START, Tokenizer, train_bpe_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default-v1"
DEFAULT_VOCAB_SIZE = 2048
CORPUS_SEED = 1234
WEIGHT_SEED = 0
CORPUS_EXAMPLES = 12000
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")

ARCH: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
}
INIT_STD = 0.02
BIAS_STD = 0.01


def _words(text: str) -> list[str]:
    return text.split()


_NOUNS = _words(
    "apple bird boat book box bread bridge car cat chair city cloud coat cup door dog field fish flower "
    "forest garden glass hill horse house island key lake lamp letter map moon mountain paper pen river "
    "road rock room school ship shoe star stone street table tree train wall water window teacher farmer "
    "student robot child doctor baker sailor"
)
_ADJECTIVES = _words(
    "big small red blue green old new quiet bright dark warm cold happy tall short long empty full soft "
    "heavy yellow strange busy gentle"
)
_VERBS = _words(
    "sees likes finds builds reads writes counts carries paints opens follows helps visits watches moves "
    "checks cleans draws fixes holds"
)
_PLACES = _words("near behind under above beside inside across")
_ADVERBS = ["today", "slowly", "every morning", "again", "at night", "with care", "after lunch", "quickly"]
_QUESTIONS = ["What is", "Compute", "Please add", "Find"]
_SYLLABLES = _words(
    "ka lo mi ra te su no bi del mar an ri to vel sa go lin fe qua zo ben tor is ul dra pen chi wen ho mo"
)
_N_NAMES = 700


def _names(rng: random.Random) -> list[str]:
    """A fixed lexicon of made-up proper names, built from syllables."""
    names: set[str] = set()
    while len(names) < _N_NAMES:
        names.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize())
    return sorted(names)


def default_cache_root() -> Path:
    """The cache root: ``$SPECROLL_CACHE`` if set, else ``~/.cache/specroll``."""
    env = os.environ.get("SPECROLL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specroll"


def default_model_dir() -> Path:
    """Where the default model lives (it may not have been built yet)."""
    return default_cache_root() / DEFAULT_MODEL_NAME


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    if op == "-" and b > a:
        a, b = b, a
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b} = {value}"


def _sentence(rng: random.Random, names: list[str]) -> str:
    subject = rng.choice(names) if rng.random() < 0.5 else f"the {rng.choice(_NOUNS)}"
    text = f"{subject} {rng.choice(_VERBS)} the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    roll = rng.random()
    if roll < 0.4:
        text += f" {rng.choice(_PLACES)} {rng.choice(names)}"
    elif roll < 0.7:
        text += f" {rng.choice(_ADVERBS)}"
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def _chat(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return (f"{IM_START}user\n{rng.choice(_QUESTIONS)} {a} + {b}?{IM_END}\n"
            f"{IM_START}assistant\n{a} + {b} = {a + b}{IM_END}\n")


def synthetic_corpus(n_examples: int = CORPUS_EXAMPLES, seed: int = CORPUS_SEED) -> list[str]:
    """A deterministic corpus of short documents mixing prose, arithmetic and chat turns."""
    rng = random.Random(seed)
    names = _names(rng)
    docs: list[str] = []
    for _ in range(n_examples):
        kind = rng.random()
        if kind < 0.45:
            doc = " ".join(_sentence(rng, names) for _ in range(rng.randint(1, 4)))
        elif kind < 0.9:
            doc = "\n".join(_arithmetic(rng) for _ in range(rng.randint(1, 5)))
        else:
            doc = _chat(rng)
        docs.append(doc + ENDOFTEXT)
    return docs


def build_config(vocab_size: int, eos_token_id: int, bos_token_id: int | None) -> dict[str, Any]:
    """A Hugging Face compatible Qwen2 ``config.json`` for the default model."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **ARCH,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "tie_word_embeddings": True,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": ARCH["num_hidden_layers"],
        "attention_dropout": 0.0,
        "initializer_range": INIT_STD,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


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


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def build_default_model(out_dir: Path) -> None:
    """Write the complete default model (tokenizer, configs, weights) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {}

    def make_tokenizer() -> None:
        train_bpe_tokenizer(synthetic_corpus(), DEFAULT_VOCAB_SIZE, out_dir)
        tok = Tokenizer.from_dir(out_dir)
        if tok is None or tok.eos_token_id is None:
            raise RuntimeError("tokenizer build produced no usable tokenizer.json")
        state["tok"] = tok

    def make_configs() -> None:
        tok: Tokenizer = state["tok"]
        eos = tok.eos_token_id
        assert eos is not None
        config = build_config(tok.vocab_size, eos, tok.bos_token_id)
        _write_json(out_dir / "config.json", config)
        _write_json(out_dir / "generation_config.json",
                    {"bos_token_id": tok.bos_token_id, "eos_token_id": eos, "do_sample": True})
        state["config"] = config

    def make_weights() -> None:
        weights = init_qwen2_weights(state["config"])
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    steps: list[tuple[str, Callable[[], None]]] = [
        ("tokenizer", make_tokenizer), ("config", make_configs), ("weights", make_weights)]
    with tqdm(total=len(steps), desc="building default model", unit="step") as bar:
        for name, step in steps:
            bar.set_postfix_str(name)
            step()
            bar.update(1)


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds every file the default model consists of."""
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the default model directory, building it first if it is missing.

    ``cache_dir`` is the cache root (default: :func:`default_cache_root`); the model lives in
    ``cache_dir / "default-v1"``. The build happens in a temporary sibling directory that is renamed
    into place, so concurrent callers never observe a half-written model.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / DEFAULT_MODEL_NAME
    if is_complete(target):
        logger.debug("default model found at %s", target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    logger.info("building default model into %s", target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=root))
    try:
        build_default_model(tmp)
        if target.exists() and not is_complete(target):
            stale = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.stale-", dir=root))
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
