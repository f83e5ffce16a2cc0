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


def test_the_faster_kernel_is_chosen_per_kind_of_step_and_cache_length_once_per_layout(monkeypatch):
    monkeypatch.setattr(attention, "_chosen", {})
    calls = []

    def bmm_faster_at_short_decode_and_long_verify(fn) -> float:
        calls.append(fn)
        n = len(calls)  # per timed shape (decode short, long, verify short, long): sdpa, then bmm
        return 0.5 if n in (2, 8) else 1.0

    fake = bmm_faster_at_short_decode_and_long_verify
    want = ("bmm", "sdpa", "sdpa", "bmm")
    assert attention.choose(2, 3, 16, torch.float32, CPU, fake) == want
    assert len(calls) == 2 * len(attention.TIMED_SHAPES)
    assert attention.choose(2, 3, 16, torch.float32, CPU, fake) == want  # kept
    assert len(calls) == 2 * len(attention.TIMED_SHAPES)
    assert attention.choose(2, 3, 16, torch.bfloat16, CPU, lambda fn: 1.0) == ("sdpa",) * 4  # ties: one call
    assert attention.choose(2, 3, 16, torch.float32, torch.device("cuda"), fake) == ("sdpa",) * 4
    assert len(calls) == 2 * len(attention.TIMED_SHAPES)  # CUDA: never timed
    long = attention.LONG_KEYS + 1
    assert [attention.pick(want, q, n) for q, n in ((1, 9), (1, long), (5, 9), (2, long))] == list(want)


def test_each_kind_of_step_runs_its_kernel(monkeypatch, tiny_qwen2):
    from service.engine.cached_model import CachedModel
    from service.engine.kv_cache import KVCache
    from service.models.loader import load_model

    monkeypatch.setattr(attention, "choose", lambda *args, **kw: ("bmm", "sdpa", "sdpa", "bmm"))
    model = load_model(tiny_qwen2, torch.bfloat16, CPU)
    cached = CachedModel(model, KVCache(model.config, 4, 400, torch.bfloat16, CPU), CPU)
    long = attention.LONG_KEYS
    decode, _ = cached.build_meta(0, [5, 9], [1, 1])
    verify, _ = cached.build_meta(0, [5, 9], [3, 1])
    long_decode, _ = cached.build_meta(0, [5, long], [1, 1])  # attends to LONG_KEYS + 1 keys
    long_verify, _ = cached.build_meta(0, [long, 9], [3, 1])
    assert (decode.kernel, decode.bias.dtype) == ("bmm", torch.float32)
    assert (verify.kernel, verify.bias.dtype) == ("sdpa", torch.bfloat16)
    assert (long_decode.kernel, long_decode.bias.dtype) == ("sdpa", torch.bfloat16)
    assert (long_verify.kernel, long_verify.bias.dtype) == ("bmm", torch.float32)


@pytest.mark.parametrize("kernels", [("sdpa", "sdpa"), ("bmm", "bmm"), ("bmm", "sdpa"), ("sdpa", "bmm")],
                         ids=lambda k: "decode-{}-prefill-{}".format(*k))
def test_engine_matches_transformers_with_either_kernel(kernels, monkeypatch):
    """Batches large enough that `bmm` does not hand over to SDPA (rows x keys > TINY_ROWS_X_KEYS)."""
    monkeypatch.setattr(attention, "choose", lambda *args, **kw: (kernels[0], kernels[0], kernels[1], kernels[1]))
    lengths = (100, 1, 60, 90, 37, 110)
    assert len(lengths) * max(lengths) > attention.TINY_ROWS_X_KEYS
    check_logits_every_step(make_checkpoint("qwen2", tied=True), steps=6, lengths=lengths)
