"""Configuration: the model's architecture (read from a Hugging Face config.json) and the engine's knobs."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.drafter_spec import DrafterSpec

logger = logging.getLogger(__name__)

# Where Hugging Face configs give the context length, most specific first (text_config: multimodal wrappers).
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "max_seq_len",
                "model_max_length")
DEFAULT_CONTEXT = 4096  # a config that names none of them


def default_cache_root() -> Path:
    """The cache root: ``$SPECROLL_CACHE`` if set, else ``~/.cache/specroll``."""
    env = os.environ.get("SPECROLL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specroll"


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPES = ("float32", "bfloat16", "float16")
# When the native engine allocates the buffer a weight push is loaded into (docs/weights.md): at start, at the
# first push (then kept), or at every push (freed after its swap)
WEIGHT_SPARES = ("start", "on-demand", "free", "in-place")


class ConfigError(ValueError):
    """A model folder or an engine setting that cannot be used; the message says which and why."""


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A model folder's config.json (eos from generation_config.json when config.json has none)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"no config.json in model folder {str(path)!r}")
    cfg: dict[str, Any] = json.loads(cfg_path.read_text())
    gen_path = Path(path) / "generation_config.json"
    if gen_path.is_file() and cfg.get("eos_token_id") is None:
        cfg["eos_token_id"] = json.loads(gen_path.read_text()).get("eos_token_id")
    return cfg


def context_length(cfg: dict[str, Any]) -> int:
    """The context length a Hugging Face config declares (its text model's, for a multimodal wrapper)."""
    for source in (cfg, cfg.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return DEFAULT_CONTEXT


@dataclass(slots=True)
class ModelConfig:
    """The subset of a Hugging Face config that our decoder needs."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 may nest rope settings under "rope_parameters".
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            kind = rope_params.get("rope_type", rope_params.get("type", "default"))
            if kind != "default" and rope_scaling is None:
                rope_scaling = dict(rope_params)
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if kind == "default" else dict(rope_scaling, rope_type=kind)
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=context_length(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family != "llama")),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ModelConfig:
        return cls.from_dict(read_config(path))

    @property
    def layer_macs(self) -> int:

        """Multiply-adds of one token through one decoder layer's linear layers (attention's own work aside)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size

    @property
    def macs_per_token(self) -> int:
        """Multiply-adds of one token through the decoder and the LM head (attention's own work aside)."""
        return self.num_layers * self.layer_macs + self.hidden_size * self.vocab_size

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, per element byte (multiply by dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(slots=True)
class EngineConfig:
    """Engine settings. `model=None` means the embedded default model."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the checkpoint's context length, capped by the KV cache
    max_num_batched_tokens: int = 8192
    kv_cache_memory_gb: float = 2.0
    seed: int = 0
    num_threads: int | None = None
    # Speculative decoding: the drafters (service/drafter_spec.py; a --drafter string is parsed on construction,
    # "none" for plain decoding); spec "adaptive" picks (drafter, k) per step, "fixed" pins spec_k.
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    spec: str = "adaptive"
    spec_k: int = 4
    # Run decode and verify forwards eagerly: no CUDA graphs on a GPU (service/engine/cached_model.py), no torch.compile
    # on CPU (service/engine/compiled.py)
    enforce_eager: bool = False
    # CPU: compile those forwards in a thread while steps run eagerly, and switch to them once compiled
    # (service/engine/background_compile.py); else compile them before the engine is built
    compile_background: bool = False
    # Append one JSON line per decode step to this file: the strategy's choice, its cost and what it believed
    # (service/engine/trace.py; native backend)
    strategy_trace: str | None = None
    # The buffer a weight push is loaded into, one of WEIGHT_SPARES (native backend; docs/weights.md)
    weight_spare: str = "start"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.drafter, str):
            self.drafter = DrafterSpec.parse(self.drafter)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) so any prompt fits one prefill"
            )
        if self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
        if self.spec not in ("adaptive", "fixed", "off"):
            raise ConfigError(f"spec must be adaptive, fixed or off, got {self.spec!r}")
        if not 0 <= self.spec_k <= 15:
            raise ConfigError(f"spec_k must be in [0, 15], got {self.spec_k}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.weight_spare not in WEIGHT_SPARES:
            raise ConfigError(f"weight_spare must be one of {', '.join(WEIGHT_SPARES)}, got {self.weight_spare!r}")

    def resolve_max_model_len(self, context: int, cache_holds: int | None, cache: str) -> int:
        """Set max_model_len, when not given, from the checkpoint's `context` length, capped by what the KV cache
        holds for one sequence (`cache_holds` tokens of `cache`); a given one stays (the flag overrides). Logs the
        value and why; the prefill budget grows to take a whole-context prompt."""
        if self.max_model_len is not None:
            logger.info("max_model_len %d (set; the checkpoint's context length is %d)", self.max_model_len, context)
        elif cache_holds is not None and cache_holds < context:
            if cache_holds < 2:
                raise ConfigError(f"the KV cache ({cache}) holds {max(cache_holds, 0)} tokens of a sequence: raise it "
                                  "or set --max-model-len")
            self.max_model_len = cache_holds
            logger.warning("max_model_len %d: the checkpoint's context length %d does not fit the KV cache (%s "
                           "holds %d tokens of one sequence); raise the cache or set --max-model-len",
                           cache_holds, context, cache, cache_holds)
        else:
            self.max_model_len = context
            logger.info("max_model_len %d: the checkpoint's context length", context)
        self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
        return self.max_model_len
