"""Weight pushes: manifest validation and chunk assembly, independent of the transport.

A push is a manifest (role, version, checkpoint dtype, checksum kind, tensors with Hugging Face names, shapes,
byte sizes and digests) followed by the tensors' raw bytes in manifest order, in chunks. Everything that can be
checked is checked before the first byte is accepted (the one weight validation's `declared` half,
service/backend/weight_check.py, plus sizes and digests' form); each tensor's digest (xxh3_128, crc32c or
sha256: client/checksums.py) is verified as soon as its bytes are complete, and the new weights are built beside
the serving ones by a worker thread while the bytes still arrive. A tensor that lies inside one chunk is handed
on as a view of it; a longer one is gathered in a staging buffer that is reused (no allocation per tensor or
push). Nothing is swapped unless the whole push was good.

A delta push names the version it applies to (`base_version`) and lists only tensors that changed, each
`dense` (its whole bytes) or `sparse`: int32 indices (int64 for tensors of 2^31 elements or more) into the
flattened tensor, strictly increasing, then one value per index in the push's dtype.
"""

from __future__ import annotations

import asyncio
import math
import queue
import re
import struct
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

import client.checksums as checksums
from service.backend.base import ROLES, Destinations, PushError, PushUnsupported, SparseValues, WeightSpec
from service.backend.weight_check import DTYPES, Declared, WeightCheck, dtype_name
from service.cpu_threads import behind_generation
from service.safetensors_io import MAX_HEADER_BYTES, CheckpointError, header_spans

T = TypeVar("T")
MAX_CHUNK_BYTES = 4 * 2**20
BODY_PART_BYTES = 4 * 2**20  # body pieces of an HTTP upload handed to the worker at a time
_VERSION = re.compile(r"^[A-Za-z0-9._:+@/-]{1,128}$")
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
DENSE, SPARSE = "dense", "sparse"
ENCODINGS = (DENSE, SPARSE)
__all__ = ["DTYPES", "ChunkReceiver", "Manifest", "PushError", "PushResult", "Staging", "TensorEntry", "dtype_name",
           "validate_manifest"]


@dataclass(slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: str = ""  # hex, of the manifest's checksum kind
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
    checksum: str | None = checksums.LEGACY  # each tensor's digest kind; None: none per tensor (an upload's body
    # carries one for the whole body)

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
    if m.checksum is not None:
        try:
            m.checksum = checksums.kind_of(m.checksum)
        except ValueError as exc:
            raise PushError(str(exc)) from None
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
        if m.checksum is not None and not checksums.well_formed(m.checksum, t.digest):
            raise PushError(f"tensor {t.name!r}: its {m.checksum} digest must be {checksums.hex_digits(m.checksum)} "
                            f"hex digits, got {t.digest!r}")
    if m.total_bytes > max_bytes:
        raise PushError(f"push of {m.total_bytes} bytes exceeds the server limit of {max_bytes} bytes")


_END, _CANCEL = object(), object()


class Staging:
    """A byte buffer a push gathers tensors in, grown to the largest tensor seen and kept for later pushes: one
    per role (one push per role at a time), so a steady stream of pushes allocates nothing."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)
        self.lock = threading.Lock()  # held by the worker using it (a cancelled push's may still be running)

    @property
    def capacity(self) -> int:
        """The bytes it holds (0 until a tensor had to be gathered apart from its destination)."""
        return int(self._buf.size)

    def take(self, nbytes: int) -> np.ndarray:
        if self._buf.size < nbytes:
            self._buf = np.empty(nbytes, dtype=np.uint8)
        return self._buf[:nbytes]


class ChunkReceiver(Generic[T]):
    """Accepts the byte stream of a push and runs `build(tensors)` on a worker thread as tensors complete.

    `build` gets an iterator of (name, tensor) in manifest order; every tensor it sees has passed its digest
    and stays valid only until it asks for the next (the bytes under it are reused: copy them). A bad chunk, a
    digest mismatch or a cancel makes the iterator raise, so `build` fails and nothing it made escapes.
    `whole`: a hasher fed every byte in order (an upload's body hash, the header fed beforehand) that must
    end as `whole_digest`. `discard` releases what `build` made when the push fails after it. `into`: the
    destinations `build`'s backend offers (service/backend/base.py `Destinations`): a dense tensor that has one
    is received straight into it and handed on as that tensor. `cancel` (or a failure) ends the worker at its
    next piece, so what `build` holds (the spare) is back with the backend before the push's caller goes on.
    `cancelled`: the event a cancel sets, for `build` to watch while it waits on something else (a pause).
    """

    def __init__(self, manifest: Manifest, build: Callable[[Iterator[tuple[str, torch.Tensor | SparseValues]]], T],
                 max_queued: int = 16, staging: Staging | None = None, max_chunk: int = MAX_CHUNK_BYTES,
                 whole: tuple[checksums.Hasher, str, str] | None = None,
                 discard: Callable[[T], None] | None = None, into: Destinations | None = None,
                 cancelled: threading.Event | None = None) -> None:
        self.manifest = manifest
        self.received = 0
        self._build = build
        self._staging = staging or Staging()
        self._max_chunk = max_chunk
        self._whole = whole  # (hasher, kind, expected hex digest)
        self._discard = discard
        self._into = into
        self._cancelled = cancelled if cancelled is not None else threading.Event()
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="specroll-push", daemon=True)
        self._thread.start()

    # -- transport side ----------------------------------------------------------------------------
    def _check_chunk(self, offset: int, size: int) -> None:
        if self._error is not None:
            raise self._as_push_error(self._error)
        if size > self._max_chunk:
            raise PushError(f"chunk at offset {offset} has {size} bytes; chunks must be at most {self._max_chunk}")
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

    @staticmethod
    def _size(data: Any) -> int:
        return sum(len(p) for p in data) if isinstance(data, list) else len(data)

    def feed(self, offset: int, data: bytes | memoryview | list[Any]) -> None:
        """Blocking variant for threads; `data` is one buffer or a list of buffers that follow each other."""
        size = self._size(data)
        self._check_chunk(offset, size)
        self.received += size
        self._put(data)

    async def afeed(self, offset: int, data: bytes | memoryview | list[Any]) -> None:
        """Event-loop variant: waits off the loop only when the worker lags behind."""
        size = self._size(data)
        self._check_chunk(offset, size)
        self.received += size
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
        self._cancelled.set()
        if self._thread.is_alive():
            try:
                self._q.put_nowait(_CANCEL)
            except queue.Full:
                threading.Thread(target=self._put, args=(_CANCEL,), daemon=True).start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker to end (after `finish` or `cancel`); True once it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @staticmethod
    def _as_push_error(exc: BaseException) -> BaseException:
        return exc if isinstance(exc, PushError | PushUnsupported) else PushError(f"could not build weights: {exc}")

    # -- worker side -------------------------------------------------------------------------------
    def _work(self) -> None:
        with behind_generation():  # this push's own thread
            if not self._staging.lock.acquire(blocking=False):  # an earlier push's worker still has it: never
                self._staging = Staging()  # wait on a push that may never end (its transport gone silent)
                self._staging.lock.acquire()
            try:
                self._run()
            finally:
                self._staging.lock.release()

    def _run(self) -> None:
        try:
            self._result = self._build(self._tensors())
            if self._q.get() is not _END:  # build stopped early: it must have consumed every tensor
                raise PushError("the weights were built before the push ended")
            if self._whole is not None:
                hasher, kind, want = self._whole
                if hasher.hexdigest() != want.lower():
                    raise PushError(f"checksum mismatch: the body hashes to {hasher.hexdigest()} ({kind}), the "
                                    f"request says {want}")
        except BaseException as exc:
            self._error = exc
            self._drain()
            built, self._result = self._result, None
            if built is not None and self._discard is not None:
                self._discard(built)

    def _drain(self) -> None:
        """Unblock a transport thread stuck on a full queue after the worker failed."""
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass

    def _pieces(self) -> Iterator[memoryview]:
        while True:
            item = _CANCEL if self._cancelled.is_set() else self._q.get()
            if item is _CANCEL:
                raise PushError("the push was cancelled before all bytes arrived")
            if item is _END:
                raise PushError("the push ended before every tensor was complete")
            for part in item if isinstance(item, list) else (item,):
                view = memoryview(part).cast("B")
                if self._whole is not None:
                    self._whole[0].update(view)
                if len(view):
                    yield view

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor | SparseValues]]:
        kind = self.manifest.checksum
        pieces = self._pieces()
        chunk, pos = memoryview(b""), 0
        for entry in self.manifest.tensors:
            hasher = checksums.new(kind) if kind is not None else None
            dtype = DTYPES[dtype_name(entry.dtype)]
            if pos == len(chunk) and entry.nbytes:
                chunk, pos = next(pieces), 0
            dst = None  # asked for once the tensor's first bytes are here: a push cut before them writes nothing
            if self._into is not None and entry.encoding == DENSE and entry.nbytes:
                dst = self._into.get(entry.name, dtype, tuple(entry.shape))
            if dst is None and len(chunk) - pos >= entry.nbytes:  # whole in this piece: a view of it, no copy
                data: Any = chunk[pos : pos + entry.nbytes]
                if hasher is not None:
                    hasher.update(data)
                pos += entry.nbytes
                array = np.frombuffer(data, dtype=np.uint8) if entry.nbytes else np.empty(0, np.uint8)
            else:
                array = self._staging.take(entry.nbytes) if dst is None else dst.view(-1).view(torch.uint8).numpy()
                filled = 0
                while filled < entry.nbytes:
                    if pos == len(chunk):
                        chunk, pos = next(pieces), 0
                    take = min(entry.nbytes - filled, len(chunk) - pos)
                    piece = chunk[pos : pos + take]
                    array[filled : filled + take] = np.frombuffer(piece, dtype=np.uint8)
                    if hasher is not None:
                        hasher.update(piece)
                    filled += take
                    pos += take
            if hasher is not None and hasher.hexdigest() != entry.digest.lower():
                raise PushError(f"checksum mismatch for tensor {entry.name!r}: its bytes hash to "
                                f"{hasher.hexdigest()} ({kind}), the manifest says {entry.digest}")
            if dst is not None:
                yield entry.name, dst  # in place already: the backend takes it as it lies
                continue
            tensor = torch.from_numpy(array) if array.flags.writeable else _readonly(array)
            yield entry.name, decode(entry, tensor, dtype)
        if pos != len(chunk):
            raise PushError("a chunk carries bytes past the last tensor")


def _readonly(array: np.ndarray) -> torch.Tensor:
    """A tensor over read-only bytes (a received message): the backend only reads it, then copies it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the tensor could write to them
        return torch.from_numpy(array)


# -- safetensors bodies (HTTP uploads) -------------------------------------------------------------------
@dataclass(slots=True)
class BodyHead:
    """The header of a streamed safetensors body, checked, and the bytes read past it."""

    raw: bytes  # length prefix + JSON header (what a body hash covers first)
    tensors: list[TensorEntry]
    rest: list[bytes]


async def read_body_head(body: AsyncIterator[bytes], length: int | None) -> BodyHead:
    """Read and check a safetensors header off the front of `body`; `length` the body's size when known."""
    buf = bytearray()
    n: int | None = None
    need = 8
    async for part in body:
        buf += part
        if n is None and len(buf) >= 8:
            (n,) = struct.unpack("<Q", buf[:8])
            limit = MAX_HEADER_BYTES if length is None else min(length - 8, MAX_HEADER_BYTES)
            if n > limit:
                raise PushError(f"the body is not a valid safetensors file: the header claims {n} bytes, more than "
                                f"the {limit} it may have")
            need = 8 + n
        if n is not None and len(buf) >= need:
            break
    if not buf:
        raise PushError("the body is empty: send the safetensors bytes")
    if n is None or len(buf) < need:
        raise PushError(f"the body is not a valid safetensors file: it ends after {len(buf)} bytes, inside its "
                        "header")
    head, got = bytes(buf[:need]), ([bytes(buf[need:])] if len(buf) > need else [])
    raw = head
    data_bytes = None if length is None else length - 8 - n
    try:
        spans = header_spans(raw[8:], data_bytes, "the body")
    except CheckpointError as exc:
        raise PushError(f"the body is not a valid safetensors file: {exc}") from exc
    entries = []
    for name, dtype, shape, begin, end in spans:
        entries.append(TensorEntry(name, _ST_DTYPES.get(dtype, dtype), shape, end - begin))
    return BodyHead(raw, entries, got)


async def body_parts(first: Sequence[bytes], body: AsyncIterator[bytes],
                     part_bytes: int = BODY_PART_BYTES) -> AsyncIterator[list[bytes]]:
    """The body's pieces, gathered in lists of about `part_bytes` (one hand-off to the worker each, no copy)."""
    group, size = list(first), sum(len(p) for p in first)
    async for part in body:
        if part:
            group.append(part)
            size += len(part)
            if size >= part_bytes:
                yield group
                group, size = [], 0
    if group:
        yield group
