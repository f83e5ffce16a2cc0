"""Smoke test of bench/backends.py (--quick): the same long-tail rollout through real servers on the native and
the vLLM backend, and through vLLM's own AsyncLLM without our layer; every run emits every requested token, and
the JSON line's ratios follow from the reported seconds."""

from __future__ import annotations

import json

import pytest

from bench import backends

CONFIGS = ("native-off", "vllm-off", "raw-off")  # one run of each kind of engine: the ratios need no more


def test_one_rollout_on_each_backend_and_on_raw_vllm(capsys) -> None:
    assert backends.main(["--quick", "--repeats", "1", "--configs", ",".join(CONFIGS)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results = out["results"]
    assert set(results) == set(CONFIGS)
    tokens = {r["tokens"] for r in results.values()}
    assert len(tokens) == 1 and tokens.pop() >= out["requests"] * 4  # ignore_eos: each its whole length, >= 4
    assert all(r["seconds"] > 0 and r["tokens_per_s"] > 0 for r in results.values())
    seconds = {name: r["seconds"] for name, r in results.items()}
    ratios = out["ratios"]
    assert ratios["vllm_off_vs_native_off"] == pytest.approx(seconds["native-off"] / seconds["vllm-off"], abs=0.002)
    assert ratios["overhead_vs_raw_vllm"] == pytest.approx(1 - seconds["raw-off"] / seconds["vllm-off"], abs=0.002)
    assert ratios["vllm_adaptive_vs_off"] is None and ratios["native_adaptive_vs_off"] is None  # not run
    assert set(out["loadavg"]) == {"start", "end"}
