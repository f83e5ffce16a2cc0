"""The tests share one copy of each helper: waiting, metric parsing and the named checkpoints.

A helper written again in one module drifts from the shared one (another timeout message, another way to match a
metric name), so these checks find functions under tests/ that restate a shared helper by name, and
``make_checkpoint`` calls that spell out a checkpoint tests/helpers.py names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from probes import metric, metric_lines, wait_for

TESTS = Path(__file__).resolve().parent
# helper name -> the one module that defines it
SHARED = {"wait_for": "probes.py", "metric": "probes.py", "metric_lines": "probes.py"}
# make_checkpoint arguments -> the helpers.py function that names them
NAMED_CHECKPOINTS = {
    (("qwen2",), (("tied", True),)): "default_checkpoint()",
    (("qwen2",), (("tied", False),)): "default_checkpoint(tied=False)",
    (("qwen2",), (("init_std", 0.3), ("seed", 1), ("tied", True))): "peaked_checkpoint()",
    (("qwen2",), (("init_std", 0.3), ("seed", 2), ("tied", True))): "peaked_checkpoint(seed=2)",
    (("qwen2",), (("init_std", 0.1), ("seed", 3), ("tied", True))): "trainer_target_checkpoint()",
}


def definitions(root: Path, names: set[str]) -> list[tuple[str, str]]:
    """(module, name) of every function, at any depth, named one of `names` (leading underscores ignored)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.lstrip("_") in names:
                found.append((path.relative_to(root).as_posix(), node.name.lstrip("_")))
    return found


def spelled_out_checkpoints(root: Path) -> list[tuple[str, int, str]]:
    """(module, line, named helper) of each make_checkpoint call outside helpers.py with a named one's arguments."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "helpers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "make_checkpoint"
            if not call:
                continue
            try:
                args = tuple(ast.literal_eval(a) for a in node.args)
                kw = tuple(sorted((k.arg, ast.literal_eval(k.value)) for k in node.keywords if k.arg is not None))
            except ValueError:  # computed arguments: not a named checkpoint spelled out
                continue
            if (args, kw) in NAMED_CHECKPOINTS:
                found.append((path.relative_to(root).as_posix(), node.lineno, NAMED_CHECKPOINTS[args, kw]))
    return found


def test_each_shared_helper_is_defined_once() -> None:
    found = definitions(TESTS, set(SHARED))
    extra = [(module, name) for module, name in found if module != SHARED[name]]
    assert not extra, f"define these once, in tests/{{{', '.join(sorted(set(SHARED.values())))}}}: {extra}"
    assert sorted(name for _, name in found) == sorted(SHARED)


def test_the_check_finds_a_second_copy(tmp_path: Path) -> None:
    (tmp_path / "probes.py").write_text("def wait_for(cond, timeout, what):\n    pass\n")
    (tmp_path / "test_x.py").write_text("def test_a():\n    def _wait_for(c):\n        pass\n\n\n"
                                        "async def metric(text, name):\n    pass\n")
    assert sorted(definitions(tmp_path, set(SHARED))) == [("probes.py", "wait_for"), ("test_x.py", "metric"),
                                                           ("test_x.py", "wait_for")]


def test_named_checkpoints_are_built_through_their_names() -> None:
    assert not spelled_out_checkpoints(TESTS), "use the helpers.py function named on each"


def test_the_check_finds_a_spelled_out_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text('a = make_checkpoint("qwen2", seed=3, init_std=0.1, tied=True)\n'
                                        'b = make_checkpoint("qwen2", tied=True, seed=4)\n'
                                        'c = make_checkpoint(family, tied=True)\n')
    assert spelled_out_checkpoints(tmp_path) == [("test_x.py", 1, "trainer_target_checkpoint()")]


def test_wait_for_returns_the_value_and_names_what_it_waited_for() -> None:
    calls = iter([0, None, "ready"])
    assert wait_for(lambda: next(calls), 5, "a value", every=0.001) == "ready"

    def refused() -> bool:
        raise ConnectionRefusedError("not yet")

    with pytest.raises(AssertionError, match=r"waiting for the port \(last error: ConnectionRefusedError.*\nlog tail"):
        wait_for(refused, 0.05, "the port", every=0.01, ignoring=(OSError,), detail=lambda: "log tail")
    with pytest.raises(ValueError):  # an error it is not told to ignore is the test's failure
        wait_for(lambda: int("x"), 5, "an int")


def test_metric_matches_the_series_name_whole() -> None:
    text = ('# HELP x_total things\nx_total{kind="a"} 2.0\nx_total{kind="b"} 3.0\nx_total_created 1.7e9\n'
            "x_total_more 100.0\ny 4.0\n")
    assert metric(text, "x_total") == 5.0
    assert metric(text, 'x_total{kind="b"}') == 3.0
    assert metric_lines(text, "y") == ["y 4.0"] and metric(text, "z") == 0
