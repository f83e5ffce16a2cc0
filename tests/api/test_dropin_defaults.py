"""Defaults from the model: max_model_len is the checkpoint's context length (capped by what the KV cache holds,
with the reason logged), the max_tokens limit follows it, and a flag still overrides."""

from __future__ import annotations

import logging

import pytest
from helpers import make_checkpoint

from service.api.generation import InvalidRequest, Limits, make_params
from service.cli import build_parser
from service.config import ConfigError, EngineConfig, context_length
from service.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def model_dir():
    return make_checkpoint("qwen2", tied=True, max_position_embeddings=384)


def engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), enforce_eager=True, max_num_seqs=4, **kw))


def test_context_length_of_the_checkpoint(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="service.config"):
        e = engine(model_dir)
    assert e.config.max_model_len == 384 and "the checkpoint's context length" in caplog.text
    assert e.config.max_num_batched_tokens >= 384
    assert engine(model_dir, max_model_len=100).config.max_model_len == 100  # the flag overrides


def test_capped_by_the_kv_cache(model_dir, caplog):
    # 2 layers x 2 kv heads x 16 dims x 2 (k, v) x 4 bytes = 512 bytes a token: 128 KiB hold 256 positions, less
    # the speculative headroom and the scratch position
    with caplog.at_level(logging.WARNING, logger="service.config"):
        e = engine(model_dir, kv_cache_memory_gb=128 / 2**20)
    assert e.config.max_model_len == 256 - 17 and "does not fit the KV cache" in caplog.text
    with pytest.raises(ConfigError, match="KV cache"):
        engine(model_dir, kv_cache_memory_gb=8 / 2**20)


def test_max_tokens_follows_the_context():
    """AReaL's default max_new_tokens (16384) passes the server's limit; only the context bounds it."""
    assert make_params(Limits(), max_tokens=16384).max_tokens == 16384
    with pytest.raises(InvalidRequest, match="server limit"):
        make_params(Limits(max_tokens=100), max_tokens=101)


def test_cli_defaults_follow_the_model():
    args = build_parser().parse_args(["serve"])
    assert args.max_model_len is None and args.max_tokens_per_request is None
    assert build_parser().parse_args(["serve", "--max-model-len", "777"]).max_model_len == 777
    assert context_length({"text_config": {"max_position_embeddings": 9}}) == 9
    assert context_length({"n_positions": 2048, "max_position_embeddings": 512}) == 512
