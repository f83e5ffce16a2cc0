"""The default model ships as safetensors built by our own code (service/demo/weights, a few MB): it verifies
against its SHA256SUMS, is served without building anything (first start in seconds), solves the demo task, a
tampered file makes it fall back to building, and the ship command rebuilds bit-identically (tiny size here;
the full size takes minutes and is checked with ``python3 -m service.demo.ship --check``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from service.config import EngineConfig
from service.demo import ship
from service.demo.build import SIZE_ENV
from service.demo.default_model import REQUIRED_FILES, ensure_default_model, model_name
from service.demo.task import Difficulty, problems, reward
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams

MAX_SHIPPED_MB = 12


def test_shipped_weights_verify_and_are_small() -> None:
    folder = ship.WEIGHTS_ROOT / model_name("full")
    assert ship.verified(folder)
    assert set(ship.read_sums(folder)) >= set(REQUIRED_FILES)
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert 1e6 < total < MAX_SHIPPED_MB * 1e6
    assert json.loads((folder / "demo.json").read_text())["size"] == "full"


def test_default_model_is_served_from_the_package_without_a_build(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SIZE_ENV, "full")
    cache = tmp_path / "cache"
    assert ensure_default_model(cache) == ship.WEIGHTS_ROOT / model_name("full")
    assert not cache.exists()  # nothing was built or written


def test_shipped_model_solves_short_sums() -> None:
    folder = ship.WEIGHTS_ROOT / model_name("full")
    engine = LLMEngine(EngineConfig(model=str(folder), max_model_len=256, max_num_seqs=8))
    assert engine.tokenizer is not None
    probs = problems(4, 101, Difficulty(min_terms=2, max_terms=2))
    results = engine.generate([engine.tokenizer.encode(p.prompt) for p in probs],
                              SamplingParams(temperature=0.0, max_tokens=80))
    texts = [engine.tokenizer.decode(r.outputs[0].token_ids) for r in results]
    assert sum(reward(p, t) for p, t in zip(probs, texts, strict=True)) == len(probs), texts


def test_tampered_weights_are_not_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = model_name("full")
    root = tmp_path / "weights"
    shutil.copytree(ship.WEIGHTS_ROOT / name, root / name)
    monkeypatch.setattr(ship, "WEIGHTS_ROOT", root)
    assert ship.shipped_dir(name) == root / name
    data = bytearray((root / name / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (root / name / "model.safetensors").write_bytes(bytes(data))
    assert ship.shipped_dir(name) is None
    (root / name / "extra.bin").write_bytes(b"x")
    assert not ship.verified(root / name)


def test_ship_rebuilds_bit_identically_at_the_tiny_size(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    root.mkdir()
    assert ship.main(["--size", "tiny", "--root", str(root)]) == 0
    folder = root / model_name("tiny")
    assert ship.verified(folder) and not [p for p in root.iterdir() if p.name.startswith(".")]
    assert ship.main(["--size", "tiny", "--root", str(root), "--check"]) == 0  # a second build, same bytes
    sums = ship.read_sums(folder)
    (folder / ship.SUMS).write_text((folder / ship.SUMS).read_text().replace(sums["model.safetensors"], "0" * 64))
    assert not ship.verified(folder)
