"""One reading of `--drafter` (service/drafter_spec.py) for both backends and the trainer; engine configs stay as
their caller built them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import default_checkpoint

from drafter_trainer.build import NothingToTrain, trainable
from service.config import ConfigError, EngineConfig
from service.drafter_spec import DrafterItem, DrafterSpec
from service.engine.llm_engine import LLMEngine, expand_auto
from service.vllm.config import VllmConfigError, vllm_drafter


def test_a_setting_parses_into_typed_items_in_order_each_once() -> None:
    spec = DrafterSpec.parse(" suffix, eagle:/heads/e ,none,/models/d,suffix,eagle,ngram,auto")
    assert spec.items == (DrafterItem("suffix"), DrafterItem("eagle", "/heads/e"),
                          DrafterItem("draft_model", "/models/d"), DrafterItem("eagle"), DrafterItem("ngram"),
                          DrafterItem("auto"))
    assert str(spec) == "suffix,eagle:/heads/e,/models/d,eagle,ngram,auto"
    assert DrafterSpec.parse(str(spec)) == spec  # what GetServerInfo reports reads back the same
    assert DrafterSpec.parse("none") == DrafterSpec.parse("") == DrafterSpec() and str(DrafterSpec()) == "none"
    assert [i.has_weights for i in spec.items] == [False, True, True, True, False, False]
    assert EngineConfig(drafter="suffix").drafter == DrafterSpec((DrafterItem("suffix"),))


def test_each_backend_reads_auto_and_folders_its_own_way(tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "draft").mkdir(parents=True)
    (model / "draft" / "config.json").write_text("{}")
    auto = DrafterSpec.parse("auto")
    assert str(expand_auto(auto, model)) == f"suffix,{model / 'draft'}"  # native: suffix + the shipped draft
    assert str(expand_auto(auto, tmp_path)) == "suffix"
    assert vllm_drafter(auto, model) == DrafterItem("ngram")  # vLLM: one model-free method
    # vLLM finds a relative draft folder inside the model folder
    found = vllm_drafter(DrafterSpec.parse("draft"), model)
    assert found == DrafterItem("draft_model", str((model / "draft").resolve()))
    for bad, why in (("suffix,ngram", "one drafter per engine"), ("eagle", "needs a trained head folder"),
                     (str(tmp_path / "nothing"), "draft-model folder with config.json")):
        with pytest.raises(VllmConfigError, match=why):
            vllm_drafter(DrafterSpec.parse(bad), model)


def test_the_trainer_trains_the_first_drafter_with_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert trainable(DrafterSpec.parse(f"suffix,{tmp_path},eagle")) == ("draft", str(tmp_path))
    assert trainable(DrafterSpec.parse(f"suffix,{tmp_path / 'missing'},eagle:/h")) == ("eagle", "/h")
    with pytest.raises(NothingToTrain):
        trainable(DrafterSpec.parse("suffix,ngram"))


def test_the_engine_leaves_its_callers_config_as_it_was() -> None:
    config = EngineConfig(model=str(default_checkpoint()), drafter="auto,suffix", max_model_len=64,
                          max_num_seqs=2, kv_cache_memory_gb=0.01, enforce_eager=True)
    before = dataclasses.replace(config)
    engine = LLMEngine(config)
    assert config == before and str(config.drafter) == "auto,suffix"
    assert str(engine.drafter_spec) == "suffix" and list(engine.drafters) == ["suffix"]
    with pytest.raises(ConfigError, match="neither 'none', 'suffix' nor a model folder"):
        LLMEngine(dataclasses.replace(config, drafter="ngram"))
