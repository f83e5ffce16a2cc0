"""bench/core_probe.py measures what it says: two loops pinned to one CPU share it, so each runs at about half its
rate alone (the case the probe must never report as independent)."""

from __future__ import annotations

import json
import os

import pytest

from bench import core_probe


def test_one_cpu_shared_by_two_loops_shows_about_half_the_rate() -> None:
    cpu = min(os.sched_getaffinity(0))
    out = core_probe.sharing({cpu}, {cpu}, seconds=1.0)
    assert out["measured_cpus"] == out["busy_cpus"] == [cpu]
    assert out["alone_per_s"] > 0
    assert 0.2 < out["rate_with_other_busy"] < 0.75, out


def test_the_cli_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    cpu = min(os.sched_getaffinity(0))
    assert core_probe.main([str(cpu), str(cpu), "--seconds", "0.3"]) == 0
    line = json.loads(capsys.readouterr().out.strip())
    assert set(line) == {"measured_cpus", "busy_cpus", "alone_per_s", "shared_per_s", "rate_with_other_busy"}
