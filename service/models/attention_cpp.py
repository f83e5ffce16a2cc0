"""The `cpp` attention kernel (service/models/attention.py): csrc/cache_attention.cpp, built here for this machine.

Why a kernel of our own: on a CPU a decode or verify step's attention reads every row's cached keys and values
once, and the two library kernels spend far more than that read. Demo model layout (4 KV heads x 32), batch 64,
305 keys, one thread, AMD EPYC (AVX512-BF16), per layer: float32 verify of 5 positions sdpa 3.8 ms, bmm 3.9, this
kernel 2.6; float32 decode sdpa 2.0, bmm 1.8, this kernel 1.4; bf16 verify sdpa 3.2, bmm 3.5, this kernel 2.2;
bf16 decode sdpa 4.5, bmm 2.3, this kernel 1.1 (reading the K and V alone: 1.2 ms in float32, 1.9 in bf16, as a
`sum`). It never builds a [B, Hkv, GQ, L] score tensor in memory, reads each cached key and value once per task,
and sums 16 dot products at once instead of one horizontal sum per score. `attention.choose` still times it
against the other two per layout and kind of step, so it runs only where it is faster.

Where it loses: a call costs ~15 us a layer more than a library kernel's (the dispatcher into Python, ctypes, its
arguments), so one-row steps never run it (`attention.ONE_ROW_KERNELS`). Whole compiled forwards of the demo model
(1 thread, 300 cached tokens, two runs alternating with the library kernels alone): batch 64 decode 9.0-9.6 ->
6.3-7.3 ms and verify 22.0-23.7 -> 17.0-17.2 ms in float32, 5.4-6.8 -> 4.1-6.8 and 16.1-17.3 -> 14.2-14.6 ms in
bf16; batch 16 7-21% faster; batch 4 decode 3-12% slower (0.94-1.00 -> 0.97-1.12 ms), its verify within 5%.
Each tile of keys widened once for all of a task's queries, not once per query: on an Intel Xeon with AMX (bf16, one
thread, 64 rows, per layer, three runs alternating with the version before, sdpa timed alongside as the yardstick)
a verify of 7 positions over 200 keys 2.25-2.27 -> 1.28-1.84 ms (sdpa 1.6-2.5 ms), of 5 over 512 keys 4.7-5.0 ->
2.2-3.5 ms; decode unchanged. There it made the kernel the verify's choice, which sdpa had been (whole compiled
batch-64 verify steps of 7 positions over 200 keys: 12.9-20.7 ms with sdpa in four runs, 10.6-14.8 ms with it in five,
alternating; that machine's decode steps moved by 2x between runs, so no ratio from them). Against sdpa in the same
process, two runs alternating: bf16 at 2 threads, a verify over 128 / 200 / 512 keys 0.89-0.90 / 1.19-1.43 / 1.02-1.09x
sdpa's time before, 0.67-0.69 / 0.64-0.77 / 0.68-0.72x after; float32 at 1 thread 1.01-1.02 / 1.15-1.18 / 0.85-0.91x
before, 0.70-0.73 / 0.81-1.23 / 0.52-0.67x after (nothing to widen there: the tile is copied once to a buffer).

Positions, not a mask: the kernel takes each query's cache position ([B, Q] int64) and masks causally itself, so a
step that runs it builds no [B, Hkv, G * Q, L] mask (the engine built one per step and each layer read it), and a
(row, head) task stops at the keys its row's last query sees instead of running to the batch's longest row (the
rest is that row's padding). In GRPO rollouts of the demo task (bench/e2e.py's workload) the rows of a 64-row step
held 72-76% of the longest row's keys on average, 87-95% at 32 rows. Against the mask version, both libraries in
one process, calls alternating, 64 rows of the demo layout, an Intel Xeon with AMX (medians of 300): rows of one
length 0.96-1.0x its time (float32 and bf16, 1 and 2 threads, decode and verify over 200 and 512 keys); rows whose
lengths spread +-25% around 75% of the longest 0.68-0.87x (the longer the cache, the more it saves). A vector's
16 scores are stored with one store: a loop of lane stores there had made whole verify calls 5-15% slower.

The build: plain C++ without torch headers, compiled with the C++ compiler inductor uses (-O3 -march=native
-fopenmp) in about two seconds, once per machine: the shared library is kept under $SPECROLL_CACHE/kernels (default
~/.cache/specroll), named by a hash of its source, the compiler's version, the flags and this CPU's feature flags
(a library built with -march=native on another CPU is never loaded). Where no compiler exists or the build fails,
`available()` is False (logged once) and `attention.choose` leaves the kernel out. Its OpenMP loops run in the
OpenMP runtime torch already loaded (`libgomp.so.1`), with torch's thread count.

The op is `torch.ops.specroll.cache_attention` (`op`), opaque to torch.compile (a fake implementation gives its
output's shape); the ctypes call releases the GIL.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from service.config import default_cache_root
from service.models.timing import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cache_attention.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the codes the library takes
_Shape = ctypes.c_int64 * 19  # the sizes and strides the library reads
VECTOR = 16  # head sizes: multiples of this many floats, up to 16 of them
MAX_HEAD_DIM = 16 * VECTOR


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel takes this cache dtype and head size (and could be built here)."""
    return dtype in DTYPES and head_dim % VECTOR == 0 and head_dim <= MAX_HEAD_DIM and available()


def source_id() -> str:
    """A hash of the kernel's source: a timing of another version says nothing about this one."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def build(cache_dir: Path | None = None, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library for this machine: built once, then found by its name. Raises RuntimeError where it cannot
    be built (no compiler, a failed compile). `flags`: other compiler flags (the tests build it with a sanitizer)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        compiler = get_cpp_compiler()
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except Exception as exc:  # inductor raises several kinds where no compiler works
        raise RuntimeError(f"no working C++ compiler ({exc})") from exc
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(), cpu_flags().encode()]))
    target = (cache_dir or default_cache_root() / "kernels") / f"cache_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name beside it and rename: processes building at once never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed to build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the cpp attention kernel: %s", target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as exc:
        logger.warning("the cpp attention kernel is not available, attention runs sdpa / bmm: %s", exc)
        return None
    fn = lib.specroll_cache_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64), *[ctypes.c_void_p] * 5, ctypes.c_float, ctypes.c_int]
    return lib


def available() -> bool:
    return _library() is not None


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q [B, Hkv, G * P, D] over keys/values [B, Hkv, L, D] (views whose last axis is contiguous), causal by position:
    query row g * P + i is at cache position positions[b, i] (int64 [B, P]) and sees keys 0..that position (all L
    past it; none below 0, and then gets zeros) -> [B, Hkv, G * P, D]."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the cpp attention kernel is not available on this machine")
    if not (q.dtype == keys.dtype == values.dtype and q.dtype in DTYPES):
        raise ValueError(f"cpp attention takes float32 or bfloat16 tensors of one dtype, got {q.dtype}, "
                         f"{keys.dtype}, {values.dtype}")
    B, _, GQ, _ = q.shape
    if (positions.dtype != torch.int64 or positions.dim() != 2 or positions.shape[0] != B or positions.shape[1] < 1
            or GQ % positions.shape[1]):
        raise ValueError(f"cpp attention takes int64 positions [B, P] with P dividing the query rows, got "
                         f"{positions.dtype} {tuple(positions.shape)} for queries {tuple(q.shape)}")
    q = q.contiguous()
    if positions.stride(1) != 1:
        positions = positions.contiguous()
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        keys, values = keys.contiguous(), values.contiguous()
    out = torch.empty_like(q)
    shape = (*q.shape[:3], keys.shape[2], q.shape[3], positions.shape[1], *q.stride()[:3], *keys.stride()[:3],
             *values.stride()[:3], *out.stride()[:3], positions.stride(0))  # the sizes, then the strides it reads
    rc = lib.specroll_cache_attention(DTYPES[q.dtype], _Shape(*shape), q.data_ptr(), keys.data_ptr(),
                                      values.data_ptr(), positions.data_ptr(), out.data_ptr(), q.shape[3] ** -0.5,
                                      torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"cpp attention does not take head size {q.shape[3]} "
                         f"(multiples of {VECTOR} up to {MAX_HEAD_DIM})")
    return out


def _fake(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# Registered with the dispatcher directly: `torch.library.custom_op`'s wrapper cost 3 us more a call.
_LIB = torch.library.Library("specroll", "DEF")
_LIB.define("cache_attention(Tensor q, Tensor keys, Tensor values, Tensor positions) -> Tensor")
_LIB.impl("cache_attention", cache_attention, "CPU")
torch.library.register_fake("specroll::cache_attention", _fake, lib=_LIB)
op = torch.ops.specroll.cache_attention
