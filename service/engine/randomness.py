"""Counter-based randomness: a row's uniform is a hash of (sequence seed, output position, stream).

A seeded sequence draws the same numbers whatever else shares its batch, with no per-row generator, and a draw
at a position never depends on how wide a verify pass was. The sampler (service/engine/sampler.py) draws from
these; the batch's seed keys are hashed once when its tensors are built (service/engine/batch_tensors.py).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
STREAM_SAMPLE, STREAM_ACCEPT, STREAM_DRAFT = 0, 1, 2


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) on int64 tensors holding values < 2^32 (a new tensor)."""
    x = x & _M32
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= _M32
    x ^= x >> 15
    x *= 0x846CA68B
    x &= _M32
    x ^= x >> 16
    return x


def seed_keys(seeds: torch.Tensor) -> torch.Tensor:
    """The part of a row's uniforms that depends on its seed alone (int64 [N] -> [N]): hashed once per batch
    (`SamplingBatch.build`), not in every draw. A draw's own hashing is then half the ops it was: at batch 1
    each op is a few microseconds of dispatch, and the hash was most of a plain step's sampling."""
    return _mix32(_mix32((seeds >> 32) + 0x9E3779B9) ^ (seeds & _M32))


def uniforms(keys: torch.Tensor, counters: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for rows' seed keys [N] (`seed_keys`) and counters [N] or [N, K] (counters >= 0);
    float32, counters' shape. A function of (seed, counter, stream) alone; `stream` may differ by column ([K])."""
    if counters.dim() == 2:
        keys = keys[:, None]
    h = _mix32(keys ^ (counters & _M32))
    h = _mix32(h ^ (counters >> 32) ^ (stream * 0x85EBCA6B))
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)
