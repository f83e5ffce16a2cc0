"""Smoke test of bench/step_profile.py on a tiny checkpoint: eager and compiled forwards (the engine's CPU
serving path) each report a decode and a verify step per batch size, with their shares and the ratio between
them that follows from the reported times."""

from __future__ import annotations

import json

import pytest
from helpers import make_checkpoint

from bench import step_profile
from service.engine.compiled import available as compiled_available
from service.models import attention


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_profile_reports_decode_and_verify_steps_per_batch(compiled, capsys) -> None:
    if compiled and not compiled_available():
        pytest.skip("torch.compile cannot build CPU code here (no C++ compiler)")
    path = make_checkpoint("qwen2", tied=True, seed=2, hidden_size=256, intermediate_size=512)
    args = ["--model", str(path), "--batches", "1,8", "--k", "2", "--context", "16", "--reps", "3"]
    assert step_profile.main(args + (["--compiled"] if compiled else [])) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["compiled"] is compiled
    assert set(out["steps"]) == {"b1_q1", "b1_q3", "b8_q1", "b8_q3"}
    for b in ("1", "8"):
        decode, verify = out["steps"][f"b{b}_q1"], out["steps"][f"b{b}_q3"]
        assert decode["ms"] > 0 and sum(decode["share"].values()) == pytest.approx(1.0, abs=0.01)
        assert {decode["kernel"], verify["kernel"]} <= set(attention.KERNELS)
        if b == "1":
            assert {decode["kernel"], verify["kernel"]} <= set(attention.ONE_ROW_KERNELS)
        assert verify["linear_gflop"] == pytest.approx(3 * decode["linear_gflop"], rel=0.1)  # rounded to 1e-3
        assert out["verify_over_decode"][b] == pytest.approx(verify["ms"] / decode["ms"], abs=0.01)
