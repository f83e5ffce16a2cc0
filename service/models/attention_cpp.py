"""The `cpp` attention kernel (service/models/attention.py): csrc/cache_attention.cpp, built here for this machine.

A decode or verify step's attention must read every row's cached keys and values once; the library kernels spend
far more than that. This kernel never builds a score tensor in memory, reads each cached key and value once per
task, widens each tile of bf16 keys to float32 once for all of a task's queries, and sums 16 dot products at once.
A call costs more than a library kernel's, so one-row steps never run it, and `attention.choose` times it against
the others per layout. It is built with the system C++ compiler at first use and cached by source hash; without a
compiler it is left out. docs/design-notes.md has the measurements that shaped it.
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
