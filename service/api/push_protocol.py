"""Weight pushes: manifest validation and chunk assembly, independent of the transport.

A push is a manifest (role, version, checkpoint dtype, tensors with Hugging Face names, shapes, byte sizes
and sha256) followed by the tensors' raw bytes in manifest order, in chunks of at most 4 MiB. Everything
that can be checked is checked before the first byte is accepted (the one weight validation's `declared`
half, service/backend/weight_check.py, plus sizes and checksums' form); each tensor's checksum is verified as
soon as its bytes are complete, and the new weights are built beside the serving ones by a worker thread
while the bytes still arrive. Nothing is swapped unless the whole push was good.

A delta push names the version it applies to (`base_version`) and lists only tensors that changed, each
`dense` (its whole bytes) or `sparse`: int32 indices (int64 for tensors of 2^31 elements or more) into the
flattened tensor, strictly increasing, then one value per index in the push's dtype.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import queue
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from service.backend.base import ROLES, PushError, PushUnsupported, SparseValues, WeightSpec
from service.backend.weight_check import DTYPES, Declared, WeightCheck, dtype_name

T = TypeVar("T")
MAX_CHUNK_BYTES = 4 * 2**20
_VERSION = re.compile(r"^[A-Za-z0-9._:+@/-]{1,128}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
DENSE, SPARSE = "dense", "sparse"
ENCODINGS = (DENSE, SPARSE)
__all__ = ["DTYPES", "ChunkReceiver", "Manifest", "PushError", "PushResult", "TensorEntry", "dtype_name",
           "validate_manifest"]


@dataclass(slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sha256: str
    encoding: str = DENSE  # a delta push's tensor: dense (all its bytes) | sparse (indices, then values)


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of a sparse delta's indices into a tensor of `numel` elements."""
    return torch.int32 if numel < 2**31 else torch.int64


def sparse_count(entry: TensorEntry, itemsize: int) -> int:
    """How many elements a sparse entry's bytes carry; PushError if they cannot be indices plus values."""
    numel = math.prod(entry.shape)
    width = index_dtype(numel).itemsize + itemsize
    if entry.nbytes % width or entry.nbytes // width > numel:
        raise PushError(f"tensor {entry.name!r}: a sparse delta of {entry.nbytes} bytes is not n indices and n "
                        f"values ({width} bytes each) with n <= its {numel} elements")
    return entry.nbytes // width


def decode(entry: TensorEntry, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | SparseValues:
    """An entry's received bytes (uint8) as the tensor or the sparse delta they encode (views, no copy)."""
    if entry.encoding != SPARSE:
        return raw.view(dtype).view(entry.shape)
    idx = index_dtype(math.prod(entry.shape))
    count = sparse_count(entry, dtype.itemsize)
    cut = count * idx.itemsize
    return SparseValues(entry.shape, raw[:cut].view(idx), raw[cut:].view(dtype))


INDICES, VALUES = ":indices", ":values"  # the suffixes of a sparse delta's two tensors in a safetensors body


def sparse_pairs(tensors: dict[str, torch.Tensor], spec: WeightSpec) -> dict[str, torch.Tensor | SparseValues]:
    """A delta upload's tensors by name: `NAME:indices` with `NAME:values` become one `SparseValues` for NAME
    (of the shape `spec` gives NAME), other tensors stay whole."""
    out: dict[str, torch.Tensor | SparseValues] = {}
    for key, t in tensors.items():
        if not key.endswith((INDICES, VALUES)):
            if key in out:
                raise PushError(f"tensor {key!r} comes whole and as a sparse delta: send one")
            out[key] = t
            continue
        name, _, part = key.rpartition(":")
        other = f"{name}:{'values' if part == 'indices' else 'indices'}"
        if other not in tensors:
            raise PushError(f"tensor {key!r} has no {other!r}: a sparse delta sends both")
        shape = spec.shapes.get(name, spec.tolerated.get(name))
        if shape is None:
            raise PushError(f"sparse delta for {name!r}, which the {spec.role} ({spec.architecture}) does not have")
        if name in out:
            if not isinstance(out[name], SparseValues):
                raise PushError(f"tensor {name!r} comes whole and as a sparse delta: send one")
            continue
        pair = (t, tensors[other]) if part == "indices" else (tensors[other], t)
        out[name] = SparseValues(tuple(shape), pair[0], pair[1])
    return out


@dataclass(slots=True)
class Manifest:
    role: str
    version: str
    dtype: str
    tensors: list[TensorEntry]
    mode: str = "wait"
    cast: bool = False  # the pusher asks for its dtype to be cast to the serving one
    base_version: str = ""  # a delta push: the served version its tensors apply to ("" = a full push)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(slots=True)
class PushResult:
    role: str
    version: str
    nbytes: int
    seconds: float
    swap_seconds: float = 0.0
    wait_seconds: float = 0.0
    aborted: list[str] = field(default_factory=list)


def check_role_version(role: str, version: str) -> None:
    if role not in ROLES:
        raise PushError(f"role must be one of {list(ROLES)}, got {role!r}")
    if not _VERSION.match(version or ""):
        raise PushError(f"version must be 1-128 characters of [A-Za-z0-9._:+@/-], got {version!r}")


def validate_manifest(m: Manifest, spec: WeightSpec, max_bytes: int) -> None:
    """Check a manifest completely before any byte is accepted; `spec` is what the role's weights must be."""
    check_role_version(m.role, m.version)
    if m.base_version:
        check_role_version(m.role, m.base_version)
    if not m.tensors and not m.base_version:
        raise PushError("the manifest lists no tensors")
    declared = dtype_name(m.dtype)
    itemsize = torch.empty((), dtype=DTYPES[declared]).element_size()
    for t in m.tensors:
        t.encoding = t.encoding or DENSE
        if t.encoding not in ENCODINGS:
            raise PushError(f"tensor {t.name!r}: encoding must be one of {list(ENCODINGS)}, got {t.encoding!r}")
        if t.encoding == SPARSE and not m.base_version:
            raise PushError(f"tensor {t.name!r} is sparse, which only a delta push (base_version) may send")
        if t.dtype != declared and dtype_name(t.dtype) != declared:
            raise PushError(f"tensor {t.name!r} has dtype {t.dtype}, but the manifest declares {declared}")
    try:
        if m.tensors:
            WeightCheck(spec, m.cast).declared((Declared(t.name, t.dtype, t.shape) for t in m.tensors),
                                               partial=bool(m.base_version))
    except PushError as exc:
        raise PushError(f"{m.role} push: {exc}") from exc
    for t in m.tensors:
        if t.encoding == SPARSE:
            sparse_count(t, itemsize)
            expected = t.nbytes
        else:
            expected = math.prod(t.shape) * itemsize
        if t.nbytes != expected:
            raise PushError(f"tensor {t.name!r}: nbytes {t.nbytes} != {expected} for shape {list(t.shape)} "
                            f"in {declared}")
        if not _HEX64.match(t.sha256.lower()):
            raise PushError(f"tensor {t.name!r}: sha256 must be 64 hex digits, got {t.sha256!r}")
    if m.total_bytes > max_bytes:
        raise PushError(f"push of {m.total_bytes} bytes exceeds the server limit of {max_bytes} bytes")


_END, _CANCEL = object(), object()


class ChunkReceiver(Generic[T]):
    """Accepts the byte stream of a push and runs `build(tensors)` on a worker thread as tensors complete.

    `build` gets an iterator of (name, tensor) in manifest order; every tensor it sees has passed its
    checksum. A bad chunk, a checksum mismatch or a cancel makes the iterator raise, so `build` fails
    and nothing it made escapes.
    """

    def __init__(self, manifest: Manifest, build: Callable[[Iterator[tuple[str, torch.Tensor | SparseValues]]], T],
                 max_queued: int = 16) -> None:
        self.manifest = manifest
        self.received = 0
        self._build = build
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="specroll-push", daemon=True)
        self._thread.start()

    # -- transport side ----------------------------------------------------------------------------
    def _check_chunk(self, offset: int, size: int) -> None:
        if self._error is not None:
            raise self._as_push_error(self._error)
        if size > MAX_CHUNK_BYTES:
            raise PushError(f"chunk at offset {offset} has {size} bytes; chunks must be at most {MAX_CHUNK_BYTES}")
        if offset != self.received:
            raise PushError(f"chunk at offset {offset} but {self.received} bytes were received so far "
                            "(chunks must be sent in order, without gaps)")
        if self.received + size > self.manifest.total_bytes:
            raise PushError(f"chunks carry more than the {self.manifest.total_bytes} bytes the manifest announces")

    def _put(self, item: Any) -> None:
        while self._thread.is_alive():
            try:
                self._q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        if self._error is not None:
            raise self._as_push_error(self._error)

    def feed(self, offset: int, data: bytes | memoryview) -> None:
        """Blocking variant for threads."""
        self._check_chunk(offset, len(data))
        self.received += len(data)
        self._put(data)

    async def afeed(self, offset: int, data: bytes | memoryview) -> None:
        """Event-loop variant: waits off the loop only when the worker lags behind."""
        self._check_chunk(offset, len(data))
        self.received += len(data)
        try:
            self._q.put_nowait(data)
        except queue.Full:
            await asyncio.to_thread(self._put, data)

    def finish(self) -> T:
        """All bytes were sent: wait for the worker and return what `build` made."""
        if self.received != self.manifest.total_bytes:
            self.cancel()
            raise PushError(f"push ended after {self.received} of {self.manifest.total_bytes} bytes")
        self._put(_END)
        self._thread.join()
        if self._error is not None:
            raise self._as_push_error(self._error)
        return self._result  # type: ignore[return-value]

    def cancel(self) -> None:
        if self._thread.is_alive():
            try:
                self._q.put_nowait(_CANCEL)
            except queue.Full:
                threading.Thread(target=self._put, args=(_CANCEL,), daemon=True).start()

    @staticmethod
    def _as_push_error(exc: BaseException) -> BaseException:
        return exc if isinstance(exc, PushError | PushUnsupported) else PushError(f"could not build weights: {exc}")

    # -- worker side -------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self._result = self._build(self._tensors())
            if self._q.get() is not _END:  # build stopped early: it must have consumed every tensor
                raise PushError("the weights were built before the push ended")
        except BaseException as exc:
            self._error = exc
            self._drain()

    def _drain(self) -> None:
        """Unblock a transport thread stuck on a full queue after the worker failed."""
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass

    def _next(self) -> memoryview:
        item = self._q.get()
        if item is _CANCEL:
            raise PushError("the push was cancelled before all bytes arrived")
        if item is _END:
            raise PushError("the push ended before every tensor was complete")
        return memoryview(item).cast("B")

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor | SparseValues]]:
        chunk, pos = memoryview(b""), 0
        for entry in self.manifest.tensors:
            staging = np.empty(entry.nbytes, dtype=np.uint8)  # numpy copies release the GIL
            hasher = hashlib.sha256()
            filled = 0
            while filled < entry.nbytes:
                if pos == len(chunk):
                    chunk, pos = self._next(), 0
                take = min(entry.nbytes - filled, len(chunk) - pos)
                piece = chunk[pos : pos + take]
                staging[filled : filled + take] = np.frombuffer(piece, dtype=np.uint8)
                hasher.update(piece)
                filled += take
                pos += take
            if hasher.hexdigest() != entry.sha256.lower():
                raise PushError(f"checksum mismatch for tensor {entry.name!r}: the bytes received hash to "
                                f"{hasher.hexdigest()}, the manifest says {entry.sha256}")
            dtype = DTYPES[dtype_name(entry.dtype)]
            yield entry.name, decode(entry, torch.from_numpy(staging), dtype)
        if pos != len(chunk):
            raise PushError("a chunk carries bytes past the last tensor")
