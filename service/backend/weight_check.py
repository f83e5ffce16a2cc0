"""The one validation every weight push runs, whatever carried it (gRPC chunks, an HTTP upload, a folder, a
process-group broadcast, the in-process drafter trainer) and whichever backend serves it.

Two halves of one `WeightCheck`: `declared` runs before the first byte, on what the push says it holds (names,
dtypes, shapes: a manifest, safetensors headers); `stream` runs on the tensors as they arrive, before a backend
builds anything from them. Together they hold a push to: names known to the role's `WeightSpec`, each once,
every one present, the right shapes, one dtype, the serving dtype unless the push asks for a cast, and finite
values only (a diverged trainer writes NaN; served, every sample would end at once and reach the buffer as
training data). A delta push (`delta=True`) holds only what changed: any subset of the names, each a whole
tensor or `SparseValues` whose indices lie inside the tensor, strictly increasing (so none twice). Anything else
is a `PushError` naming the tensor (400 / INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from service.backend.base import PushError, SparseValues, WeightSpec
from service.safetensors_io import IGNORED, shape_problems

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SPELLINGS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "fp32": "float32", "bf16": "bfloat16",
              "fp16": "float16", "float": "float32", "half": "float16"}
_KNOWN = frozenset(_SPELLINGS) | frozenset(DTYPES) | {f"torch.{d}" for d in DTYPES}
_FINITE_STEP = 1 << 22  # elements checked at a time: isfinite's mask stays small for any tensor size
INDEX_DTYPES = (torch.int32, torch.int64)


def dtype_name(name: str) -> str:
    """Normalise a dtype spelling (float32, torch.bfloat16, BF16) or raise PushError."""
    key = str(name).removeprefix("torch.")
    key = _SPELLINGS.get(key, key)
    if key not in DTYPES:
        raise PushError(f"dtype {name!r} cannot be cast to model weights; use one of {list(DTYPES)}")
    return key


@dataclass(frozen=True, slots=True)
class Declared:
    """One tensor as a push announces it; `where` says where it was announced (a shard's file name)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    where: str = ""


def _finite(t: torch.Tensor) -> bool:
    """Whether every element is finite. A sum is finite only if every term is (a NaN or an infinity carries
    through any order of additions), and a sum reads the tensor once at memory speed, where `isfinite` writes a
    mask (bf16's runs ~60x slower); only a sum that is not finite (a bad element, or finite values that
    overflow) is settled element by element."""
    if not t.is_floating_point():
        return True
    flat = t.reshape(-1)
    if not flat.numel() or bool(torch.isfinite(flat.sum())):
        return True
    return all(bool(torch.isfinite(flat[i : i + _FINITE_STEP]).all()) for i in range(0, flat.numel(), _FINITE_STEP))


def sparse_problem(sparse: SparseValues) -> str:
    """Why a sparse delta cannot be applied to a tensor of its shape ("" if it can)."""
    idx, values = sparse.indices, sparse.values
    numel = math.prod(sparse.shape)
    if idx.dtype not in INDEX_DTYPES:
        return f"its indices are {str(idx.dtype).removeprefix('torch.')}, not int32 or int64"
    if idx.dim() != 1 or values.dim() != 1 or idx.numel() != values.numel():
        return (f"it has {idx.numel()} indices ({idx.dim()}-d) and {values.numel()} values ({values.dim()}-d): "
                "give one 1-d list of each, as long as each other")
    if idx.numel() > numel:
        return f"it has {idx.numel()} indices for a tensor of {numel} elements"
    if not idx.numel():
        return ""
    low, high = int(idx[0]), int(idx[-1])
    if low < 0 or high >= numel:
        return f"an index lies outside the tensor's {numel} elements (first {low}, last {high})"
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        repeated = bool((idx[1:] == idx[:-1]).any())
        return "an index appears twice" if repeated else "its indices are not in increasing order"
    return ""


class WeightCheck:
    """Validation of one push to the role `spec` describes. `cast`: the push asked for its dtype to be cast to
    the serving one (never done silently)."""

    def __init__(self, spec: WeightSpec, cast: bool = False) -> None:
        self.spec = spec
        self.cast = cast

    def _dtype(self, name: str, dtype: str, first: str | None) -> str:
        try:
            got = dtype_name(dtype)
        except PushError as exc:
            raise PushError(f"tensor {name!r}: {exc}") from exc
        if first is not None and got != first:
            raise PushError(f"the push mixes dtypes: tensor {name!r} has dtype {got}, others {first} (a push holds "
                            "one dtype)")
        if not self.cast and self.spec.dtype and got != self.spec.dtype:
            raise PushError(f"tensor {name!r} has dtype {got} but the served {self.spec.role} is "
                            f"{self.spec.dtype}: send {self.spec.dtype}, or ask for a cast explicitly (cast=true)")
        return got

    def _shapes(self, shapes: dict[str, tuple[int, ...]], partial: bool) -> None:
        problems = shape_problems(self.spec.shapes, self.spec.tolerated, shapes, partial)
        if problems:
            raise PushError(f"{self.spec.role} weights do not match {self.spec.architecture}: " + "; ".join(problems))

    def declared(self, tensors: Iterable[Declared], *, partial: bool = False) -> str:
        """Check what a push announces before any byte of it is accepted; returns its dtype. `partial`: one
        bucket of a push, whose other tensors come in other buckets."""
        where: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, str] = {}
        for t in tensors:
            if t.name in where:
                places = f" (in {where[t.name]} and {t.where})" if t.where else ""
                raise PushError(f"tensor {t.name!r} is listed twice{places}")
            where[t.name] = t.where
            if any(int(d) < 0 for d in t.shape):
                raise PushError(f"tensor {t.name!r} has a negative dimension: {list(t.shape)}")
            shapes[t.name] = tuple(int(d) for d in t.shape)
            if not IGNORED.search(t.name):
                dtypes.setdefault(dtype_name(t.dtype) if t.dtype in _KNOWN else t.dtype, t.name)
        if not shapes:
            raise PushError("the push holds no tensors")
        if len(dtypes) > 1:
            raise PushError(f"the push mixes dtypes {sorted(dtypes)} (e.g. {sorted(dtypes.values())}): a push holds "
                            "one dtype")
        self._shapes(shapes, partial=partial)
        if not dtypes:
            return self.spec.dtype
        [(dtype, name)] = dtypes.items()
        return self._dtype(name, dtype, None)

    def stream(self, tensors: Iterable[tuple[str, torch.Tensor | SparseValues]], *, delta: bool = False
               ) -> Iterator[tuple[str, torch.Tensor | SparseValues]]:
        """The tensors, each checked before it is passed on; raises (in the consumer) at the first bad one, and
        at the end if any was missing (unless `delta`: then any subset, and `SparseValues` too). Buffers the
        checkpoint may carry (rotary inv_freq) are dropped."""
        shapes: dict[str, tuple[int, ...]] = {}
        dtype: str | None = None
        for name, t in tensors:
            if name in shapes:
                raise PushError(f"tensor {name!r} arrives twice")
            sparse = t if isinstance(t, SparseValues) else None
            if sparse is not None and not delta:
                raise PushError(f"tensor {name!r} comes as sparse values, which only a delta push may send")
            shapes[name] = tuple(t.shape)
            if IGNORED.search(name):
                continue
            self._shapes({name: tuple(t.shape)}, partial=True)
            values = t if sparse is None else sparse.values
            dtype = self._dtype(name, str(values.dtype), dtype)
            if sparse is not None and (problem := sparse_problem(sparse)):
                raise PushError(f"sparse delta of tensor {name!r}: {problem}")
            if not _finite(values):
                raise PushError(f"tensor {name!r} holds NaN or infinite values: the weights diverged or the bytes "
                                "are corrupt")
            yield name, t
        if not shapes and not delta:
            raise PushError("the push holds no tensors")
        self._shapes(shapes, partial=delta)
