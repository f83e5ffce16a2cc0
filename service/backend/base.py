"""The seam between the transport layer and an engine: the `RolloutBackend` interface and the typed values that
cross it.

`service/api/` (HTTP, gRPC, weight-push protocol), the rollout buffer and the CLI depend on this module only;
the native engine (`service/engine/native.py`) and the vLLM backend (`service/vllm/`) implement it. Nothing here
holds a live engine object: what crosses is plain data (`BackendInfo`, `StatsSnapshot`, events), futures, named
tensors for weight pushes and, for a trainer in the same process, a read-only teacher and a drafter copy.

Threads: every method may be called from any thread. Methods returning a `Future` queue the work for the
backend's own engine thread and resolve it there; a caller that cancels the future (its client left) withdraws
work that has not started. `stage_weights` blocks (it copies tensors): call it off the event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.safetensors_io import shape_problems

if TYPE_CHECKING:
    import torch

    from service.backend.admission import Admission
    from service.backend.events import GenRequest, RequestHandle
    from service.backend.hooks import Hooks
    from service.tokenizer import Tokenizer

MODES = ("wait", "abort", "keep")
"""How a pause or a weight commit treats running requests: let them finish first, abort them (partial outputs
returned), or keep them running (a commit applies between two steps; later tokens carry the new version)."""

ROLES = ("target", "drafter")
PAIR_MODE = "with_target"
"""The mode of a drafter push that waits, staged, for the next target push and is published with it atomically."""

# Capabilities a backend may announce in BackendInfo.capabilities (clients read them from GetServerInfo).
CAP_ADAPTIVE_SD = "adaptive_sd"  # speculation depth chosen per step from live measurements
CAP_DRAFTER_PUSH = "drafter_push"  # the drafter has weights a push (or the sidecar) can replace
CAP_RAW_LOGPROBS = "raw_logprobs"
CAP_TOP_LOGPROBS = "top_logprobs"
CAP_SEEDS = "seeds"
CAP_DELTA_PUSH = "delta_push"  # a target push may send only what changed against the served version


class NotReady(RuntimeError):
    """The model is not loaded (yet), failed to load, or the backend is stopping (503 / UNAVAILABLE)."""


class PushError(ValueError):
    """A weight push that does not fit what the role serves (400 / INVALID_ARGUMENT)."""


class PushTooLarge(PushError):
    """An uploaded body whose header declares more bytes than the upload limit (413 / INVALID_ARGUMENT)."""


class PushUnsupported(RuntimeError):
    """This backend cannot take this kind of push, e.g. a drafter without weights (409 / FAILED_PRECONDITION)."""


class StaleBase(PushUnsupported):
    """A delta push against a version that is not the one served (409 / FAILED_PRECONDITION); nothing changed."""


def check_mode(mode: str | None) -> str:
    mode = (mode or "wait").lower()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """What a push to one role must match: every tensor of `shapes` (Hugging Face names), nothing unknown, in
    `dtype` (the serving one; a push in another dtype must ask for a cast). `tolerated` may be present and is
    ignored (a tied checkpoint's lm_head)."""

    role: str
    architecture: str
    shapes: Mapping[str, tuple[int, ...]]
    tolerated: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    dtype: str = ""

    def check(self, shapes: Mapping[str, tuple[int, ...]], *, partial: bool = False) -> None:
        """Raise PushError naming unknown, missing or misshaped tensors."""
        problems = shape_problems(self.shapes, self.tolerated, shapes, partial)
        if problems:
            raise PushError(f"checkpoint does not match {self.architecture}: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """What does not change while the model is loaded."""

    backend: str  # "native" | "vllm"
    model_path: Path
    vocab_size: int
    max_model_len: int
    dtype: str
    eos_token_id: int | None
    drafter: str  # the --drafter setting, "none" without speculation
    num_slots: int  # sequences the running batch can hold
    capabilities: frozenset[str] = frozenset()
    parallel: tuple[int, int, int] = (1, 1, 1)  # tensor, pipeline, data parallel sizes
    # sampled requests under speculation: "exact" (served), "refused: <why>", or "no speculation"
    speculative_sampling: str = "exact"

    @property
    def world_size(self) -> int:
        """Workers behind this server (tensor x pipeline x data parallel)."""
        tp, pp, dp = self.parallel
        return tp * pp * dp


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """The engine's state and counters, taken on the engine's side (one consistent copy per step)."""

    policy_version: str = "0"
    drafter_version: str = "0"
    num_running: int = 0
    num_waiting: int = 0
    paused: bool = False
    admission_held: bool = False  # a wait-mode push or pause holds waiting requests back
    compiling: bool = False  # steps run eager forwards while the compiled ones are built in the background
    strategy: str = "plain"  # the decoding strategy of the last step
    mean_accepted_length: float = 0.0  # tokens per sequence per speculative step, recent steps
    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()


@dataclass(slots=True)
class SwapResult:
    version: str
    swap_seconds: float
    wait_seconds: float
    aborted: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Staged:
    """Weights received for `role`, checked and placed beside the serving ones, not serving yet. Only the
    backend that staged them reads `payload`."""

    role: str
    nbytes: int
    payload: Any = None


class Destinations:
    """Where a transport may write a push's tensor bytes directly: the backend's own staging storage.

    A backend that stages into buffers of its own (the native engine's spare) `offer`s a lookup of the buffer
    for a tensor name once it holds them, before it draws the first tensor; a transport then receives each tensor
    `get` gives it straight into that buffer (one copy from the wire) and hands that very tensor on, which the
    backend does not copy again. A tensor with no destination (another dtype, a layout that is not plain rows, a
    name the backend skips) goes the usual way. The buffers are the spare, or the serving weights of a push
    loaded in place; `taken` says whether any was handed out, its bytes then maybe written (a transport asks for
    a destination once that tensor's first bytes are at hand)."""

    __slots__ = ("_find", "taken")

    def __init__(self) -> None:
        self._find: Any = None
        self.taken = False

    def offer(self, find: Any) -> None:
        """`find(name)`: the tensor the backend would copy `name` into, or None."""
        self._find = find

    def get(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The tensor to write `name`'s bytes into (CPU, contiguous, of `dtype` and `shape`), or None."""
        find = self._find
        dst = find(name) if find is not None else None
        if (dst is None or dst.dtype != dtype or tuple(dst.shape) != tuple(shape) or dst.device.type != "cpu"
                or not dst.is_contiguous()):
            return None
        self.taken = True
        return dst.detach()


@dataclass(frozen=True, slots=True)
class SparseValues:
    """A delta push's new values for some elements of one tensor: `indices` (int32 or int64, into the tensor
    flattened in row-major order, strictly increasing) and `values` (one per index, the push's dtype). It stands
    in for the whole tensor in the (name, tensor) stream a delta push stages; every other element keeps its
    serving value."""

    shape: tuple[int, ...]
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * self.indices.element_size() + self.values.numel() * self.values.element_size()


@dataclass(frozen=True, slots=True, weakref_slot=True)
class TeacherSnapshot:
    """The target model serving `version`, lent read-only to a trainer in the same process (its teacher). While
    this object lives the backend writes nothing into `module`: a push replaces the serving weights and does not
    reuse lent ones as its staging buffer. Keep the snapshot, not only the module, for as long as it is read."""

    version: str
    module: Any  # torch.nn.Module


@dataclass(frozen=True, slots=True)
class DrafterCopy:
    """A copy of the serving drafter's weights, the caller's to train (they share nothing with the engine)."""

    kind: str  # "draft_model" | "eagle"
    module: Any  # torch.nn.Module
    version: str


class RolloutBackend(abc.ABC):
    """A rollout engine behind the transport layer. Implementations: native (`service/engine/native.py`),
    vLLM (`service/vllm/`)."""

    hooks: Hooks  # finished rollouts and rewards go out through these (the rollout buffer subscribes)
    admission: Admission  # bounds on queued work; submit_all admits whole requests or raises Overloaded

    # -- lifecycle -----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> None:
        """Start loading the model and serving in the background; `wait_loaded` tells when it is done."""

    @abc.abstractmethod
    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is in flight (every stream gets its final event), then stop the engine."""

    @abc.abstractmethod
    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded or failed to load; False on timeout."""

    @property
    @abc.abstractmethod
    def load_error(self) -> BaseException | None:
        """Why the model failed to load (liveness fails), None while loading or once loaded."""

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """Loaded and serving (also while paused)."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the engine failed or stopped: the process should be restarted."""

    # -- what it serves --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def info(self) -> BackendInfo:
        """Raises NotReady until loaded."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None: token ids only). Raises NotReady until loaded."""

    @abc.abstractmethod
    def stats(self) -> StatsSnapshot:
        """The latest snapshot (never blocks on the engine thread). Raises NotReady until loaded."""

    # -- generation ------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def submit_all(self, items: list[tuple[GenRequest, RequestHandle]]) -> None:
        """Admit every request or none (raises Overloaded), then queue them. The caller has validated each one
        against `info()` (`service.params.validate_request`, as every API does); the backend checks only what is
        its own (a request id in use, a parameter it cannot serve). Each handle then receives the request's chunks
        and one SampleDone per sample, or one Failed (invalid: the request's own error)."""

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str = "client") -> Future[bool]:
        """End a request; its samples finish with reason "abort" and their partial outputs."""

    @abc.abstractmethod
    def abort_all(self, reason: str = "admin") -> Future[list[str]]: ...

    @abc.abstractmethod
    def pause(self, mode: str) -> Future[list[str]]:
        """Pause generation (mode wait | abort | keep); resolves once nothing runs, with the aborted ids."""

    @abc.abstractmethod
    def resume(self) -> Future[None]: ...

    # -- in-place pushes (a backend that loads a push into the serving weights, no spare) ----------------
    @property
    def weights_in_place(self) -> bool:
        """A push pauses generation and loads into the serving weights (no second copy of them)."""
        return False

    @property
    def weights_invalid(self) -> str:
        """Why the serving weights are no version at all (an in-place push failed after its first write); ""
        while they are valid. Generation is refused and readiness fails until a complete push succeeds."""
        return ""

    def set_weights_invalid(self, reason: str) -> None:
        """Mark the serving weights invalid (`reason`) or, with "", valid again (a complete push served)."""
        if reason:
            raise PushUnsupported("this backend does not load pushes into its serving weights")

    def reset_prefix_cache(self) -> Future[bool]:
        """Drop KV cached across requests (prefix caching); True once dropped. A backend that caches nothing
        across requests has nothing to drop. Outputs do not change either way: cached KV is always of the
        serving weights (a push resets it)."""
        done: Future[bool] = Future()
        done.set_result(True)
        return done

    # -- weights ---------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def weight_roles(self) -> dict[str, WeightSpec]:
        """The roles a push may target now. A role left out raises PushUnsupported from `unsupported(role)`."""

    @abc.abstractmethod
    def unsupported(self, role: str) -> str:
        """Why `role` cannot be pushed to on this server ("" if it can)."""

    def stage_weights(self, role: str, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]], *,
                      cast: bool = False, delta: bool = False, into: Destinations | None = None) -> Staged:
        """Copy tensors beside the serving weights, each passing the one weight validation
        (`service/backend/weight_check.py`) before the backend sees it; `cast`: the push asked for its dtype to be
        cast to the serving one. `delta`: the tensors are only what changed (whole tensors, or `SparseValues`),
        applied to a copy of the serving weights (backends announcing CAP_DELTA_PUSH). Blocks; never on the
        engine thread or an event loop. Raises PushError if they do not fit; the serving weights are untouched.
        `into`: the transport writes tensors where the backend offers (`Destinations`); each still passes the
        validation before the backend takes it."""
        from service.backend.weight_check import WeightCheck  # it builds on this module's types

        spec = self.weight_roles().get(role)
        if spec is None:
            raise PushUnsupported(self.unsupported(role) or f"no weights to push for role {role!r}")
        checked = WeightCheck(spec, cast).stream(tensors, delta=delta)
        if into is not None:
            return self.stage_into(role, checked, into, delta=delta)
        return self.stage_checked(role, checked, delta=delta)

    def stage_into(self, role: str, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]],
                   into: Destinations, *, delta: bool = False) -> Staged:
        """`stage_checked`, offering `into` the buffers it stages in (see `Destinations`). Default: offers none,
        so the transport gathers each tensor itself and the backend copies it."""
        return self.stage_checked(role, tensors, delta=delta)

    @abc.abstractmethod
    def stage_checked(self, role: str, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]], *,
                      delta: bool = False) -> Staged:
        """`stage_weights` after the validation: the backend's own copy of each tensor (as it streams in). A
        tensor is valid only until the next one is drawn (transports reuse the bytes under it)."""

    @abc.abstractmethod
    def commit_weights(self, staged: Staged, version: str, mode: str,
                       drafter: tuple[Staged, str] | None = None) -> Future[SwapResult]:
        """Serve `staged` as `version` between two steps, following `mode`. Cancelling the future before it
        applies withdraws the push (the staged weights are released by the backend). `drafter` (staged drafter
        weights and their version) goes with a target commit as one atomic pair: both serve from the same step
        on, or neither does (and both are released)."""

    @abc.abstractmethod
    def discard(self, staged: Staged) -> None:
        """Release staged weights that will not be committed."""

    # -- the in-process drafter trainer (optional) -----------------------------------------------------------
    def teacher_snapshot(self) -> Future[TeacherSnapshot]:
        """The serving target and its version, taken on the engine thread between two steps. Raises
        PushUnsupported where the backend lends none (the sidecar loads its teacher from a folder instead)."""
        raise PushUnsupported(f"the {type(self).__name__} lends no teacher to an in-process trainer")

    def drafter_copy(self) -> Future[DrafterCopy | None]:
        """A trainable copy of the serving drafter, taken on the engine thread between two steps; None when the
        drafter has no weights. Raises PushUnsupported where the backend lends none. A trained copy goes back
        through `stage_weights("drafter", ...)` and `commit_weights`, like any push."""
        raise PushUnsupported(f"the {type(self).__name__} lends no drafter copy to an in-process trainer")

    # -- process exit ----------------------------------------------------------------------------------------
    def must_exit_hard(self) -> bool:
        """After `stop`: True when a thread of the backend cannot be joined and the process must end without
        finalizing (`os._exit`), e.g. a compile still running in the background. Default: False."""
        return False
