"""Smoke test of bench/attention_kernels.py: every kernel timed on every shape, the same attention from each, and
rows of different lengths where the bench says so."""

from __future__ import annotations

import json

import torch

from bench import attention_kernels
from service.models import attention


def test_every_kernel_is_timed_on_every_shape_and_computes_the_same_attention(capsys) -> None:
    assert attention_kernels.main(["--rows", "6", "--reps", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kernels = {k for k in attention.KERNELS if attention.usable(k, torch.float32, 32)}
    assert len(out["shapes"]) == len(attention_kernels.SHAPES)
    for (*_, spread), row in zip(attention_kernels.SHAPES, out["shapes"].values(), strict=True):
        assert set(row["ms"]) == kernels and min(row["ms"].values()) > 0
        assert max(row["max_abs_diff"].values()) < 1e-4
        assert ("cpp_over_sdpa" in row) == ("cpp" in kernels)
        assert (row["mean_keys_of_longest"] < 1.0) == (spread > 0)


def test_rows_see_their_own_keys_and_the_longest_sets_the_mask() -> None:
    x = attention_kernels.inputs(torch.float32, rows=16, q_len=5, keys=200, spread=0.25)
    lengths = x["positions"][:, -1] + 1  # the last query of a row sees all of the row's keys
    assert lengths.max() == 200 and lengths.min() >= 5 and lengths.float().mean() < 200
    assert torch.equal(x["hidden"][:, 0], torch.arange(200) > x["positions"][:, :, None])
