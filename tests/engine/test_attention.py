"""Attention over the cache (service/models/attention.py): the kernels compute the same attention, the choice
is made by timing once per layout, and the engine matches transformers with any kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import default_checkpoint
from test_model_parity import check_logits_every_step

from service.models import attention, attention_cpp

CPU = torch.device("cpu")
TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
# (KV heads, group, positions, head size) for the cpp kernel
CPP_SHAPES = [(1, 4, 5, 32), (2, 1, 3, 48), (1, 2, 8, 48), (1, 2, 9, 64), (2, 2, 2, 128), (1, 1, 17, 256)]


def reference(q, keys, values, bias):
    """Plain float64 softmax attention."""
    scores = q.double() @ keys.double().transpose(-1, -2) * q.shape[-1] ** -0.5 + bias.double()
    return scores.softmax(-1) @ values.double()


@pytest.mark.parametrize("kernel", attention.KERNELS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bf16"])
@pytest.mark.parametrize("B,Q,L", [(1, 1, 9), (3, 5, 40), (24, 1, 70), (16, 5, 100)])  # tiny and bmm-sized
def test_every_kernel_computes_masked_attention(kernel, dtype, tol, B, Q, L):
    Hkv, G, D = 2, 3, 16
    gen = torch.Generator().manual_seed(B * 100 + Q)
    cache = torch.randn(2, B, Hkv, L + 7, D, generator=gen).to(dtype)  # views of a longer cache, as served
    keys, values = cache[0, :, :, :L], cache[1, :, :, :L]
    q = torch.randn(B, Hkv, G * Q, D, generator=gen).to(dtype)
    # Row b sees keys up to its own length, 3 b shorter than the longest; the last row is padding, at a scratch
    # position past the keys, and sees everything.
    pos = torch.tensor([[L - 1 - 3 * b - Q + 1 + j for j in range(Q)] for b in range(B)]).clamp(min=0)
    pos[-1] = L + 6
    hidden = torch.arange(L) > pos[:, None, None, :, None]  # [B, 1, 1, Q, L]
    bias = torch.zeros(B, Hkv, G, Q, L).masked_fill_(hidden, -torch.inf).view(B, Hkv, G * Q, L)
    mask = attention.mask_dtype(kernel, dtype)  # None: the kernel takes the positions alone
    got = attention.cached_attention(q, keys, values, None if mask is None else bias.to(mask), kernel, pos)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, keys, values, bias), atol=tol, rtol=tol)


def test_the_fastest_kernel_is_chosen_per_kind_of_step_and_cache_length_once_per_layout(monkeypatch):
    monkeypatch.setattr(attention, "_chosen", {})
    monkeypatch.setattr(attention, "usable", lambda kernel, dtype, head_dim: True)
    times = [{"sdpa": 1.0, "bmm": 0.5, "cpp": 0.8},  # decode, short cache: bmm
             {"sdpa": 1.0, "bmm": 0.95, "cpp": 1.2},  # decode, long: sdpa (bmm saves under 1 - WIN_MARGIN)
             {"sdpa": 1.0, "bmm": 1.0, "cpp": 0.6},  # verify, short: cpp
             {"sdpa": 1.0, "bmm": 0.5, "cpp": 0.4}]  # verify, long: cpp
    calls = []

    def fake(fn) -> float:
        calls.append(fn)
        shape, kernel = divmod(len(calls) - 1, len(attention.KERNELS))  # per timed shape, each kernel in turn
        return times[shape][attention.KERNELS[kernel]]

    want = ("bmm", "sdpa", "sdpa", "bmm", "bmm", "sdpa", "cpp", "cpp")  # one-row steps: sdpa or bmm
    assert attention.choose(2, 3, 16, torch.float32, CPU, fake) == want
    assert len(calls) == len(attention.KERNELS) * len(attention.TIMED_SHAPES)
    assert attention.choose(2, 3, 16, torch.float32, CPU, fake) == want  # kept
    assert len(calls) == len(attention.KERNELS) * len(attention.TIMED_SHAPES)
    assert attention.choose(2, 3, 16, torch.bfloat16, CPU, lambda fn: 1.0) == ("sdpa",) * 8  # ties: one call
    assert attention.choose(2, 3, 16, torch.float32, torch.device("cuda"), fake) == ("sdpa",) * 8
    assert len(calls) == len(attention.KERNELS) * len(attention.TIMED_SHAPES)  # CUDA: never timed
    long = attention.LONG_KEYS + 1
    steps = [(rows, q, n) for rows in (1, 3) for q, n in ((1, 9), (1, long), (5, 9), (2, long))]
    assert [attention.pick(want, *step) for step in steps] == list(want)


def test_the_cpp_kernel_is_left_out_where_it_does_not_run(monkeypatch):
    assert attention.usable("cpp", torch.bfloat16, 64) and attention.usable("cpp", torch.float32, 48)
    assert not attention.usable("cpp", torch.float16, 64)
    assert not attention.usable("cpp", torch.float32, 40)  # not a multiple of 16
    assert not attention.usable("cpp", torch.float32, 272)  # over 16 x 16
    monkeypatch.setattr(attention, "_chosen", {})
    timed = []
    attention.choose(1, 2, 40, torch.float32, CPU, lambda fn: timed.append(fn) or 1.0)
    assert len(timed) == 2 * len(attention.TIMED_SHAPES)  # sdpa and bmm only


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bf16"])
@pytest.mark.parametrize("Hkv,G,Q,D", CPP_SHAPES)
def test_the_cpp_kernel_over_head_sizes_and_groups(dtype, tol, Hkv, G, Q, D):
    """Every head size it takes (fixed and run-time vector counts), GQA groups, more query rows than one block of
    P.V accumulators (16 rows in blocks of 5 at D = 48), rows of different lengths (each task stops at its own
    keys, and the scores' stride with it), positions past the keys (padding: sees all) and one below them (sees
    nothing: zeros, where the library kernels give NaN)."""
    B, L = 3, 37
    gen = torch.Generator().manual_seed(D)
    cache = torch.randn(2, B, Hkv, L + 3, D, generator=gen).to(dtype)
    keys, values = cache[0, :, :, :L], cache[1, :, :, :L]
    q = torch.randn(B, Hkv, G * Q, D, generator=gen).to(dtype)
    pos = torch.randint(0, L, (B, Q), generator=gen)
    pos[0, 0], pos[2, -1] = L + 4, 3  # a padding query; a row whose last query sees 4 keys
    pos[1, -1] = -3  # sees nothing
    hidden = torch.arange(L) > pos[:, None, None, :, None]  # [B, 1, 1, Q, L]
    bias = torch.zeros(B, Hkv, G, Q, L).masked_fill_(hidden, -torch.inf).view(B, Hkv, G * Q, L)
    got = attention.cached_attention(q, keys, values, None, "cpp", pos)
    want = reference(q, keys, values, bias)
    want.view(B, Hkv, G, Q, D)[1, :, :, -1] = 0.0
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_the_cpp_kernel_reads_no_key_past_its_rows_own_and_refuses_what_does_not_fit_its_positions():
    """A row's task stops at the keys its last query sees: another row's longer cache is padding to it (NaN here,
    which a masked score would still carry into the softmax), and its result is that over its own keys alone."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 6, 32, generator=gen)  # G = 2 heads x 3 positions
    keys, values = torch.randn(2, 2, 1, 9, 32, generator=gen)
    keys[1, :, 5:], values[1, :, 5:] = torch.nan, torch.nan
    pos = torch.tensor([[6, 7, 8], [2, 3, 4]])
    got = attention.cached_attention(q, keys, values, None, "cpp", pos)
    assert not got.isnan().any()
    alone = attention.cached_attention(q[1:], keys[1:, :, :5], values[1:, :, :5], None, "cpp", pos[1:])
    assert torch.equal(got[1:], alone)
    with pytest.raises(ValueError, match="positions"):  # 4 positions do not divide 6 query rows
        attention.cached_attention(q, keys, values, None, "cpp", torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="positions"):
        attention.cached_attention(q, keys, values, None, "cpp", pos.float())
    with pytest.raises(ValueError, match="positions"):  # none at all
        attention.cached_attention(q, keys, values, None, "cpp", pos[:, :0])
    with pytest.raises(ValueError, match="positions, not a mask"):
        attention.cached_attention(q, keys, values, torch.zeros(2, 1, 6, 9), "cpp")


def test_the_cpp_kernel_stays_inside_its_buffers_under_address_sanitizer(tmp_path):
    """The kernel's shapes above, built with AddressSanitizer, in a fresh process: any read or write outside a
    buffer (a past bug: P.V's last block of queries read past the scores) aborts it."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = get_cpp_compiler()  # the one the kernel is built with
    asan = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(asan):
        pytest.skip(f"{compiler} has no libasan here")
    flags = (*(f for f in attention_cpp.FLAGS if f != "-O3"), "-O1", "-g", "-fsanitize=address")
    library = attention_cpp.build(tmp_path, flags)
    code = (f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(TESTS / 'engine')!r}]\n"
            "from pathlib import Path\nimport torch\nfrom service.models import attention_cpp\n"
            f"attention_cpp.build = lambda *args: Path({str(library)!r})\n"
            "import test_attention as t\n"
            "for shape in t.CPP_SHAPES:\n"
            "    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):\n"
            "        t.test_the_cpp_kernel_over_head_sizes_and_groups(dtype, tol, *shape)\n"
            "print('checked', len(t.CPP_SHAPES))\n")
    env = dict(os.environ, LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"checked {len(CPP_SHAPES)}" in proc.stdout, proc.stderr[-3000:]


def test_the_cpp_kernel_is_built_once_per_machine_and_reused(tmp_path):
    built = attention_cpp.build(tmp_path)
    stamp = built.stat().st_mtime_ns
    assert attention_cpp.build(tmp_path) == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary file left beside it


def test_each_kind_of_step_runs_its_kernel(monkeypatch, tiny_qwen2):
    from service.engine.cached_model import CachedModel
    from service.engine.kv_cache import KVCache
    from service.models.loader import load_model

    monkeypatch.setattr(attention, "choose", lambda *args, **kw: ("sdpa",) * 4 + ("bmm", "sdpa", "cpp", "bmm"))
    model = load_model(tiny_qwen2, torch.bfloat16, CPU)
    cached = CachedModel(model, KVCache(model.config, 4, 400, torch.bfloat16, CPU), CPU)
    long = attention.LONG_KEYS
    decode, _ = cached.build_meta(0, [5, 9], [1, 1])
    verify, _ = cached.build_meta(0, [5, 9], [3, 1])
    long_decode, _ = cached.build_meta(0, [5, long], [1, 1])  # attends to LONG_KEYS + 1 keys
    long_verify, _ = cached.build_meta(0, [long, 9], [3, 1])
    assert (decode.kernel, decode.bias.dtype) == ("bmm", torch.float32)
    assert (verify.kernel, verify.bias) == ("cpp", None)  # no mask: the positions, padding at the scratch one
    assert verify.positions.tolist() == [[5, 6, 7], [9, cached.cache.scratch_pos, cached.cache.scratch_pos]]
    assert (long_decode.kernel, long_decode.bias.dtype) == ("sdpa", torch.bfloat16)
    assert (long_verify.kernel, long_verify.bias.dtype) == ("bmm", torch.float32)
    one_row = [cached.build_meta(0, [start], [q])[0] for start, q in ((5, 1), (5, 3), (long, 1), (long, 3))]
    assert [meta.kernel for meta in one_row] == ["sdpa"] * 4  # the one-row half of `Kernels`


@pytest.mark.parametrize("kernels", [("sdpa", "sdpa"), ("bmm", "bmm"), ("bmm", "sdpa"), ("sdpa", "bmm"),
                                     ("cpp", "cpp")],
                         ids=lambda k: "decode-{}-prefill-{}".format(*k))
def test_engine_matches_transformers_with_either_kernel(kernels, monkeypatch):
    """Batches large enough that `bmm` does not hand over to SDPA (rows x keys > TINY_ROWS_X_KEYS)."""
    monkeypatch.setattr(attention, "choose", lambda *args, **kw: (kernels[0], kernels[0], kernels[1], kernels[1]) * 2)
    lengths = (100, 1, 60, 90, 37, 110)
    assert len(lengths) * max(lengths) > attention.TINY_ROWS_X_KEYS
    check_logits_every_step(default_checkpoint(), steps=6, lengths=lengths)
