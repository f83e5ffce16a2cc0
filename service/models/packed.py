"""Linear-layer weights laid out for the CPU's matmul kernels, for inference.

Two kernels can run a linear layer on CPU: `F.linear`, and oneDNN's matmul on a weight prepacked once. Which is
faster depends on the CPU and on the product's rows, by up to 2x. So the first time a model layout is packed in a
process, `calibrate` times both on that model's own layers for one row count per class (1 | 2-48 | 49-256 |
more), and each class runs the faster one from then on (`Linear.packed_for`). Float32 weights are stored transposed
plus a packed copy while they fit `FLOAT32_COPY_BYTES`; bf16 weights keep their layout. The kernels accumulate in
other orders, so results are not bit-identical (logprobs agree within 1e-5); drafting and verification read one
consistent distribution. docs/design-notes.md has the figures. Each layer remembers which state of its weight
(storage and version counter) it was laid out for, so `ensure_packed` on a model already prepared (a pushed one,
staged off the engine thread) costs nothing, and one whose weights changed in place is laid out again.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from service.models.remembered import remembered
from service.models.timing import Timer, median_seconds

logger = logging.getLogger(__name__)

ROW_CLASSES = (1, 48, 256)  # upper bounds of the row classes; the last class is everything above
CLASS_ROWS = (1, 16, 128, 512)  # the row count timed for each class
FLOAT32_COPY_BYTES = 2 << 30
CALIBRATION_BYTES = 64 << 20  # time the model's first layers up to this many weight bytes (beyond the caches)
WIN_MARGIN = 0.97  # packed must take under this fraction of F.linear's time to be chosen

_chosen: dict[tuple, tuple[bool, ...]] = {}  # layout of the timed layers -> packed per row class


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def native_bf16() -> bool:
    """AVX512-BF16 or AMX: where plain bf16 linears run the same oneDNN kernel as packed ones."""
    flags = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, f, lambda: False)() for f in flags)


def row_class(rows: int) -> int:
    return bisect_left(ROW_CLASSES, rows)  # the first class whose upper bound is >= rows


class Linear(nn.Linear):
    """`nn.Linear` that uses a prepacked copy of its weight (set by `pack_linears`) in inference."""

    packed: torch.Tensor | None = None
    packed_for: tuple[bool, ...] = ()  # per row class: whether the packed copy serves it
    laid_out_for: tuple[torch.UntypedStorage, int] | None = None  # the weight state its layout and pack are of

    def __getstate__(self) -> dict:
        """Copies (`copy.deepcopy`, pickling) leave the packed copy behind: an opaque oneDNN tensor has no
        storage to copy, and a copy is packed again when it is installed for serving."""
        state = super().__getstate__()
        state.pop("packed", None)
        state.pop("packed_for", None)
        state.pop("laid_out_for", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            rows = x.numel() // x.shape[-1]
            if x.dim() == 3 and x.shape[0] == 1 and rows <= ROW_CLASSES[1] and not self.packed_for[int(rows > 1)]:
                # One sequence's decode or verify (a variant of its own: batch 1 is specialised; a guard keeps its
                # positions in the row class): `F.linear` traced, which inductor calls directly. The opaque op
                # below costs ~6 us of Python dispatch a call.
                return F.linear(x, self.weight, self.bias)
            # One opaque op: the row class is chosen when it runs, not traced
            classes = sum(1 << i for i, on in enumerate(self.packed_for) if on)
            return linear_op(x, self.weight, self.packed, self.bias, classes)
        return _linear(x, self.weight, self.packed, self.bias, self.packed_for[row_class(x.numel() // x.shape[-1])])


def _linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
            use_packed: bool) -> torch.Tensor:
    if use_packed:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _linear_op(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               packed_classes: int) -> torch.Tensor:
    return _linear(x, weight, packed, bias, bool(packed_classes >> row_class(x.numel() // x.shape[-1]) & 1))


def _linear_op_fake(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                    packed_classes: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# `specroll::linear`: a packed `Linear` inside torch.compile (service/engine/compiled.py), the kernel of x's row
# class (bit i of `packed_classes`: class i runs the packed weight). Opaque to inductor, whose own oneDNN lowering
# needs weights frozen into the compiled code (a weight push could not replace them), and one compiled variant
# serves every row count (a traced choice would compile one per row class). Registered with the dispatcher
# directly, as the attention op is (attention_cpp.py): through `torch.library.custom_op`'s wrapper a call cost
# ~10 us more than the oneDNN kernel alone, registered like this ~6 (bf16, 512 x 512, one row), and the engine
# decoded the demo model 6-9% slower at batch 1 and 16. CompositeExplicitAutograd: the packed weight is an
# MkldnnCPU tensor; autograd never reaches the op (`Linear.forward`).
_LIB = torch.library.Library("specroll", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor packed, Tensor? bias, int packed_classes) -> Tensor")
_LIB.impl("linear", _linear_op, "CompositeExplicitAutograd")
torch.library.register_fake("specroll::linear", _linear_op_fake, lib=_LIB)
linear_op = torch.ops.specroll.linear


def calibrate(layers: Sequence[Linear], timer: Timer = median_seconds) -> tuple[bool, ...]:
    """Per row class, whether the packed copy beats `F.linear` over `layers` (all packed already)."""
    dtype = layers[0].weight.dtype
    choice = []
    with torch.inference_mode():
        for rows in CLASS_ROWS:
            xs = {m.in_features: torch.randn(rows, m.in_features).to(dtype) for m in layers}

            def plain(xs=xs) -> None:
                for m in layers:
                    F.linear(xs[m.in_features], m.weight, m.bias)

            def packed(xs=xs) -> None:
                for m in layers:
                    torch.ops.mkldnn._linear_pointwise(xs[m.in_features], m.packed, m.bias, "none", [], "")

            t_plain, t_packed = timer(plain), timer(packed)
            choice.append(t_packed < WIN_MARGIN * t_plain)
            logger.debug("%s linears, %d rows: F.linear %.2f ms, packed %.2f ms", dtype, rows, t_plain * 1e3,
                         t_packed * 1e3)
    return tuple(choice)


def _pack(m: Linear) -> None:
    m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().contiguous(), 1)


def _choose(layers: list[Linear], timer: Timer | None) -> tuple[bool, ...]:
    """The row classes packed weights serve for this layout; the first time, packs and times the leading
    layers (up to `CALIBRATION_BYTES`), not the whole model. Without a `timer`, that time is the first on this
    machine (service/models/remembered.py)."""
    sample, nbytes = [], 0
    for m in layers:
        if nbytes >= CALIBRATION_BYTES:
            break
        sample.append(m)
        nbytes += m.weight.numel() * m.weight.element_size()
    key = (sample[0].weight.dtype, tuple((m.out_features, m.in_features, m.bias is not None) for m in sample))
    if key not in _chosen:

        def timed() -> tuple[bool, ...]:
            for m in sample:
                _pack(m)
            return calibrate(sample, timer or median_seconds)

        if timer is not None:
            _chosen[key], again = timed(), False
        else:
            _chosen[key], again = remembered("packed", key, timed)
        logger.info("%s linear layers: prepacked weights serve row classes %s%s", key[0],
                    [f"<={hi}" for hi, on in zip((*ROW_CLASSES, "inf"), _chosen[key], strict=True) if on] or "none",
                    ", as timed at an earlier start on this machine" if again else "")
    return _chosen[key]


def _weight_state(m: Linear) -> tuple[torch.UntypedStorage, int] | None:
    """Which weight a layout is of: its storage and version counter (an in-place copy bumps it); None where the
    tensor keeps no counter (created in inference mode: never taken as laid out). The layer holds that storage,
    so weights replaced out of place can never reuse its address and pass for the laid-out ones."""
    try:
        return m.weight.untyped_storage(), m.weight._version
    except RuntimeError:
        return None


def _laid_out(m: Linear) -> bool:
    held, now = m.laid_out_for, _weight_state(m)
    return held is not None and now is not None and held[1] == now[1] and held[0].data_ptr() == now[0].data_ptr()


def prepared(model: nn.Module) -> bool:
    """Whether every `Linear` of `model` is laid out for the weights it holds now (`pack_linears` ran since they
    last changed)."""
    return all(_laid_out(m) for m in model.modules() if isinstance(m, Linear))


def forget_layout(model: nn.Module) -> None:
    """Take every `Linear` of `model` as not laid out: its weights are about to change through a path torch's
    version counter does not see (bytes written into their storage directly), so `ensure_packed` lays it out
    again rather than keep packs of the weights before."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.laid_out_for = None
            m.packed = None


def ensure_packed(model: nn.Module) -> bool:
    """`pack_linears` unless `model` is `prepared` already; returns whether it had to lay anything out."""
    if prepared(model):
        return False
    pack_linears(model)
    return True


def pack_linears(model: nn.Module, timer: Timer | None = None) -> int:
    """Lay out the weights of `model`'s `Linear` layers on CPU (see the module's docstring). Returns how many
    layers got a packed copy; other devices and dtypes are left as they are, packs of earlier weights dropped."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for m in layers:
        if not _laid_out(m):
            m.packed = None  # of weights since replaced
    cpu = [m for m in layers if m.weight.device.type == "cpu"]
    fp32 = [m for m in cpu if m.weight.dtype == torch.float32]
    with torch.no_grad():
        for m in fp32:
            if not m.weight.t().is_contiguous():
                m.weight.data = m.weight.detach().t().contiguous().t()  # [out, in] view of an [in, out] buffer
    count = _pack_groups(cpu, fp32, timer)
    for m in layers:
        m.laid_out_for = _weight_state(m)
    logger.debug("laid out %d linear layers, %d with a packed copy", len(layers), count)
    return count


def _pack_groups(cpu: list[Linear], fp32: list[Linear], timer: Timer | None) -> int:
    if not onednn_available():
        return 0
    groups = []
    if fp32 and sum(m.weight.numel() * 4 for m in fp32) <= FLOAT32_COPY_BYTES:
        groups.append(fp32)
    bf16 = [m for m in cpu if m.weight.dtype == torch.bfloat16]
    if bf16 and native_bf16():
        groups.append(bf16)
    count = 0
    with torch.no_grad():
        for group in groups:
            packed_for = _choose(group, timer)
            if not any(packed_for):
                for m in group:
                    m.packed = None  # the timed layers' packs, never used
                continue
            for m in group:
                if m.packed is None:
                    _pack(m)
                m.packed_for = packed_for
            count += len(group)
    return count
