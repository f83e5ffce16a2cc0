"""Decode and verify forwards compiled with torch.compile on CPU (a GPU replays CUDA graphs: cached_model.py).

On CPU a small model's step is mostly per-op overhead: inductor fuses the norms, RoPE, activations and residuals
into a few vectorised loops around the same matmul and attention kernels as eager.
- One compiled function per process takes the model and caches as arguments, so a weight push compiles nothing.
- Shapes are dynamic, so nothing is padded; a layout compiles a few variants (one row or more, decode or verify).
- No input is a view at an offset into another tensor: with dynamic shapes an offset becomes a size.
- Only uniform forwards are compiled; prefill, catch-up and the EAGLE head stay eager.
- The cache write indexes the whole cache tensor; prepacked oneDNN linears are one opaque op.

Compiled code rounds differently from eager, like any kernel choice; drafting and verification read one consistent
target distribution, which is all the lossless rule needs. `--enforce-eager` runs everything eagerly; without a C++
compiler the engine stays eager. docs/design-notes.md gives the reasons in full.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from service.models.llama import AttnMeta, CausalLM

logger = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64  # compiled variants kept per function: layouts x dtypes x the four shape variants


def _forward(model: CausalLM, input_ids: torch.Tensor, meta: AttnMeta, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> torch.Tensor:
    return model(input_ids, meta, k_cache, v_cache)


class _CompileCounter:
    """Compilations started in this process (dynamo's compile-start callback), for steps to tell whether they
    compiled something (such a step is no measure of the strategy's cost)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self._registered = False

    def register(self) -> None:
        """Hook into dynamo once per process, whichever thread compiles first."""
        with self._lock:
            if not self._registered:
                torch._dynamo.callback.on_compile_start(self)
                self._registered = True

    def __call__(self, *_args) -> None:
        with self._lock:
            self.count += 1


_counter = _CompileCounter()


@functools.cache
def available() -> bool:
    """Whether inductor can build CPU code here (it needs a working C++ compiler and Python's headers: its kernels
    are Python extensions); logs why not."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except (InvalidCxxCompiler, OSError, subprocess.CalledProcessError):
        logger.warning("no C++ compiler for torch.compile: CPU forwards run eagerly (install g++ for compiled ones)")
        return False
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        logger.warning("no Python headers (Python.h) for torch.compile: CPU forwards run eagerly (install the "
                       "python3-dev package for compiled ones)")
        return False
    return True


@functools.cache
def _compiled() -> Callable[..., torch.Tensor]:
    _counter.register()
    return torch.compile(_forward, dynamic=True, fullgraph=True)


def compiled_forward(model: CausalLM, input_ids: torch.Tensor, meta: AttnMeta, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> torch.Tensor:
    """The process's compiled cached forward: input_ids [B, Q] -> hidden [B, Q, hidden]."""
    dynamo = torch._dynamo.config
    if dynamo.recompile_limit < RECOMPILE_LIMIT:  # a per-thread setting: each serving thread raises its own
        dynamo.recompile_limit = RECOMPILE_LIMIT
    return _compiled()(model, input_ids, meta, k_cache, v_cache)


def compiles() -> int:
    return _counter.count
