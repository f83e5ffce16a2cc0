"""Fixtures shared by the speculative-decoding tests: the drafters of the distribution (chi-square) tests."""

from __future__ import annotations

import pytest
from helpers import make_checkpoint, perturbed_copy


@pytest.fixture(scope="module")
def tiny_drafters(tiny_vocab_model, tmp_path_factory):
    """Drafters for the 16-token model: a host table, a near copy, an unrelated model, an EAGLE head."""
    root = tmp_path_factory.mktemp("tiny-drafters")
    return {
        "suffix": "suffix",
        "agree": str(perturbed_copy(tiny_vocab_model, root / "agree", 0.05)),
        "disagree": str(make_checkpoint("llama", tied=False, vocab_size=16, seed=99, init_std=0.3)),
        "eagle": "eagle",
    }
