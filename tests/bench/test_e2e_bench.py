"""bench/e2e.py end to end on the tiny demo model: real servers, the GRPO example, the JSON line and the plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import e2e, trace_summary


def test_quick_e2e_run_writes_summary_records_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    traces = tmp_path / "traces"
    assert e2e.main(["--quick", "--no-pin", "--runs", "off,adaptive-suffix", "--out-dir", str(out),
                     "--strategy-trace", str(traces)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = summary["runs"]
    assert len(summary["loadavg"]["start"]) == 3 and len(summary["loadavg"]["end"]) == 3
    assert list(runs) == ["off", "adaptive-suffix"]
    assert runs["off"]["tokens_per_step"] == [1.0, 1.0, 1.0] and runs["off"]["rollout_speedup"] == 1.0
    assert all(t >= 1.0 for t in runs["adaptive-suffix"]["tokens_per_step"])
    assert runs["adaptive-suffix"]["drafter_versions"][0] == ["suffix@0"]
    base = runs["off"]
    for r in runs.values():
        assert r["forward_tokens"] > r["trained_tokens"] or r["forward_tokens"] == 0  # the rows hold their prompts
        if r["forward_tokens"]:
            assert r["update_ms_per_forward_token"] == pytest.approx(1e3 * r["update_s"] / r["forward_tokens"],
                                                                     rel=0.05)
        assert r["step_speedup_same_update"] == pytest.approx(
            base["step_s"] / (r["rollout_s"] + base["update_s"] + r["push_s"]), rel=0.01)
        assert r["output_tokens"] > 0 and r["logprob_max_abs_diff"] < 1e-3 and len(r["reward"]) == 3
    saved = json.loads((out / "e2e.json").read_text())
    assert [rec["policy_version"] for rec in saved["records"]["off"]] == ["0", "step-1", "step-2"]
    assert sorted(p.name for p in out.glob("*.png")) == ["e2e_accepted_length.png", "e2e_lengths.png",
                                                         "e2e_reward.png", "e2e_rollout_time.png"]

    # One strategy trace per run; bench/trace_summary.py finds the three GRPO steps' rollouts in each and accounts
    # for every token the decode steps emitted (a sample's first token comes from its prefill).
    assert sorted(p.name for p in traces.iterdir()) == ["trace_adaptive-suffix.jsonl", "trace_off.jsonl"]
    assert trace_summary.main([str(traces / "trace_off.jsonl"), str(traces / "trace_adaptive-suffix.jsonl")]) == 0
    off, adaptive = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]
    for name, run in (("off", off), ("adaptive-suffix", adaptive)):
        recs = saved["records"][name]
        assert run["rollouts"] == len(recs) == 3
        assert run["total"]["tokens"] == sum(r["output_tokens"] - r["samples"] for r in recs)
        for key in ("steps", "tokens"):
            assert sum(b[key] for b in run["buckets"].values()) == run["total"][key]
    assert all(b["arms"] == {"plain": 1.0} and b["tokens_per_row_step"] == 1.0 for b in off["buckets"].values())
    for k, b in adaptive["buckets"].items():
        if k in off["buckets"]:
            assert b["tokens_per_s_vs_first"] == pytest.approx(b["tokens_per_s"] / off["buckets"][k]["tokens_per_s"],
                                                               rel=0.01)
