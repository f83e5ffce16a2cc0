"""Linear-layer weights laid out for the CPU's matmul kernels, for inference.

Two kernels can run a linear layer on CPU: `F.linear`, and oneDNN's matmul on a weight prepacked once. Which is
faster depends on the CPU and on the product's rows, by up to 2x. So the first time a model layout is packed in a
process, `calibrate` times both on that model's own layers for one row count per class (1 | 2-48 | 49-256 |
more), and each class runs the faster one from then on (`Linear.packed_for`). Float32 weights get a packed copy while
they fit `FLOAT32_COPY_BYTES`, and are stored transposed wherever `F.linear` still serves small products
(`stored_transposed`); bf16 weights keep their layout. The kernels accumulate in
other orders, so results are not bit-identical (logprobs agree within 1e-5); drafting and verification read one
consistent distribution. docs/design-notes.md has the figures. Each layer remembers which state of its weight
(storage and version counter) it was laid out for, so `ensure_packed` on a model already prepared (a pushed one,
staged off the engine thread) costs nothing, and one whose weights changed in place is laid out again. A push
lays each layer out as soon as its bytes have landed, on a worker thread (`LayoutPipeline`).
"""

from __future__ import annotations

import logging
import queue
import threading
from bisect import bisect_left
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from service.cpu_threads import behind_generation, one_cpu_thread
from service.models.remembered import remembered
from service.models.timing import Timer, median_seconds

logger = logging.getLogger(__name__)

ROW_CLASSES = (1, 48, 256)  # upper bounds of the row classes; the last class is everything above
CLASS_ROWS = (1, 16, 128, 512)  # the row count timed for each class
FLOAT32_COPY_BYTES = 2 << 30
CALIBRATION_BYTES = 64 << 20  # time the model's first layers up to this many weight bytes (beyond the caches)
ROWS_BYTES = 256 << 20  # row-major copies of float32 weights a push holds at once to pack from (LayoutPipeline)
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


def stored_transposed(packed_for: tuple[bool, ...] | None) -> bool:
    """Whether a float32 weight is stored transposed (an [in, out] buffer seen as [out, in]), given the row classes
    its packed copy serves (None: no copy): wherever `F.linear` serves products of up to `ROW_CLASSES[-1]` rows,
    whose kernels run faster from that layout. Where the copy serves all of those, `F.linear` runs only the largest
    products, as fast from rows (docs/design-notes.md), and a weight stored as it is pushed is written there
    directly and packed from there: no transposing copy, no row-major copy to pack from."""
    return packed_for is None or not all(packed_for[: len(ROW_CLASSES)])


def _store(m: Linear, transposed: bool) -> None:
    """Put a float32 weight's storage in the layout `stored_transposed` chose (a copy only where it changes)."""
    w = m.weight.detach()
    if transposed and not w.t().is_contiguous():
        m.weight.data = w.t().contiguous().t()  # [out, in] view of an [in, out] buffer
    elif not transposed and not w.is_contiguous():
        m.weight.data = w.contiguous()


def _pack(m: Linear, rows: torch.Tensor | None = None) -> None:
    """oneDNN's packed copy of `m`'s weight (`rows`: the same values in row-major order, which packs fastest). A
    float32 weight laid out transposed is otherwise packed from that layout directly: oneDNN reads the strides
    itself (the same packed copy), faster than from a row-major copy made first, which torch transposes at a
    fraction of copy speed."""
    weight = m.weight.detach() if rows is None else rows
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        weight = weight.contiguous()
    m.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def _sample(layers: list[Linear]) -> tuple[list[Linear], tuple]:
    """The leading layers a layout is timed on (up to `CALIBRATION_BYTES`), and the key its choice is kept by."""
    sample, nbytes = [], 0
    for m in layers:
        if nbytes >= CALIBRATION_BYTES:
            break
        sample.append(m)
        nbytes += m.weight.numel() * m.weight.element_size()
    return sample, (sample[0].weight.dtype, tuple((m.out_features, m.in_features, m.bias is not None)
                                                  for m in sample))


def _choose(layers: list[Linear], timer: Timer | None) -> tuple[bool, ...]:
    """The row classes packed weights serve for this layout; the first time, packs and times the leading
    layers (up to `CALIBRATION_BYTES`), not the whole model. Without a `timer`, that time is the first on this
    machine (service/models/remembered.py)."""
    sample, key = _sample(layers)
    if key not in _chosen:

        def timed() -> tuple[bool, ...]:
            for m in sample:
                if m.weight.dtype == torch.float32:
                    _store(m, True)  # F.linear timed in its fastest layout
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
    plan: dict[int, tuple[bool, ...]] = {}
    count = 0
    with torch.no_grad():
        for group in _groups(cpu, fp32):
            plan.update(dict.fromkeys(map(id, group), _choose(group, timer)))
        for m in fp32:
            _store(m, stored_transposed(plan.get(id(m))))
        for m in cpu:
            packed_for = plan.get(id(m))
            if packed_for is None or not any(packed_for):
                m.packed = None  # not packed, or only the timed layers were: never used
                continue
            if m.packed is None:
                _pack(m)
            m.packed_for = packed_for
            count += 1
    for m in layers:
        m.laid_out_for = _weight_state(m)
    logger.debug("laid out %d linear layers, %d with a packed copy", len(layers), count)
    return count


def _groups(cpu: list[Linear], fp32: list[Linear]) -> list[list[Linear]]:
    """The layers that get a packed copy where it wins, by dtype: float32 while the copies fit
    `FLOAT32_COPY_BYTES`, bf16 where the CPU runs bf16 natively."""
    if not onednn_available():
        return []
    groups = []
    if fp32 and sum(m.weight.numel() * 4 for m in fp32) <= FLOAT32_COPY_BYTES:
        groups.append(fp32)
    bf16 = [m for m in cpu if m.weight.dtype == torch.bfloat16]
    if bf16 and native_bf16():
        groups.append(bf16)
    return groups


def _lay_out(m: Linear, packed_for: tuple[bool, ...] | None, rows: torch.Tensor | None = None) -> None:
    """What `pack_linears` does to one layer whose group's choice is `packed_for` (None: the group is not
    packed); `rows`: its weight's values in row-major order, to pack from."""
    with torch.no_grad():
        if m.weight.dtype == torch.float32:
            _store(m, stored_transposed(packed_for))
        if packed_for is not None and any(packed_for):
            _pack(m, rows)
            m.packed_for = packed_for
        else:
            m.packed = None
        m.laid_out_for = _weight_state(m)


class LayoutPipeline:
    """Lays out a model's `Linear` layers while a push is still writing its weights: each layer as soon as every
    checkpoint tensor of its weight has landed (`landed(name)`), on worker threads, so the re-layout overlaps
    the transfer instead of following it. `finish` lays out what is queued on the calling thread too and returns
    once all are done; `ensure_packed` then finds the layers prepared (a layer the pipeline could not lay out,
    say one whose layout was never timed in this process, is laid out there as before). A layer is laid out for
    the weight state after its last tensor landed (`laid_out_for`), so bytes written into it later (a failed
    push's) make it stale again only through `forget_layout`, which every push into a reused spare runs first.

    A float32 weight stored transposed is packed from a row-major copy of its landed tensors (`landed`'s `src`,
    copied at memory speed into a buffer of the layer's shape, at most `ROWS_BYTES` of them at once): oneDNN packs
    row-major weights several times faster than transposed ones, and the values are the same.

    `parts`: checkpoint tensor name -> the layer of `model` whose weight it fills and the rows of it (None: all;
    several names for a fused weight). `workers`: threads laying out at once, one CPU thread each (one while
    generation runs beside the push; more while it is paused for an in-place push)."""

    def __init__(self, model: nn.Module, parts: Mapping[str, tuple[Linear, slice | None]], workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._layer_of: dict[str, tuple[Linear, slice | None]] = {}
        self._rows: dict[int, torch.Tensor | None] = {}  # layer -> row-major copy being filled (None: not kept)
        self._rows_bytes = 0
        self._rows_lock = threading.Lock()
        self._left: dict[int, int] = {}
        self._plan: dict[int, tuple[bool, ...] | None] = {}
        self._queue: queue.SimpleQueue[tuple[Linear, torch.Tensor | None] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        layers = [m for m in model.modules() if isinstance(m, Linear)]  # in `pack_linears`' order: its groups
        cpu = [m for m in layers if m.weight.device.type == "cpu"]  # a GPU's keep their storage (graphs read it)
        self._plan = dict.fromkeys(map(id, cpu))  # not packed: a float32 one is only laid out transposed
        for group in _groups(cpu, [m for m in cpu if m.weight.dtype == torch.float32]):
            choice = _chosen.get(_sample(group)[1])
            for m in group:
                if choice is None:
                    del self._plan[id(m)]  # never timed in this process: `ensure_packed` times and packs it
                else:
                    self._plan[id(m)] = choice
        for name, (m, sl) in parts.items():
            if id(m) in self._plan:
                self._layer_of[name] = m, sl
                self._left[id(m)] = self._left.get(id(m), 0) + 1
        self._workers = [threading.Thread(target=self._work, name=f"layout-{i}", daemon=True)
                         for i in range(workers)]
        for worker in self._workers:
            worker.start()

    def landed(self, name: str, src: torch.Tensor | None = None) -> None:
        """A checkpoint tensor's bytes are all in place (`src`: the tensor they came from, read here only):
        queue its layer once its weight is complete."""
        found = self._layer_of.get(name)
        if found is None:
            return
        m, sl = found
        self._keep_rows(m, sl, src)
        self._left[id(m)] -= 1
        if not self._left[id(m)]:
            self._queue.put((m, self._rows.pop(id(m), None)))

    def _keep_rows(self, m: Linear, sl: slice | None, src: torch.Tensor | None) -> None:
        if not any(self._plan[id(m)] or ()) or m.weight.is_contiguous():
            return  # not packed, or packed from its own row-major storage
        if id(m) not in self._rows:
            nbytes = m.weight.numel() * m.weight.element_size()
            with self._rows_lock:
                fits = self._rows_bytes + nbytes <= ROWS_BYTES
                self._rows_bytes += nbytes if fits else 0
            self._rows[id(m)] = torch.empty(m.weight.shape, dtype=m.weight.dtype) if fits else None
        rows = self._rows[id(m)]
        if rows is None:
            return
        part = rows if sl is None else rows[sl]
        if src is None or src.device.type != "cpu" or tuple(src.shape) != tuple(part.shape):
            self._drop_rows(m)
            return
        part.copy_(src)

    def _drop_rows(self, m: Linear) -> None:
        rows = self._rows.get(id(m))
        self._rows[id(m)] = None
        if rows is not None:
            with self._rows_lock:
                self._rows_bytes -= rows.numel() * rows.element_size()

    def _do(self, m: Linear, rows: torch.Tensor | None) -> None:
        if self._error is None:
            try:
                _lay_out(m, self._plan.get(id(m)), rows)
            except BaseException as exc:  # raised by finish, on the staging thread
                self._error = exc
        if rows is not None:
            with self._rows_lock:
                self._rows_bytes -= rows.numel() * rows.element_size()

    def _work(self) -> None:
        one_cpu_thread()  # torch's default would start a thread team of its own here
        with behind_generation():
            while (item := self._queue.get()) is not None:
                self._do(*item)

    def _drain(self) -> None:
        try:
            while (item := self._queue.get_nowait()) is not None:
                self._do(*item)
        except queue.Empty:
            pass
        for _ in self._workers:
            self._queue.put(None)
        for worker in self._workers:
            worker.join()

    def finish(self) -> None:
        """Lay out every queued layer (this thread and the workers), then return; raises what a layout raised."""
        self._drain()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop laying out (the push failed): returns once the worker no longer touches the model."""
        self._error = self._error or RuntimeError("cancelled")
        self._drain()
