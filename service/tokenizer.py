"""Thin tokenizer wrapper around the ``tokenizers`` library.

The runtime only depends on ``tokenizers`` (never on ``transformers``): a model directory is expected
to contain a ``tokenizer.json`` and, optionally, ``tokenizer_config.json``, ``generation_config.json``
and ``config.json`` from which the special token ids are resolved.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

logger = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

# Qwen2-style pre-tokenization: digits are split one by one, words keep their leading space. It is
# used verbatim so that transformers 5 (whose Qwen2Tokenizer rebuilds this pipeline instead of
# reading it from tokenizer.json for ``model_type == "qwen2"``) tokenizes exactly like we do.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _read_json(path: Path) -> dict[str, Any]:
    """Return the JSON object stored at ``path``, or an empty dict if missing or unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("could not read %s: %s", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _first_id(value: Any) -> int | None:
    """Normalise an ``eos_token_id``-style field (int, list of ints or null) to one id."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and isinstance(value[0], int):
        return int(value[0])
    return None


def _token_content(value: Any) -> str | None:
    """Extract a token string from a tokenizer_config field (plain string or AddedToken dict)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """Encode/decode text with a ``tokenizer.json`` and expose the model's special token ids."""

    def __init__(self, tokenizer: HFTokenizer, *, eos_token_id: int | None = None,
                 bos_token_id: int | None = None) -> None:
        self._tok = tokenizer
        self._eos_token_id = eos_token_id
        self._bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """Load the tokenizer of a model directory; ``None`` when it has no ``tokenizer.json``."""
        model_dir = Path(path)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            logger.info("no tokenizer.json in %s", model_dir)
            return None
        tok = HFTokenizer.from_file(str(tok_file))
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        eos = cls._resolve_id(tok, "eos", tok_cfg, gen_cfg, model_cfg)
        bos = cls._resolve_id(tok, "bos", tok_cfg, gen_cfg, model_cfg)
        logger.debug("loaded tokenizer from %s (vocab=%d eos=%s bos=%s)",
                     model_dir, tok.get_vocab_size(with_added_tokens=True), eos, bos)
        return cls(tok, eos_token_id=eos, bos_token_id=bos)

    @staticmethod
    def _resolve_id(tok: HFTokenizer, kind: str, tok_cfg: dict[str, Any], gen_cfg: dict[str, Any],
                    model_cfg: dict[str, Any]) -> int | None:
        """Resolve ``{kind}_token_id`` from tokenizer_config, then generation_config, then config."""
        content = _token_content(tok_cfg.get(f"{kind}_token"))
        if content is not None:
            token_id = tok.token_to_id(content)
            if token_id is not None:
                return int(token_id)
            logger.warning("%s_token %r from tokenizer_config.json is not in the vocab", kind, content)
        for cfg in (gen_cfg, model_cfg):
            token_id = _first_id(cfg.get(f"{kind}_token_id"))
            if token_id is not None:
                return token_id
        return None

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added/special tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        token_id = self._tok.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens are only added by the tokenizer's post-processor (a rendered
        chat template has its own: encode it with ``add_special_tokens=False``)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(enc.ids) for enc in self._tok.encode_batch(list(texts), add_special_tokens=True)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token_id={self.eos_token_id}, "
                f"bos_token_id={self.bos_token_id})")


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int, pretokenize: str = PRETOKENIZE_REGEX) -> HFTokenizer:
    """Train a byte-level BPE tokenizer in memory; special tokens take ids 0, 1, 2. `pretokenize` is the regex
    that splits text into the pieces BPE merges within."""
    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"byte-level BPE needs vocab_size >= {min_size}, got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pretokenize), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != expected_id:
            raise RuntimeError(f"special token {token!r} did not get id {expected_id}")
    return tok


def write_tokenizer_files(tok: HFTokenizer, out_dir: Path, *, eos_token: str = ENDOFTEXT,
                          bos_token: str | None = ENDOFTEXT, model_max_length: int = 2048) -> None:
    """Save ``tokenizer.json`` and a minimal ``tokenizer_config.json`` that transformers can load."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "bos_token": bos_token,
        "pad_token": eos_token,
        "unk_token": None,
        "model_max_length": model_max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer on ``texts`` and save it (plus its config) into ``out_dir``.

    Special tokens are ``<|endoftext|>`` (id 0, used as eos and bos), ``<|im_start|>`` (1) and
    ``<|im_end|>`` (2). The final vocab may be smaller than ``vocab_size`` on a small corpus.
    """
    tok = build_bpe_tokenizer(texts, vocab_size)
    write_tokenizer_files(tok, Path(out_dir))
    logger.info("trained byte-level BPE tokenizer (vocab=%d) into %s",
                tok.get_vocab_size(with_added_tokens=True), out_dir)
