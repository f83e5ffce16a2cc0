"""bench/ceiling.py at --quick sizes: the perfect drafter (the target drafting for itself) has nearly every draft
accepted, and the ceilings follow from the per-bucket figures it reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import ceiling


def test_quick_run_reports_a_perfect_drafter_and_the_ceilings(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    e2e = tmp_path / "e2e.json"  # what bench.e2e writes, SD off's run: a 2 s step, 1 s of it the rollout
    e2e.write_text(json.dumps({"summary": {"runs": {"off": {"step_s": 2.0, "rollout_s": 1.0, "update_s": 0.9,
                                                            "push_s": 0.1}}}}))
    assert ceiling.main(["--quick", "--enforce-eager", "--k", "4", "--e2e", str(e2e)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["k"] == 4 and out["compiled"] is False
    assert out["perfect_acceptance"] > 0.95  # q = p: min(1, p / q) accepts (nearly) every draft
    for b, row in out["buckets"].items():
        if row["perfect_tokens_per_row_step"] is not None:
            assert 1.0 <= row["perfect_tokens_per_row_step"] <= 5.0, b  # at most k + 1 a row
    assert sum(row["off_share"] for row in out["buckets"].values()) == pytest.approx(1.0, abs=0.01)
    assert out["rollout_ceiling"] == pytest.approx(out["off_decode_s"] / out["perfect_decode_s"], rel=0.01)
    assert out["rollout_ceiling"] > 1.0  # k + 1 tokens a step cost less than k + 1 steps, even eagerly
    # The step: the rollout shortened by the ceiling, update and push as they were.
    assert out["step_ceiling"] == pytest.approx(2.0 / (1.0 / out["rollout_ceiling"] + 1.0), rel=0.01)
    assert out["step_ceiling_no_rollout"] == pytest.approx(2.0, rel=1e-3)


def test_depth_and_rollouts_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        ceiling.main(["--quick", "--k", "0"])
