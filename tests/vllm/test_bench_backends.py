"""Smoke test of bench/backends.py (--quick): the same long-tail rollout through a real server on the native
backend, and, in alternating rounds, through one on the vLLM backend and through vLLM's own AsyncLLM without our
layer; every run emits every requested token, and the JSON line's ratios follow from the reported seconds."""

from __future__ import annotations

import json

import pytest

from bench import backends


def test_one_rollout_natively_and_paired_rounds_on_vllm_and_raw_vllm(capsys) -> None:
    # one engine of each kind (native, our vLLM backend, bare AsyncLLM): the ratios need no more
    assert backends.main(["--quick", "--repeats", "2", "--configs", "native-off", "--paired", "off"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    native = out["results"]["native-off"]
    paired = out["paired_overhead_vs_raw_vllm"]["off"]
    runs = [native, paired["ours"], paired["raw"]]
    tokens = {r["tokens"] for r in runs}
    assert len(tokens) == 1 and tokens.pop() >= out["requests"] * 4  # ignore_eos: each its whole length, >= 4
    assert all(r["seconds"] > 0 and r["tokens_per_s"] > 0 for r in runs)
    assert len(paired["ours"]["all_seconds"]) == len(paired["raw"]["all_seconds"]) == 2
    per_pair = [1 - r / o for o, r in zip(paired["ours"]["all_seconds"], paired["raw"]["all_seconds"], strict=True)]
    assert paired["overhead_per_pair"] == pytest.approx(per_pair, abs=0.002)
    assert paired["overhead_median"] == pytest.approx(sum(per_pair) / 2, abs=0.002)
    ratios = out["ratios"]
    assert ratios["overhead_vs_raw_vllm"] is None and ratios["vllm_adaptive_vs_off"] is None  # not run
    assert set(out["loadavg"]) == {"start", "end"}
