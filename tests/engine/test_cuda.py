"""The same engine on CUDA (skipped without a GPU): parity with CPU, and lossless SD there."""

from __future__ import annotations

import pytest
import torch
from helpers import peaked_checkpoint

from service.config import EngineConfig
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 6, 7], list(range(40, 70)), [300]]


def generate(device: str, **kw):
    path = peaked_checkpoint()
    engine = LLMEngine(EngineConfig(model=str(path), device=device, max_model_len=256, **kw))
    return engine, engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))


def test_cuda_greedy_matches_cpu():
    _, cpu = generate("cpu")
    _, gpu = generate("cuda")
    for a, b in zip(cpu, gpu, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(a.outputs[0].logprobs, b.outputs[0].logprobs, atol=1e-3, rtol=0)


@pytest.mark.parametrize("drafter", ["suffix", "eagle"])
def test_cuda_speculative_greedy_is_identical(drafter):
    _, plain = generate("cuda")
    engine, spec = generate("cuda", drafter=drafter, spec="fixed", spec_k=4)
    assert engine.stats.spec_drafts > 0
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
