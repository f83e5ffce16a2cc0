"""Attention over the cache (service/models/attention.py): both kernels compute the same attention, the choice
is made by timing once per layout, and the engine matches transformers with either kernel."""

from __future__ import annotations

import pytest
import torch
from helpers import make_checkpoint
from test_model_parity import check_logits_every_step

from service.models import attention

CPU = torch.device("cpu")


def reference(q, keys, values, bias):
    """Plain float64 softmax attention."""
    scores = q.double() @ keys.double().transpose(-1, -2) * q.shape[-1] ** -0.5 + bias.double()
    return scores.softmax(-1) @ values.double()


@pytest.mark.parametrize("kernel", attention.KERNELS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bf16"])
@pytest.mark.parametrize("B,Q,L", [(1, 1, 9), (3, 5, 40), (24, 1, 70), (16, 5, 100)])  # tiny and bmm-sized
def test_both_kernels_compute_masked_attention(kernel, dtype, tol, B, Q, L):
    Hkv, G, D = 2, 3, 16
    gen = torch.Generator().manual_seed(B * 100 + Q)
    cache = torch.randn(2, B, Hkv, L + 7, D, generator=gen).to(dtype)  # views of a longer cache, as served
    keys, values = cache[0, :, :, :L], cache[1, :, :, :L]
    q = torch.randn(B, Hkv, G * Q, D, generator=gen).to(dtype)
    # Row b sees keys up to its own length; the last row is padding and sees everything.
    pos = torch.tensor([[L - 1 - b - Q + 1 + j for j in range(Q)] for b in range(B)]).clamp(min=0)
    pos[-1] = L - 1
    hidden = torch.arange(L) > pos[:, None, None, :, None]  # [B, 1, 1, Q, L]
    bias = torch.zeros(B, Hkv, G, Q, L).masked_fill_(hidden, -torch.inf).view(B, Hkv, G * Q, L)
    got = attention.cached_attention(q, keys, values, bias.to(attention.mask_dtype(kernel, dtype)), kernel)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, keys, values, bias), atol=tol, rtol=tol)


def test_the_faster_kernel_is_chosen_once_per_layout(monkeypatch):
    monkeypatch.setattr(attention, "_chosen", {})
    calls = []

    def bmm_faster(fn) -> float:
        calls.append(fn)
        return 1.0 if len(calls) % 2 else 0.5  # sdpa is timed first at each shape

    assert attention.choose(2, 3, 16, torch.float32, CPU, bmm_faster) == "bmm"
    assert len(calls) == 2 * len(attention.TIMED_SHAPES)
    assert attention.choose(2, 3, 16, torch.float32, CPU, bmm_faster) == "bmm"  # kept: no new timing
    assert len(calls) == 2 * len(attention.TIMED_SHAPES)
    assert attention.choose(2, 3, 16, torch.bfloat16, CPU, lambda fn: 1.0) == "sdpa"  # a tie keeps one call
    assert attention.choose(2, 3, 16, torch.float32, torch.device("cuda"), bmm_faster) == "sdpa"  # never timed
    assert len(calls) == 2 * len(attention.TIMED_SHAPES)


@pytest.mark.parametrize("kernel", attention.KERNELS)
def test_engine_matches_transformers_with_either_kernel(kernel, monkeypatch):
    """Batches large enough that `bmm` does not hand over to SDPA (rows x keys > TINY_ROWS_X_KEYS)."""
    monkeypatch.setattr(attention, "choose", lambda *args, **kw: kernel)
    lengths = (100, 1, 60, 90, 37, 110)
    assert len(lengths) * max(lengths) > attention.TINY_ROWS_X_KEYS
    check_logits_every_step(make_checkpoint("qwen2", tied=True), steps=6, lengths=lengths)
