"""Decode and verify forwards compiled with torch.compile on CPU (a GPU replays CUDA graphs: graphs.py).

On CPU a small model's step is mostly per-op overhead, not arithmetic: the demo model's decode step at batch 1
runs over a hundred ops (norms, RoPE, SiLU, residuals, cache writes, attention, 17 matmuls) and half its time is spent
outside the matmuls and attention (bench/step_profile.py). Inductor fuses the elementwise ops into a few
vectorised C++ loops and calls the same matmul and attention kernels as eager. Demo model, bf16, 2 threads,
decode over 128 cached tokens (AMD EPYC), eager -> compiled: batch 1 0.74 -> 0.45 ms, batch 16 1.12 -> 0.56 ms,
batch 64 2.38 -> 1.33 ms; a verify of 5 positions at batch 16 1.77 -> 1.14 ms. The 768-hidden 12-layer float32
model of bench/spec_decode.py is matmul-bound: compiled and eager take the same time within 5%. The whole
engine on the demo model (bench/engine_throughput.py): 1.35 / 1.50 / 1.44x eager tokens/s at batch 1 / 16 / 64.

How it is cut:
- One compiled function per process, `model(input_ids, meta, k_cache, v_cache)`, with the model and caches as
  arguments, so models of one layout share its code: a weight push (a new model object) and a second engine
  compile nothing (their parameters are inputs, never constants baked into the code).
- Shapes are dynamic (batch, positions per row, cached length), so nothing is padded: on a CPU padded rows and
  keys cost as much as real ones. Dynamo specialises sizes of 1, so a layout compiles four variants: batch 1
  or more x one position per row (decode) or more (verify), each once more where its attention kernel over a long
  cache differs from a short one's (service/models/attention.py). The engine compiles them at start-up
  (`warm_up`), for the target and a draft model, on rows whose cache is not in use yet, the batched ones at a
  serving size (inductor picks from those sizes which loops run on all threads); a variant compiled later
  (the first verify after a drafter push, say) marks its step as not timed for the adaptive strategy
  (`compiles()` counts them).
- One code object for all of them, though dynamo checks a code object's variants in order of last use and
  evaluates a variant's guards (~50 us: every parameter and cache tensor) before it finds the one that
  matches, so a plain step right after a verify first fails the verify variant's (0.03-0.08 ms at one row,
  demo model, float32, one thread). A code object per shape class (tried in 8201553) avoids that, but each
  then compiles its first variant from a fresh start with every input size dynamic, and duck sizing (below)
  ties sizes that are equal at that call: at the warm-up batch, the batch to the cache's slot count (the
  default 64 rows and 64 slots) or to the head size, so each later batch size compiled again mid-rollout (2-3
  compiles after start-up on the demo model; tests/engine/test_compiled.py checks it in a fresh process). Shared,
  the batched variants are recompiles of the one-row ones, and in every measured layout kept those sizes apart.
- No input is a view at an offset into another tensor (the runner builds positions and cache slots as tensors
  of their own): dynamic shapes make a storage offset a size, and torch takes sizes equal at compile time for
  one (duck sizing). The slot indices were a view at offset B x Q into one tensor with the positions; with as
  many cache slots as warm-up rows (the default 64) that offset became the slot count, so every batch of
  another size compiled its own variant mid-rollout, at that size, and the batch-64 steps after a batch of 16
  ran it (the demo model decoded 17,600-25,600 tokens/s at batch 64 instead of 24,500-29,200). Duck sizing
  itself stays: turned off, batch 1 and batch 64 decoded 3-5% slower (four alternating runs).
- Only uniform forwards (every row appends the same number of tokens: decode, verify, a draft model's decode)
  are compiled. Prefill and a draft model's catch-up (rows of different lengths) stay eager, as does the
  EAGLE head.
- Inside the compiled code the cache write indexes the whole cache tensor (service/models/llama.py
  `write_cache`): a write through a per-layer view makes inductor copy the whole cache each step. Prepacked
  oneDNN linears are one opaque op (service/models/packed.py `packed_linear`): inductor's own oneDNN lowering
  needs weights frozen into the code, which a weight push could not replace.

Exactness: compiled code rounds differently from eager (fused float32 arithmetic inside a bf16 model), like any
kernel choice; drafting and verification read one consistent target distribution, which is all the lossless
rule needs, and the engine's greedy, logprob and chi-square tests run on whichever path the engine runs.

`EngineConfig.enforce_eager` (`--enforce-eager`) runs everything eagerly. Without a C++ compiler (inductor's
CPU code needs one) the engine logs that and stays eager.
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
