"""Engine-test fixtures shared by the graphed and compiled forward tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_checkpoint, peaked_checkpoint


@pytest.fixture(scope="session")
def target() -> Path:
    """The peaked Qwen2 target (helpers.peaked_checkpoint): greedy runs stay the same under other roundings."""
    return peaked_checkpoint()


@pytest.fixture(scope="session")
def draft() -> Path:
    """A one-layer Llama draft model sharing the target's vocabulary."""
    return make_checkpoint("llama", tied=False, seed=3, hidden_size=32, num_layers=1)
