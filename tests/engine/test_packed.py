"""Prepacked linear weights (service/models/packed.py) change speed, not results: packed layers equal plain
ones (bf16 bit for bit), autograd never sees them, a swapped model is packed anew, and the engine stays exact
with every layer packed (greedy tokens, logprobs against transformers, the sampled joint law under SD)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_checkpoint
from reference import chi_square_pvalue, exact_joint, processed_probs

from service.config import EngineConfig
from service.engine.kv_cache import KVCache
from service.engine.llm_engine import LLMEngine
from service.engine.runner import CachedModel
from service.models import packed
from service.models.loader import load_model
from service.models.packed import Linear, pack_linears
from service.params import SamplingParams

pytestmark = pytest.mark.skipif(not packed.packing_available(), reason="this torch build has no oneDNN")


@pytest.fixture
def pack_everything(monkeypatch):
    """Pack float32 layers of any size (the tiny test models are below the size where packing pays)."""
    monkeypatch.setattr(packed, "_FLOAT32_MIN_WEIGHTS", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layer_equals_the_plain_one(dtype, pack_everything):
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True).to(dtype)
    assert pack_linears(layer) == 1 and layer.packed is not None
    for rows in (1, 5, 64):
        x = torch.randn(rows, 3, 96).to(dtype)
        with torch.inference_mode():
            got = layer(x)
        want = F.linear(x, layer.weight, layer.bias)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 96, requires_grad=True)
    layer.float().requires_grad_(True)
    pack_linears(layer)
    layer(x).sum().backward()  # gradients enabled: the plain path, differentiable
    assert x.grad is not None and layer.weight.grad is not None


def test_small_float32_layers_stay_plain():
    layer = Linear(64, 128)
    assert pack_linears(layer) == 0 and layer.packed is None
    assert pack_linears(layer.to(torch.bfloat16)) == 1


def test_a_swapped_model_is_packed_with_its_own_weights(tiny_qwen2, pack_everything):
    a = load_model(tiny_qwen2, torch.float32, torch.device("cpu"))
    b = load_model(tiny_qwen2, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(1.5)
    cached = CachedModel(a, KVCache(a.config, 2, 16, torch.float32, torch.device("cpu")), torch.device("cpu"))
    assert a.layers[0].mlp.down_proj.packed is not None
    cached.model = b
    layer = b.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [300], list(range(40, 70))]


def test_engine_exact_with_packed_weights(tiny_qwen2, pack_everything):
    """Greedy output with every layer packed equals transformers'; sampled logprobs under SD equal a recompute."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2), max_model_len=128, drafter="suffix", spec="fixed",
                                    spec_k=3))
    assert engine.runner.model.layers[0].self_attn.qkv_proj.packed is not None
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    kw = dict(temperature=0.8, top_p=0.9)
    sampled = engine.generate(PROMPTS, SamplingParams(max_tokens=20, seed=3, ignore_eos=True, **kw))
    assert engine.stats.spec_drafts > 0
    for prompt, g, s in zip(PROMPTS, greedy, sampled, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(20):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            assert g.outputs[0].token_ids == ids[len(prompt):]
            comp = s.outputs[0]
            logits = ref(torch.tensor([prompt + comp.token_ids])).logits[0, len(prompt) - 1 : -1]
        for t, tok in enumerate(comp.token_ids):
            assert abs(comp.logprobs[t] - processed_probs(logits[t], **kw)[tok].log().item()) < 1e-4


@pytest.mark.slow
def test_joint_law_under_sd_with_packed_weights(tiny_vocab_model, pack_everything):
    prompt, kw = [1, 2, 3], {"temperature": 0.7, "top_p": 0.9}
    engine = LLMEngine(EngineConfig(model=str(tiny_vocab_model), max_model_len=32, max_num_seqs=400,
                                    drafter=str(make_checkpoint("llama", tied=False, vocab_size=16, seed=99,
                                                                init_std=0.3)), spec="fixed", spec_k=2))
    assert engine.runner.model.lm_head.packed is not None
    params = [SamplingParams(n=200, max_tokens=3, seed=9000 + i, ignore_eos=True, **kw) for i in range(100)]
    triples = [c.token_ids for o in engine.generate([prompt] * 100, params) for c in o.outputs]
    assert len(triples) == 20_000 and engine.stats.spec_draft_tokens > 0
    p = chi_square_pvalue([(a * 16 + b) * 16 + c for a, b, c in triples], exact_joint(tiny_vocab_model, prompt, kw))
    assert p > 0.01, f"chi-square p={p:.4g}"
