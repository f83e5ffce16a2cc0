"""Smoke test of bench/spec_decode.py at --quick sizes: every config runs, repeats give a median run, the
summary's ratios follow from the reported seconds, and the per-workload PNG is written."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench import spec_decode


def test_quick_run_reports_median_runs_ratios_and_a_plot(tmp_path, capsys) -> None:
    code = spec_decode.main(["--quick", "--workloads", "long_tail", "--configs", "off,k=2,adaptive",
                             "--repeats", "2", "--plot-dir", str(tmp_path), "--threads", "1",
                             "--strategy-trace", str(tmp_path / "traces")])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    w = summary["workloads"]["long_tail"]
    results = w["results"]
    assert set(results) == {"off", "k=2", "adaptive"}
    for r in results.values():
        assert len(r["seconds_runs"]) == 2 and r["seconds"] == min(r["seconds_runs"])  # median of two: the lower
        assert r["tokens"] == sum(spec_decode.workload("long_tail", 4, 4, 16, 0.9, 96, 4096, 0)[1])
    assert set(results["off"]["strategies"]) == {"plain"}
    assert results["off"]["held_steps"] == results["k=2"]["held_steps"] == 0  # a fixed choice is never held
    assert 0 <= results["adaptive"]["held_steps"] < sum(results["adaptive"]["strategies"].values())
    assert w["best_fixed"] == "k=2"
    assert w["ratio_adaptive_vs_off"] == pytest.approx(results["off"]["seconds"] / results["adaptive"]["seconds"],
                                                       abs=1e-3)
    paired = [b / a for b, a in zip(results["k=2"]["seconds_runs"], results["adaptive"]["seconds_runs"], strict=True)]
    assert w["ratio_adaptive_vs_best_fixed_paired"]["runs"] == pytest.approx(sorted(paired), abs=1e-3)
    assert w["ratio_adaptive_vs_best_fixed_paired"]["median"] == pytest.approx(min(paired), abs=1e-3)
    # The per-bucket oracle: SD off's tokens at the best rate in each bucket, so faster than either config's run
    # (whose seconds also hold the prefill).
    assert 0 < w["bucket_oracle_seconds"] <= min(results["off"]["seconds"], results["k=2"]["seconds"])
    assert w["ratio_bucket_oracle_vs_best_fixed"] == pytest.approx(
        results["k=2"]["seconds"] / w["bucket_oracle_seconds"], rel=0.01)  # the JSON rounds the seconds
    assert (tmp_path / "spec_decode_long_tail.png").stat().st_size > 0
    assert "start" in summary["loadavg"] and summary["threads"] == 1
    # One strategy trace per adaptive run; the median run's decode steps are the last lines of one of them.
    traces = sorted((tmp_path / "traces").iterdir())
    assert [t.name for t in traces] == ["trace_long_tail_0.jsonl", "trace_long_tail_1.jsonl"]
    want = Counter(results["adaptive"]["strategies"])
    tails = [[json.loads(line)["arm"] for line in t.read_text().splitlines()][-want.total():] for t in traces]
    assert want in [Counter(tail) for tail in tails]


def test_an_empty_plot_dir_writes_no_plot(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # '' once meant the working directory
    assert spec_decode.main(["--quick", "--workloads", "long_tail", "--configs", "off", "--repeats", "1",
                             "--plot-dir", "", "--threads", "1"]) == 0
    assert "long_tail" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["workloads"]
    assert not list(tmp_path.glob("*.png"))


def test_repeats_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        spec_decode.main(["--quick", "--repeats", "0"])


def test_the_plot_tells_assisted_steps_apart(tmp_path) -> None:
    from bench.spec_plots import _k_of, _kind_of, strategy_plot

    names = ["plain", "draft:k=4", "draft:k=6+suffix", "suffix:k=8"]
    assert [(_kind_of(n), _k_of(n)) for n in names] == [("plain", 0), ("draft", 4), ("draft+suffix", 6),
                                                        ("suffix", 8)]
    trace = [[64 - i, n, 0.1, 64] for i, n in enumerate(names)]
    results = {"adaptive": {"per_bucket": {"64": 700.0}, "trace": trace}}
    assert strategy_plot("long_tail", results, tmp_path / "p.png").stat().st_size > 0


def test_warm_runs_time_the_second_rollout_of_an_engine(tmp_path, capsys) -> None:
    lengths = spec_decode.workload("long_tail", 4, 4, 16, 0.9, 96, 4096, 0)[1]
    assert spec_decode.main(["--quick", "--workloads", "long_tail", "--configs", "off,adaptive", "--repeats", "1",
                             "--plot-dir", "", "--threads", "1", "--warm",
                             "--strategy-trace", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["warm"] is True
    results = summary["workloads"]["long_tail"]["results"]
    for name, r in results.items():
        assert r["tokens"] == sum(lengths), name  # the untimed rollout's tokens are not counted
    assert results["off"]["warm_steps"] >= max(lengths) - 1  # it ran to its longest request first
    # The engine's trace holds the untimed rollout's decode steps before the timed one's.
    ada = results["adaptive"]
    assert ada["warm_steps"] > 0
    lines = (tmp_path / "trace_long_tail_0.jsonl").read_text().splitlines()
    assert len(lines) >= ada["warm_steps"] + sum(ada["strategies"].values())


def test_the_perfect_config_is_the_target_drafting_for_itself_its_drafting_left_out(capsys) -> None:
    assert spec_decode.main(["--quick", "--workloads", "long_tail", "--configs", "off,perfect", "--perfect-k", "4",
                             "--repeats", "1", "--plot-dir", "", "--threads", "1"]) == 0
    w = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["workloads"]["long_tail"]
    off, perfect = w["results"]["off"], w["results"]["perfect"]
    assert perfect["acceptance"] > 0.95  # q = p: min(1, p / q) accepts (nearly) every draft
    assert off["acceptance"] is None
    assert off["drafting_seconds"] == 0.0 < perfect["drafting_seconds"] < perfect["seconds"]
    assert w["ratio_perfect_vs_off"] == pytest.approx(
        off["seconds"] / (perfect["seconds"] - perfect["drafting_seconds"]), rel=0.01)
    assert "ratio_adaptive_vs_best_fixed" not in w  # neither a fixed k nor adaptive ran
