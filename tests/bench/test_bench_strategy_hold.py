"""Smoke test of bench/strategy_hold.py: both settings generate the same responses, the held setting holds
choices and the other does not, and the figures it reports follow from each other."""

from __future__ import annotations

import json

import pytest

from bench import strategy_hold


def test_both_settings_emit_the_same_tokens_and_only_one_holds(capsys) -> None:
    assert strategy_hold.main(["--rounds", "2", "--max-tokens", "60", "--enforce-eager"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    every, held = out["every_step"], out["held"]
    assert out["same_tokens"] is True
    assert every["tokens"] == held["tokens"] == 2 * 60
    assert every["held_steps"] == 0 and 0 < held["held_steps"] < held["steps"], out
    assert out["speedup"] == pytest.approx(held["tokens_per_s"] / every["tokens_per_s"], rel=0.01)
