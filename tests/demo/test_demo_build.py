"""The demo model build (tiny size): HF folders for target, draft model and EAGLE head, deterministic, cached,
served by our engine with every drafter, and readable by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from service.config import EngineConfig
from service.demo.build import SIZE_ENV, VOCAB_SIZE, demo_size
from service.demo.default_model import default_drafters, ensure_default_model, model_name
from service.demo.task import problems
from service.drafter_spec import DrafterSpec
from service.engine.llm_engine import LLMEngine, expand_auto
from service.models.loader import load_model
from service.params import SamplingParams
from service.tokenizer import Tokenizer

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "draft/config.json", "draft/model.safetensors", "draft/tokenizer.json", "eagle/model.safetensors")


@pytest.fixture(scope="module")
def tiny_env() -> object:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SIZE_ENV, "tiny")
        yield mp


@pytest.fixture(scope="module")
def demo(tiny_env: pytest.MonkeyPatch, tiny_demo_model: Path) -> Path:
    return tiny_demo_model


def test_folder_layout(demo: Path) -> None:
    assert demo.name == model_name("tiny") == "default-v2-tiny"
    for name in FILES:
        assert (demo / name).is_file(), name
    cfg = json.loads((demo / "config.json").read_text())
    tok = Tokenizer.from_dir(demo)
    assert tok is not None and tok.vocab_size == cfg["vocab_size"] <= VOCAB_SIZE
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["eos_token_id"] == tok.eos_token_id == 0
    assert json.loads((demo / "generation_config.json").read_text())["eos_token_id"] == 0
    draft = json.loads((demo / "draft/config.json").read_text())
    assert draft["num_hidden_layers"] == demo_size("tiny").draft_layers and draft["vocab_size"] == cfg["vocab_size"]
    with safe_open(str(demo / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys()) and "model.layers.0.self_attn.q_proj.bias" in set(f.keys())
    head = load_file(str(demo / "eagle/model.safetensors"))
    assert "fc.weight" in head and "norm.weight" in head and any(k.startswith("layer.") for k in head)
    summary = json.loads((demo / "demo.json").read_text())
    assert summary["size"] == "tiny" and summary["steps"] == demo_size("tiny").plan.steps
    text = problems(1, 0)[0].text
    assert tok.decode(tok.encode(text)) == text
    # one token per labelled number, digits of sums one by one
    assert all(tok.token_to_id(f"{c}{d}") is not None for c in "abcdefghijklmnopqrstuvwxyz" for d in "123456789")
    assert [tok.decode([i]) for i in tok.encode("13+d9=122")] == ["1", "3", "+", "d9", "=", "1", "2", "2"]


def test_build_is_deterministic_and_cached(demo: Path, tmp_path: Path) -> None:
    stamp = (demo / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(demo.parent) == demo
    assert (demo / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in demo.parent.iterdir() if p.name.startswith(".")]
    other = ensure_default_model(tmp_path)
    for name in FILES:
        assert (other / name).read_bytes() == (demo / name).read_bytes(), name


def test_engine_serves_it_with_every_drafter(demo: Path) -> None:
    d = default_drafters(demo)
    prompt = Tokenizer.from_dir(demo).encode(problems(1, 3)[0].prompt)  # type: ignore[union-attr]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    def auto(flag: str, folder: Path) -> str:  # the native engine's reading of a --drafter setting, as a flag
        return str(expand_auto(DrafterSpec.parse(flag), folder))

    assert auto("auto", demo) == f"suffix,{demo / 'draft'}"
    assert auto("suffix,auto", demo) == f"suffix,{demo / 'draft'}"
    assert auto("auto", demo / "draft") == "suffix" and auto("none", demo) == "none"
    for drafter, spec in (("none", "off"), (f"{d['suffix']},{d['draft']},{d['eagle']}", "adaptive"),
                          ("auto", "adaptive"),
                          (d["eagle"], "fixed"), (d["draft"], "fixed")):
        engine = LLMEngine(EngineConfig(model=str(demo), drafter=drafter, spec=spec, spec_k=3, max_model_len=256,
                                        max_num_seqs=4))
        outs.append(engine.generate([prompt], params)[0].outputs[0].token_ids)
    assert all(o == outs[0] for o in outs)  # greedy: speculative decoding changes nothing


def test_transformers_reads_the_folders(demo: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ids = torch.tensor([Tokenizer.from_dir(demo).encode(problems(1, 4)[0].text)])  # type: ignore[union-attr]
    for folder in (demo, demo / "draft"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        ours = load_model(folder, torch.float32, torch.device("cpu"))
        from service.models.llama import causal_meta
        from service.models.rope import Rope

        rope = Rope(ours.config, 256, torch.device("cpu"), torch.float32)
        with torch.no_grad():
            want = hf(ids).logits
            got = ours.logits(ours(ids, causal_meta(rope.cos, rope.sin, 1, ids.shape[1]), None, None))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
