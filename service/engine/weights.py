"""Pushed weights for the native engine: checked, built beside the serving ones, swapped in between two steps.

Two roles: `target` (the policy, a CausalLM) and `drafter` (whichever drafter has weights: a draft model's
CausalLM or an EAGLE head). One path serves a trainer's push, the sidecar and the in-process drafter trainer.

Double buffering: the weights a swap replaced become the buffer the next push of that role is loaded into (no
allocation, no page faults); `allocate_spares` makes that buffer at start, so the first push is as fast as the
rest. The engine keeps no reference to replaced weights. A delta push (target only) first copies the serving
weights into that buffer, then overwrites what the delta names. Staging also lays the weights out for the CPU's
kernels (service/models/packed.py), each layer as soon as its bytes have landed, on a worker thread while the
rest of the push still arrives, so `apply` on the engine thread only swaps references.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from service.backend.base import Destinations, PushError, PushUnsupported, SparseValues, Staged, WeightSpec
from service.cpu_threads import one_cpu_thread, usable_cpus
from service.heap import release_free_memory
from service.models.llama import CausalLM
from service.models.loader import (
    WeightError,
    checkpoint_shapes,
    checkpoint_view,
    copy_into,
    empty_model,
    linear_parts,
    load_tensors,
)
from service.models.packed import LayoutPipeline, ensure_packed, forget_layout

if TYPE_CHECKING:
    from service.engine.inbox import EngineCore

logger = logging.getLogger(__name__)


def _placed(module: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    p = next(module.parameters(), None)
    return p is not None and p.dtype == dtype and p.device.type == device.type


def spec_of(role: str, module: nn.Module) -> WeightSpec:
    """What a push must hold to replace `module`: a checkpoint by Hugging Face names, or a head's state dict."""
    p = next(module.parameters(), None)
    dtype = str(p.dtype).removeprefix("torch.") if p is not None else ""
    if isinstance(module, CausalLM):
        cfg = module.config
        tolerated = {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)} if cfg.tie_word_embeddings else {}
        return WeightSpec(role, cfg.architecture, checkpoint_shapes(cfg), tolerated, dtype)
    return WeightSpec(role, type(module).__name__, {n: tuple(t.shape) for n, t in module.state_dict().items()},
                      dtype=dtype)


@torch.no_grad()
def _load_state(module: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy named tensors into a module's own state (casting dtype and device). Returns bytes copied."""
    state = module.state_dict()
    total = 0
    for name, tensor in tensors:
        dst = state.get(name)
        if dst is None or dst.shape != tensor.shape:
            raise PushError(f"tensor {name!r} does not fit the drafter's head")
        copy_into(dst, tensor)
        total += tensor.numel() * tensor.element_size()
    return total


def _load_laid_out(module: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], workers: int = 1) -> int:
    """`load_tensors` into `module`, each linear layer laid out for the CPU kernels as soon as its bytes have
    landed (packed.py `LayoutPipeline`, `workers` threads), so the layout overlaps the transfer. Returns the bytes
    loaded."""
    layouts = LayoutPipeline(module, linear_parts(module), workers)
    try:
        nbytes = load_tensors(module, tensors, layouts.landed)
    except BaseException:
        layouts.cancel()  # before the caller keeps or marks the module: nothing lays it out any more
        raise
    layouts.finish()
    return nbytes


def _drop_packs(module: nn.Module) -> None:
    """`forget_layout`, and the memory of the packs it drops handed back to the OS before new ones are allocated.
    Those packs were allocated by the threads of an earlier push (or at start), so glibc files them under those
    threads' arenas, which the new packs are not all drawn from: kept until the trim at the end, they made a push
    peak up to a whole set of packs above the serving weights and the spare (bench/inplace_memory.py). No trim
    where nothing was packed (a new module, or packs already dropped for this push)."""
    held = any(getattr(m, "packed", None) is not None for m in module.modules())
    forget_layout(module)
    if held:
        release_free_memory()


def _offer(into: Destinations | None, module: nn.Module) -> None:
    """Let the transport write each tensor of a full push straight into `module` (never the serving one)."""
    if into is None:
        return
    _drop_packs(module)  # the bytes change under torch's version counters
    if isinstance(module, CausalLM):
        def find(name: str) -> torch.Tensor | None:
            try:
                return checkpoint_view(module, name)
            except (AttributeError, IndexError, ValueError):  # not a weight of this model: the check refuses it
                return None
    else:
        find = module.state_dict().get
    into.offer(find)


@torch.no_grad()
def copy_serving(serving: CausalLM, spare: CausalLM | None) -> CausalLM:
    """The spare (allocated when there is none) holding a copy of the serving weights: what a delta applies to.
    Reading the serving weights while the engine runs is safe: nothing writes them while they serve."""
    p = next(serving.parameters())
    module = spare if spare is not None else empty_model(serving.config, p.dtype, p.device)
    for dst, src in zip(module.parameters(), serving.parameters(), strict=True):
        dst.copy_(src)
    return module


@torch.no_grad()
def apply_delta(model: CausalLM, entries: Iterable[tuple[str, torch.Tensor | SparseValues]]) -> int:
    """Overwrite what a checked delta names: whole tensors, or the elements of `SparseValues`. Returns the
    bytes it carried."""
    total = 0
    for name, t in entries:
        dst = checkpoint_view(model, name)
        if isinstance(t, SparseValues):
            total += t.nbytes
            if dst is not None:
                flat = dst if dst.is_contiguous() else dst.contiguous()  # a transposed float32 layout: via a copy
                flat.view(-1).index_copy_(0, t.indices.to(dst.device, torch.int64), t.values.to(dst.device,
                                                                                                dst.dtype))
                if flat is not dst:
                    dst.copy_(flat)
        else:
            total += t.numel() * t.element_size()
            if dst is not None:
                dst.copy_(t)
    return total


def _not_lent(module: nn.Module) -> bool:
    return False


class WeightStager:
    """Builds pushed weights for one engine. `stage` runs off the engine thread; `apply` on it."""

    def __init__(self, engine: EngineCore, reuse_buffers: bool = True) -> None:
        self.engine = engine
        self.reuse_buffers = reuse_buffers
        self._spare: dict[str, nn.Module] = {}
        self._lock = threading.Lock()
        self.lent: Callable[[nn.Module], bool] = _not_lent  # read by a teacher snapshot: not a staging buffer

    def _serving(self, role: str) -> nn.Module:
        if role == "target":
            return self.engine.runner.model
        if role == "drafter":
            found = self.engine.drafter_weights()
            if found is None:
                raise PushUnsupported(self.unsupported(role))
            return found[1]
        raise PushError(f"role must be 'target' or 'drafter', got {role!r}")

    def unsupported(self, role: str) -> str:
        if role == "drafter" and self.engine.drafter_weights() is None:
            drafter = str(self.engine.drafter_spec)
            return (f"the server runs drafter {drafter!r}, which has no draft model or head to push "
                    "weights into (start it with --drafter <draft model folder> or eagle:<head folder>)")
        return ""

    def roles(self) -> dict[str, WeightSpec]:
        roles = {"target": spec_of("target", self.engine.runner.model)}
        found = self.engine.drafter_weights()
        if found is not None:
            roles["drafter"] = spec_of("drafter", found[1])
        return roles

    def stage(self, role: str, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]], delta: bool = False,
              into: Destinations | None = None) -> Staged:
        """Build `role`'s pushed weights beside the serving ones (`delta`: a copy of them, then the delta);
        `into`: offered the buffer of a full push, for the transport to write the tensors into directly."""
        one_cpu_thread()  # a copy that converts dtypes would give this thread an OpenMP team of its own
        serving = self._serving(role)
        dtype, device = self.engine.dtype, self.engine.device
        with self._lock:
            spare = self._spare.pop(role, None)
        if spare is not None and self.lent(spare):
            spare = None  # an in-process trainer's teacher still reads these weights
        if spare is not None and (type(spare) is not type(serving) or getattr(spare, "config", None) != getattr(
                serving, "config", None) or not _placed(spare, dtype, device)):
            spare = None
        try:
            if delta:
                if not isinstance(serving, CausalLM):
                    raise PushUnsupported(f"delta pushes go to the target only; push the {role} in full")
                module = copy_serving(serving, spare)  # type: ignore[arg-type]
                _drop_packs(module)  # its packs are of the weights before the copy
                nbytes = apply_delta(module, tensors)  # type: ignore[arg-type]
            elif isinstance(serving, CausalLM):
                module: nn.Module = spare if spare is not None else empty_model(serving.config, dtype, device)
                _offer(into, module)
                nbytes = _load_laid_out(module, tensors)  # type: ignore[arg-type]
                if spare is None:
                    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
            else:
                module = spare if spare is not None else copy.deepcopy(serving)
                _offer(into, module)
                nbytes = _load_state(module, tensors)
            ensure_packed(module)  # here, not on the engine thread: its swap then only swaps references
        except WeightError as exc:
            self._keep(role, spare)
            raise PushError(f"{role} weights: {exc}") from exc
        except BaseException:
            self._keep(role, spare)  # not serving: its contents do not matter, its memory does
            raise
        release_free_memory()  # what staging freed (row-major copies packed from, packs replaced) goes back
        return Staged(role, nbytes, module.eval().requires_grad_(False))

    @torch.no_grad()
    def stage_in_place(self, role: str, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]],
                       delta: bool = False, into: Destinations | None = None) -> Staged:
        """`stage`, writing into the serving weights themselves (`--weight-spare in-place`): no spare exists.
        Only while generation is paused for this push (the push service holds that pause). A failure after a
        tensor was drawn or a destination taken leaves the serving weights part old, part new, and the caller
        must mark them invalid; before that, nothing was written."""
        one_cpu_thread()
        serving = self._serving(role)
        _drop_packs(serving)  # its CPU packs describe the old bytes
        try:
            if delta:
                if not isinstance(serving, CausalLM):
                    raise PushUnsupported(f"delta pushes go to the target only; push the {role} in full")
                nbytes = apply_delta(serving, tensors)
            elif isinstance(serving, CausalLM):
                _offer(into, serving)
                # generation is paused: the cores this thread does not load on lay out
                nbytes = _load_laid_out(serving, tensors, max(1, usable_cpus() - 1))  # type: ignore[arg-type]
            else:
                _offer(into, serving)
                nbytes = _load_state(serving, tensors)
        except WeightError as exc:
            raise PushError(f"{role} weights: {exc}") from exc
        finally:
            ensure_packed(serving)  # laid out again whatever was written: the engine only ever sees packed weights
            release_free_memory()
        return Staged(role, nbytes, serving)

    def allocate_spares(self) -> int:
        """Make each role's spare now (a copy of the serving weights, its pages touched) rather than at the first
        push. Returns the bytes allocated."""
        total = 0
        for role in self.roles():
            with self._lock:
                if role in self._spare:
                    continue
            serving = self._serving(role)
            spare = copy.deepcopy(serving).eval().requires_grad_(False)  # copies leave packs behind (packed.py)
            total += sum(p.numel() * p.element_size() for p in spare.parameters())
            self._keep(role, spare)
        return total

    def spare(self, role: str) -> nn.Module | None:
        """The buffer the next push of `role` loads into, if one is kept (read-only: for tests and stats)."""
        with self._lock:
            return self._spare.get(role)

    def apply(self, staged: Staged, version: str) -> None:
        """Engine thread, between two steps: serve the staged weights; the replaced ones become the spare (an
        in-place push: they are the same module, which is kept by nobody else)."""
        if staged.role == "target":
            old: nn.Module = self.engine.runner.model
            self.engine.swap_target(staged.payload, version)
        else:
            found = self.engine.drafter_weights()
            if found is None:
                raise PushUnsupported("the drafter with weights went away")
            old = found[1]
            self.engine.swap_drafter(staged.payload, version)
        staged.payload = None
        self._keep(staged.role, old)

    def discard(self, staged: Staged) -> None:
        module, staged.payload = staged.payload, None
        self._keep(staged.role, module)

    def _keep(self, role: str, module: nn.Module | None) -> None:
        if module is None or module is self._serving_or_none(role):
            return
        if not self.reuse_buffers:
            _free_soon(module)
            return
        with self._lock:
            self._spare[role] = module

    def _serving_or_none(self, role: str) -> nn.Module | None:
        try:
            return self._serving(role)
        except (PushError, PushUnsupported):
            return None


FREE_WAIT_S = 5.0  # how long the trim waits for the weights' storage to go (a view kept elsewhere holds it)


def _free_soon(module: nn.Module) -> None:
    """Weights no spare keeps (`--weight-spare free`): when the last reference goes (the engine thread's swap
    returns), a thread of its own hands the freed heap back to the OS, off the engine thread. Without that,
    glibc keeps the pages and the server stays at two copies of the model between pushes. The module's
    finalizer runs before its tensors are released, so the thread trims once their storage is gone (a trim
    that ran first often found nothing to return)."""
    storages = [StorageWeakRef(t.untyped_storage()) for t in (*module.parameters(), *module.buffers())]

    def trim() -> None:
        deadline = time.monotonic() + FREE_WAIT_S
        while any(not s.expired() for s in storages) and time.monotonic() < deadline:
            time.sleep(0.001)
        release_free_memory()

    weakref.finalize(module, lambda: threading.Thread(target=trim, name="specroll-free", daemon=True).start())
