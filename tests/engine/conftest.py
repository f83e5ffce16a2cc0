"""Engine-test fixtures shared by the graphed and compiled forward tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_checkpoint, peaked_checkpoint


@pytest.fixture(scope="session")
def target() -> Path:
    """A Qwen2 target peaked enough (init_std 0.3) for greedy runs to be stable under other roundings."""
    return peaked_checkpoint()


@pytest.fixture(scope="session")
def draft() -> Path:
    """A one-layer Llama draft model sharing the target's vocabulary."""
    return make_checkpoint("llama", tied=False, seed=3, hidden_size=32, num_layers=1)
