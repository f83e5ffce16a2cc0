"""Our decoder against transformers: logits at prefill and every decode step, and greedy generation."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import default_checkpoint, make_checkpoint

from service.config import ConfigError, EngineConfig
from service.engine.llm_engine import LLMEngine
from service.models.loader import WeightError, load_model
from service.params import SamplingParams


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def check_logits_every_step(path, steps=12, lengths=(7, 1, 13)):
    """Prefill a batch of prompts, then decode greedily; compare every step's logits with a HF recompute."""
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=128, max_num_seqs=8))
    runner, ref = engine.runner, hf_model(path)
    prompts = prompts_of(lengths, engine.model_config.vocab_size)
    meta, _ = runner.build_meta(0, [0] * len(prompts), [len(p) for p in prompts])
    q = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (q - len(p)) for p in prompts])
    hidden = runner.forward(ids, meta)
    for b, p in enumerate(prompts):
        ours = runner.model.logits(hidden[b, : len(p)])
        theirs = ref(torch.tensor([p])).logits[0].float()
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    seqs = [list(p) for p in prompts]
    last = torch.stack([runner.model.logits(hidden[b, len(p) - 1]) for b, p in enumerate(prompts)])
    for _ in range(steps):
        nxt = last.argmax(-1).tolist()
        starts = [len(s) for s in seqs]
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        meta, _ = runner.build_meta(0, starts, [1] * len(seqs))
        last = runner.model.logits(runner.forward(torch.tensor(nxt)[:, None], meta)[:, 0])
        for b, s in enumerate(seqs):
            theirs = ref(torch.tensor([s])).logits[0, -1].float()
            torch.testing.assert_close(last[b], theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers(family, tied):
    check_logits_every_step(make_checkpoint(family, tied=tied))


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_matches_transformers(rope_scaling):
    check_logits_every_step(make_checkpoint("llama", tied=False, rope_scaling=rope_scaling), steps=4)


def test_no_gqa_sharded_and_legacy_config():
    check_logits_every_step(make_checkpoint("qwen2", tied=False, gqa=False, sharded=True), steps=3)
    check_logits_every_step(make_checkpoint("qwen3", tied=True, legacy_config=True), steps=3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_generation_matches_transformers(family):
    path = make_checkpoint(family, tied=family != "llama")
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=256, max_num_seqs=8))
    prompts = prompts_of((3, 9, 17, 30, 1), engine.model_config.vocab_size, seed=1)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    ref = hf_model(path)
    for p, out in zip(prompts, outs, strict=True):
        want = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == want[0, len(p):].tolist()


def test_bfloat16_runs_and_mostly_agrees():
    path = default_checkpoint()
    prompts = prompts_of((5, 12), 512, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", max_model_len=64)).generate(prompts, sp)
    b = LLMEngine(EngineConfig(model=str(path), max_model_len=64)).generate(prompts, sp)
    assert a[0].outputs[0].token_ids[:2] == b[0].outputs[0].token_ids[:2]


def test_unsupported_architecture_is_named(tmp_path):
    path = make_checkpoint("llama", tied=True)
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="MambaForCausalLM"):
        LLMEngine(EngineConfig(model=str(bad)))


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = default_checkpoint(tied=False)
    tensors = load_file(str(path / "model.safetensors"))
    cfg = (path / "config.json").read_text()
    for case, edit, pattern in [
        ("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"missing.*layers\.1\.mlp\.up_proj"),
        ("shape", lambda t: t.update({"model.norm.weight": torch.ones(3)}), r"wrong shapes.*model\.norm\.weight"),
        ("unknown", lambda t: t.update({"model.extra.weight": torch.ones(3)}), r"unknown.*model\.extra\.weight"),
    ]:
        d = tmp_path / case
        d.mkdir()
        t = dict(tensors)
        edit(t)
        save_file(t, str(d / "model.safetensors"))
        (d / "config.json").write_text(cfg)
        with pytest.raises(WeightError, match=pattern):
            load_model(d, torch.float32, torch.device("cpu"))
