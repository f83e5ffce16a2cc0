"""Returned logprobs against a full recompute, and the sampled distribution against the processed one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_checkpoint
from reference import chi_square_pvalue, processed_probs

from service.config import EngineConfig
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams

SETTINGS = {
    "t0.7": dict(temperature=0.7),
    "top_p0.9": dict(temperature=1.0, top_p=0.9),
    "top_k5": dict(temperature=1.0, top_k=5),
    "min_p0.1": dict(temperature=1.0, min_p=0.1),
}


def full_logits(path, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("setting", [*SETTINGS, "greedy", "mixed"])
def test_logprobs_equal_a_full_recompute(setting):
    path = make_checkpoint("qwen3", tied=False)
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=128))
    kw = {"greedy": dict(temperature=0.0), "mixed": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02)}
    kw = kw.get(setting) or SETTINGS[setting]
    params = SamplingParams(max_tokens=24, seed=11, ignore_eos=True, raw_logprobs=True, top_logprobs=3, **kw)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        comp = out.outputs[0]
        logits = full_logits(path, prompt + comp.token_ids)[len(prompt) - 1 : -1]
        for t, tok in enumerate(comp.token_ids):
            probs = processed_probs(logits[t], **kw)
            assert probs[tok] > 0
            assert abs(comp.logprobs[t] - probs[tok].log().item()) < 1e-4
            assert abs(comp.raw_logprobs[t] - logits[t].log_softmax(-1)[tok].item()) < 1e-4
            best = probs.log().topk(3)
            assert sorted(comp.top_logprobs[t]) == sorted(best.indices.tolist())
            if kw.get("temperature", 1.0) == 0:
                assert tok == int(logits[t].argmax())


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_first_token_distribution_matches(tiny_vocab_model, setting):
    """20,000 draws of the first token against the processed target distribution (chi-square)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_vocab_model), max_model_len=32, max_num_seqs=256))
    prompt = [1, 2, 3]
    n_per, n_req = 200, 100
    params = [SamplingParams(n=n_per, max_tokens=1, seed=1000 + i, ignore_eos=True, **SETTINGS[setting])
              for i in range(n_req)]
    outs = engine.generate([prompt] * n_req, params)
    samples = [c.token_ids[0] for o in outs for c in o.outputs]
    probs = processed_probs(full_logits(tiny_vocab_model, prompt)[-1], **SETTINGS[setting]).numpy()
    assert (probs > 0).sum() >= 3, "the test model must spread mass over several tokens"
    assert len(samples) == 20_000
    p = chi_square_pvalue(samples, probs)
    assert p > 0.01, f"chi-square p={p:.4g}, counts={np.bincount(samples, minlength=len(probs))}"
