"""Linear-layer weights laid out for the CPU's matmul kernels, for inference.

Which kernel is fastest depends on the rows of the product (batch x positions): measured on torch 2.13, one
core, a 12-layer 768-wide model's weights (too big for the caches, as when serving), float32:

    rows                     1     2     5     9    16    32    64    80
    F.linear, W row-major  22.6  23.9  44.7  57.8  53.6  73.6  93.2 110.5  ms for all layers
    F.linear, W^T stored   20.1  32.6  43.1  55.2  57.0  69.6  71.7  90.2
    oneDNN, W packed       23.5  25.2  25.5  31.2  37.8  53.5  81.3 100.0

A verify step of k + 1 positions at a small batch (the long tail) is 5-50 rows: there a packed copy costs
about half of `F.linear`, which otherwise makes a 5-row verify cost twice a 1-row decode. So:
- float32: the weight itself is stored transposed (an [in, out] buffer seen as [out, in]: no copy), and a
  oneDNN-packed copy serves 2-48 rows (`FLOAT32_PACKED_ROWS`); only while the model's linear weights fit
  `FLOAT32_COPY_BYTES` (the copy doubles them). Other orders of accumulation: not bit-identical (logprobs
  agree within 1e-5; every float32 exactness test of the engine runs on this layout).
- bf16 (where the CPU has native bf16, AVX512-BF16 or AMX): a packed copy serves 1-256 rows
  (`BF16_PACKED_ROWS`; packed / plain 0.5-0.8 up to 144 rows, even at 320, 1.1 at 576). Bit-identical: the
  same kernel, without its per-call reorder of the weight (tested).

Autograd never sees a packed weight: with gradients enabled a layer is a plain `nn.Linear`. `pack_linears`
runs whenever a model is installed for serving (the runner's `CachedModel`); a model whose weights are
changed in place must be packed again.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

BF16_PACKED_ROWS = (1, 256)
FLOAT32_PACKED_ROWS = (2, 48)
FLOAT32_COPY_BYTES = 2 << 30


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def native_bf16() -> bool:
    """AVX512-BF16 or AMX: where plain bf16 linears run the same oneDNN kernel as packed ones."""
    flags = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, f, lambda: False)() for f in flags)


class Linear(nn.Linear):
    """`nn.Linear` that uses a prepacked copy of its weight (set by `pack_linears`) in inference."""

    packed: torch.Tensor | None = None
    packed_rows: tuple[int, int] = (0, 0)  # the packed copy serves products of this many rows (inclusive)

    def __getstate__(self) -> dict:
        """Copies (`copy.deepcopy`, pickling) leave the packed copy behind: an opaque oneDNN tensor has no
        storage to copy, and a copy is packed again when it is installed for serving."""
        state = super().__getstate__()
        state.pop("packed", None)
        state.pop("packed_rows", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = self.packed_rows
        if self.packed is None or torch.is_grad_enabled() or not lo * x.shape[-1] <= x.numel() <= hi * x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Lay out the weights of `model`'s `Linear` layers on CPU (see the module's docstring). Returns how many
    layers got a packed copy; other devices and dtypes are left as they are, packs of earlier weights dropped."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for m in layers:
        m.packed = None
    cpu = [m for m in layers if m.weight.device.type == "cpu"]
    fp32 = [m for m in cpu if m.weight.dtype == torch.float32]
    with torch.no_grad():
        for m in fp32:
            if not m.weight.t().is_contiguous():
                m.weight.data = m.weight.detach().t().contiguous().t()  # [out, in] view of an [in, out] buffer
    if not onednn_available():
        return 0
    copy_fp32 = sum(m.weight.numel() * 4 for m in fp32) <= FLOAT32_COPY_BYTES
    bf16 = native_bf16()
    count = 0
    with torch.no_grad():
        for m in cpu:
            if m.weight.dtype == torch.bfloat16 and bf16:
                m.packed_rows = BF16_PACKED_ROWS
            elif m.weight.dtype == torch.float32 and copy_fp32:
                m.packed_rows = FLOAT32_PACKED_ROWS
            else:
                continue
            m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().contiguous(), 1)
            count += 1
    logger.debug("packed %d of %d linear layers", count, len(layers))
    return count
