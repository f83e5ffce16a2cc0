"""Fixtures of the vLLM backend tests. Each vLLM engine takes tens of seconds to start on CPU: one per module
(and per drafter)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_checkpoint
from vllm_utils import TINY


@pytest.fixture(scope="session")
def vllm_model(checkpoint_dir: Path) -> Path:
    return make_checkpoint("qwen2", seed=7, **TINY)


@pytest.fixture(scope="session")
def vllm_draft(checkpoint_dir: Path) -> Path:
    """A draft model sharing the target's vocabulary, with other weights (drafts are often rejected)."""
    return make_checkpoint("qwen2", seed=11, num_layers=1, **TINY)
