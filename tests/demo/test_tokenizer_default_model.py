"""Tests for service.tokenizer, service.demo.default_model and the tiny-checkpoint helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import FAMILIES, make_checkpoint
from safetensors import safe_open

from service.demo.build import SIZE_ENV, tokenizer_corpus
from service.demo.default_model import (
    DEFAULT_MODEL_NAME,
    default_model_dir,
    ensure_default_model,
    model_name,
)
from service.tokenizer import Tokenizer, train_bpe_tokenizer

TEXTS = ["12 + 35 = 47", "The cat sees a new book today.", "héllo wörld 🙂", "  spaces\tand\nnewlines  "]


@pytest.fixture(scope="module", autouse=True)
def tiny_demo() -> object:
    """The default model is the trained demo model; its tiny size builds in seconds."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SIZE_ENV, "tiny")
        yield mp


@pytest.fixture(scope="module")
def default_model(tiny_demo_model: Path) -> Path:
    return tiny_demo_model


def test_default_model_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    assert default_model_dir() == tmp_path / model_name()
    monkeypatch.delenv("SPECROLL_CACHE")
    assert default_model_dir() == Path.home() / ".cache" / "specroll" / model_name()
    monkeypatch.delenv(SIZE_ENV)
    assert default_model_dir().name == DEFAULT_MODEL_NAME


def test_tokenizer_corpus_is_deterministic() -> None:
    assert tokenizer_corpus() == tokenizer_corpus()
    assert all(doc.startswith("Add: ") and "Answer: " in doc for doc in tokenizer_corpus()[:50])


def test_default_model_files_and_config(default_model: Path) -> None:
    assert default_model.name == model_name()
    config = json.loads((default_model / "config.json").read_text())
    tok = Tokenizer.from_dir(default_model)
    assert tok is not None
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] == tok.vocab_size
    assert 259 < tok.vocab_size <= 512  # 256 bytes + 3 special tokens + labelled digits (a1..z9) + a few words
    assert config["eos_token_id"] == tok.eos_token_id
    gen = json.loads((default_model / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    with safe_open(str(default_model / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.bias").abs().sum() > 0
    assert "lm_head.weight" not in keys
    assert "model.layers.1.self_attn.k_proj.bias" in keys


def test_default_model_loads_in_transformers(default_model: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(default_model, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert model.config.tie_word_embeddings
    hf_tok = transformers.AutoTokenizer.from_pretrained(default_model)
    ours = Tokenizer.from_dir(default_model)
    assert ours is not None
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == ours.encode(text)
    ids = torch.tensor([ours.encode("Add: a1 b2\n")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], ours.vocab_size)
    assert torch.isfinite(logits).all()


def test_incomplete_dir_is_rebuilt(tmp_path: Path) -> None:
    broken = tmp_path / model_name()
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    out = ensure_default_model(tmp_path)
    assert out == broken
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


def test_tokenizer_round_trip_and_ids(default_model: Path) -> None:
    tok = Tokenizer.from_dir(default_model)
    assert tok is not None
    assert tok.eos_token_id == 0
    assert tok.bos_token_id == 0
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids) == "user\nhi"
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)


def test_tokenizer_missing_and_eos_fallbacks(tmp_path: Path) -> None:
    assert Tokenizer.from_dir(tmp_path) is None
    train_bpe_tokenizer(["a b c d e f", "1 + 2 = 3"] * 20, 300, tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    assert Tokenizer.from_dir(tmp_path).eos_token_id is None  # type: ignore[union-attr]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok is not None and (tok.eos_token_id, tok.bos_token_id) == (2, 1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert Tokenizer.from_dir(tmp_path).eos_token_id == 1  # type: ignore[union-attr]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert Tokenizer.from_dir(tmp_path).eos_token_id == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("family", FAMILIES)
def test_make_checkpoint_loads(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = make_checkpoint(family, tied=False, sharded=True)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    assert make_checkpoint(family, tied=False, sharded=True) == path
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = Tokenizer.from_dir(path)
    assert tok is not None and tok.vocab_size <= model.config.vocab_size
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert all(not torch.allclose(p, torch.ones_like(p)) for p in norms)
    if family == "qwen2":
        assert model.model.layers[0].self_attn.k_proj.bias.abs().min() > 0


def test_tiny_vocab_model(tiny_vocab_model: Path) -> None:
    config = json.loads((tiny_vocab_model / "config.json").read_text())
    assert config["vocab_size"] == 16
    tok = Tokenizer.from_dir(tiny_vocab_model)
    assert tok is not None and tok.vocab_size == 16
    assert tok.decode(tok.encode("1 + 2 = 3")) == "1 + 2 = 3"
