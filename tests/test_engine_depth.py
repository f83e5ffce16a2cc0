"""The native engine is at most six floors deep: its longest chain of imports, counted from the source (ast), with
TYPE_CHECKING and in-function imports (tests/layers.py `import_graph`): an annotation is still a module a reader
follows. Shared records sit at the bottom (service/engine/types.py), host-list tensors one floor up
(batch_tensors.py); the engine thread types the engine by its contract (inbox.py `EngineCore`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from layers import import_graph, imports_of, longest_chain

ROOT = Path(__file__).resolve().parents[1]
MAX_FLOORS = 6


def test_the_engine_import_chain_is_at_most_six_floors():
    chain = longest_chain(import_graph(ROOT, "service.engine"))
    assert len(chain) <= MAX_FLOORS, f"{len(chain)} floors: " + " -> ".join(chain)


def test_nothing_the_scheduler_imports_imports_torch():
    """The scheduler is torch-free, and so is everything inside the engine it reaches (its records)."""
    import ast

    graph = import_graph(ROOT, "service.engine")
    reached, todo = set(), ["service.engine.scheduler"]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += graph[m]
    for m in sorted(reached):
        path = ROOT.joinpath(*m.split(".")).with_suffix(".py")
        imported = {t for _, t in imports_of(ast.parse(path.read_text()), m, False)}
        assert not any(t == "torch" or t.startswith("torch.") for t in imported), m


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_counter_follows_type_checking_and_lazy_imports_and_reports_cycles(tmp_path):
    _write(tmp_path, "pkg/__init__.py", "")
    _write(tmp_path, "pkg/top.py", "from pkg.mid import X\n")
    _write(tmp_path, "pkg/mid.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low import Y\n")
    _write(tmp_path, "pkg/low.py", "def f():\n    from pkg.base import g\n")
    _write(tmp_path, "pkg/base.py", "import os\n")
    assert longest_chain(import_graph(tmp_path, "pkg")) == ["pkg.top", "pkg.mid", "pkg.low", "pkg.base"]
    _write(tmp_path, "pkg/base.py", "from pkg.top import Z\n")
    with pytest.raises(ValueError, match="import cycle"):
        longest_chain(import_graph(tmp_path, "pkg"))
