"""bench/streaming.py at --quick sizes against a real server: both modes serve every round's rollout, decode the same
tokens, and the paired ratio follows from the seconds it reports."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from bench import streaming


def test_quick_run_pairs_streamed_and_whole_rollouts(capsys: pytest.CaptureFixture[str]) -> None:
    cores = os.sched_getaffinity(0)
    assert streaming.main(["--quick", "--enforce-eager", "--rounds", "2"]) == 0
    assert os.sched_getaffinity(0) == cores  # the bench gives this process its cores back
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "streaming" and out["rounds"] == 2 and len(out["loadavg"]) == 4
    assert len(out["streamed_s"]) == len(out["final_only_s"]) == 2
    assert out["same_tokens"] is True  # the same prompts and seeds, whichever way the tokens travel
    runs = [a / b for a, b in zip(out["streamed_s"], out["final_only_s"], strict=True)]
    assert out["ratio_streamed_vs_final_only"]["runs"] == pytest.approx(runs, abs=2e-3)
    assert out["ratio_streamed_vs_final_only"]["median"] == pytest.approx(statistics.median(runs), abs=2e-3)


def test_rounds_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        streaming.main(["--rounds", "0"])
