"""Imports run one way: every module imports only from its own layer and the layers below it (tests/layers.py)."""

from __future__ import annotations

from pathlib import Path

from layers import BELOW, LAYERS, check_file, check_tree, layer_of

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_imports_only_downwards():
    violations = check_tree(ROOT)
    assert not violations, "imports that run up a layer:\n" + "\n".join(map(str, violations))


def test_every_project_module_has_a_layer():
    for top in ("service", "client", "drafter_trainer", "bench", "examples"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            assert layer_of(".".join(p for p in parts if p != "__init__")) is not None, path


def test_the_order_is_acyclic():
    seen: dict[str, int] = {}

    def depth(layer: str) -> int:
        if layer not in seen:
            seen[layer] = -1  # on the stack: a cycle would recurse back here
            seen[layer] = 1 + max((depth(b) for b in BELOW[layer]), default=0)
        assert seen[layer] >= 0, f"layer order has a cycle through {layer}"
        return seen[layer]

    for layer in LAYERS:
        depth(layer)
    assert "api" not in BELOW["engine"] and "engine" not in BELOW["api"]


def _write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_reintroduced_upward_import_is_reported(tmp_path):
    """The checker itself: an API module that reaches into the engine, a buffer that imports the trainer
    lazily, a drafter that takes the engine object, a client that imports the server: each is reported with
    its file, line and the two layers."""
    cases = {
        "service/api/bad_api.py": "from service.engine.llm_engine import LLMEngine\n",
        "service/buffer/bad_buffer.py": "def f():\n    from drafter_trainer.embedded import EmbeddedTrainer\n",
        "service/engine/drafters/bad_drafter.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                  "    from service.engine.llm_engine import LLMEngine\n",
        "client/bad_client.py": "from service.params import SamplingParams\n",
        "service/models/bad_model.py": "from service import engine\n",
        "service/engine/bad_relative.py": "from ..api import context\n",
    }
    for rel, text in cases.items():
        _write(tmp_path, rel, text)
    for d in ("service", "service/api", "service/engine", "service/engine/drafters", "service/models",
              "service/buffer", "client"):
        _write(tmp_path, f"{d}/__init__.py", "")
    _write(tmp_path, "service/engine/llm_engine.py", "")
    _write(tmp_path, "service/api/context.py", "")
    found = {rel: [str(v) for v in check_file(tmp_path, tmp_path / rel)] for rel in cases}
    assert "api -> engine" in found["service/api/bad_api.py"][0]
    assert "service/api/bad_api.py:1:" in found["service/api/bad_api.py"][0]
    assert "buffer -> drafter_trainer" in found["service/buffer/bad_buffer.py"][0]
    assert "drafters get what they need" in found["service/engine/drafters/bad_drafter.py"][0]
    assert "client -> ground" in found["client/bad_client.py"][0]
    assert "models -> engine" in found["service/models/bad_model.py"][0]
    assert "engine -> api" in found["service/engine/bad_relative.py"][0]
    # and a downward import is fine
    ok = _write(tmp_path, "service/api/ok.py", "from service.backend.base import RolloutBackend\nimport torch\n")
    assert check_file(tmp_path, ok) == []
