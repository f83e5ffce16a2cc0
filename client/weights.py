"""Turn a state_dict or a safetensors folder into a push: a manifest and chunks of raw tensor bytes.

Folders are memory-mapped and their tensor bytes are sent as they are on disk (no torch needed); state_dict
tensors are moved to CPU, optionally cast, and sent from their own memory. Chunks are encoded straight into
the PushWeightsRequest wire format so tensor bytes are copied once on the way out. Each tensor carries a digest
of the push's checksum kind (client/checksums.py: xxh3_128 by default).

A delta push sends only what changed since a version the server serves (`delta`): tensors whose bytes differ,
each whole or, where few of its elements changed, as sparse indices and values. `PushedState` remembers what
was pushed last, the base of the next delta.
"""

from __future__ import annotations

import base64
import json
import mmap
import struct
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client import checksums
from client.protogen import pb2

CHUNK_BYTES = 4 * 2**20
SPARSE_BELOW = 0.5  # a changed tensor goes sparse when that takes under this fraction of its dense bytes
_ST_DTYPES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2)}


@dataclass(slots=True)
class TensorBytes:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview  # raw little-endian bytes
    digest: str = ""  # hex, of the push's checksum kind
    owner: Any = None  # keeps the memory alive (a tensor or an mmap)
    encoding: str = "dense"  # a delta push's tensor: dense | sparse (indices, then values)


@dataclass(slots=True)
class RawChunk:
    offset: int
    parts: list[memoryview] = field(default_factory=list)


def on_cpu(state: Mapping[str, Any], dtype: Any = None) -> dict[str, Any]:
    """The state_dict's tensors on CPU, contiguous, cast to `dtype` (a torch dtype or its name) when given."""
    import torch

    target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return {name: t.detach().to("cpu", target or t.dtype).contiguous() for name, t in state.items()}


def from_state_dict(state: Mapping[str, Any], dtype: Any = None) -> list[TensorBytes]:
    """Tensors of a state_dict (Hugging Face names), on CPU, cast to `dtype` when given."""
    import torch

    out = []
    for name, t in on_cpu(state, dtype).items():
        flat = t.reshape(-1).view(torch.uint8)
        out.append(TensorBytes(name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                               memoryview(flat.numpy()).cast("B"), owner=t))
    return out


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def from_folder(path: str | Path) -> list[TensorBytes]:
    """Tensors of every safetensors file in a folder, memory-mapped."""
    out = []
    for f in _safetensors_files(Path(path)):
        with open(f, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        (header_len,) = struct.unpack("<Q", mm[:8])
        header = json.loads(mm[8 : 8 + header_len])
        base = 8 + header_len
        view = memoryview(mm)
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _ST_DTYPES:
                raise ValueError(f"tensor {name!r} in {f.name} has dtype {meta['dtype']}; pushes take F32/BF16/F16")
            start, end = meta["data_offsets"]
            out.append(TensorBytes(name, _ST_DTYPES[meta["dtype"]][0], tuple(meta["shape"]),
                                   view[base + start : base + end], owner=mm))
    return out


SHM_DIR = "/dev/shm"  # tmpfs on Linux: a file there is memory, read by a server on the same host at memcpy speed
_TO_ST = {name: st for st, (name, _) in _ST_DTYPES.items()}


def _safetensors_header(tensors: list[TensorBytes]) -> bytes:
    """The length-prefixed safetensors header of `tensors` laid out in their order, padded so the data starts
    8-byte aligned (as safetensors writes it)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        if t.dtype not in _TO_ST:
            raise ValueError(f"tensor {t.name!r} has dtype {t.dtype}; pushes take float32, bfloat16 or float16")
        header[t.name] = {"dtype": _TO_ST[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_safetensors(fd: int, tensors: list[TensorBytes]) -> None:
    """One safetensors file written to `fd` from its start, each tensor's bytes once from its own memory."""
    import os

    for view in (memoryview(_safetensors_header(tensors)), *(t.data for t in tensors)):
        while view:
            view = view[os.write(fd, view):]


def write_safetensors_folder(tensors: list[TensorBytes], parent: str | Path = SHM_DIR) -> Path:
    """A new private folder under `parent` (mode 0700) holding the tensors as one `model.safetensors`. The
    caller removes the folder (`shutil.rmtree`)."""
    import os
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="specroll-push-", dir=parent))
    try:
        fd = os.open(folder / "model.safetensors", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_safetensors(fd, tensors)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def write_sealed_memfd(tensors: list[TensorBytes]) -> int:
    """An anonymous in-memory file (memfd) holding the tensors as one safetensors file, sealed against writes,
    shrinking and growing: whoever reads it sees exactly these bytes. Linux only. The caller closes the fd (the
    memory is freed with its last reference); the server opens it as `/proc/<pid>/fd/<fd>` (`memfd_path`)."""
    import fcntl
    import os

    fd = os.memfd_create("specroll-push", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        _write_safetensors(fd, tensors)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def memfd_path(fd: int) -> str:
    """The path a server on this host (in this process's PID namespace) opens the memfd `fd` of this process by."""
    import os

    return f"/proc/{os.getpid()}/fd/{fd}"


def hash_all(tensors: list[TensorBytes], threads: int = 4, checksum: str = checksums.DEFAULT) -> None:
    """Fill in each tensor's digest of kind `checksum` (the hashes release the GIL, so threads help)."""
    kind = checksums.kind_of(checksum)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for t, digest in zip(tensors, pool.map(lambda x: checksums.digest_of(kind, x.data), tensors), strict=True):
            t.digest = digest


def manifest(tensors: list[TensorBytes], role: str, version: str, mode: str, cast: bool = False,
             base_version: str = "", dtype: str = "", checksum: str = checksums.DEFAULT) -> Any:
    """The push's manifest; a delta (`base_version`) names its dtype in `dtype` (it may list no tensor). Each
    tensor's digest (`hash_all` with the same `checksum`) goes in its TensorSpec."""
    kind = checksums.kind_of(checksum)
    dtypes = sorted({t.dtype for t in tensors} | ({dtype} if dtype else set()))
    if len(dtypes) != 1:
        raise ValueError(f"a push has one checkpoint dtype; these tensors have {dtypes} (pass dtype= to cast)")
    specs = [pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape), nbytes=len(t.data), digest=t.digest,
                            sha256=t.digest if kind == "sha256" else "",  # servers that predate `checksum`
                            encoding="" if t.encoding == "dense" else t.encoding)
             for t in tensors]
    return pb2.WeightManifest(role=role, version=version, dtype=dtypes[0], tensors=specs, mode=mode, cast=cast,
                              base_version=base_version, checksum=kind)


# -- delta pushes -------------------------------------------------------------------------------------------
def _bits(t: Any) -> Any:
    """The tensor's bits as integers of its width (equal bits compare equal, NaN and -0.0 included)."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def changed(previous: Any, new: Any) -> Any:
    """Flat int64 indices of the elements whose bits differ (tensors of one dtype and shape)."""
    return (_bits(previous).reshape(-1) != _bits(new).reshape(-1)).nonzero().reshape(-1)


def sparse_parts(new: Any, idx: Any) -> tuple[Any, Any]:
    """A sparse delta's two tensors: indices (int32, int64 for 2^31 elements or more) and the new values."""
    import torch

    index = idx.to(torch.int32 if new.numel() < 2**31 else torch.int64)
    return index, new.reshape(-1)[idx].contiguous()


def plan_delta(previous: Mapping[str, Any], new: Mapping[str, Any], sparse_below: float = SPARSE_BELOW
               ) -> Iterator[tuple[str, Any, tuple[Any, Any] | None]]:
    """What changed from `previous` to `new` (CPU tensors, Hugging Face names): (name, new tensor, sparse parts
    or None) for each tensor whose bits differ, sparse when its indices and values take under `sparse_below` of
    its dense bytes. A tensor absent from `previous`, or of another dtype or shape there, goes whole."""
    for name, t in new.items():
        old = previous.get(name)
        if old is not None and old.dtype == t.dtype and old.shape == t.shape:
            idx = changed(old, t)
            if not idx.numel():
                continue
            index, values = sparse_parts(t, idx)
            if index.nbytes + values.nbytes < sparse_below * t.nbytes:
                yield name, t, (index, values)
                continue
        yield name, t.contiguous(), None


def delta(previous: Mapping[str, Any], new: Mapping[str, Any], sparse_below: float = SPARSE_BELOW
          ) -> list[TensorBytes]:
    """`plan_delta` as the tensors of a delta push."""
    import torch

    out = []
    for name, t, sparse in plan_delta(previous, new, sparse_below):
        dtype = str(t.dtype).removeprefix("torch.")
        if sparse is not None:
            blob = torch.cat([sparse[0].view(torch.uint8), sparse[1].view(torch.uint8)])
            out.append(TensorBytes(name, dtype, tuple(t.shape), memoryview(blob.numpy()).cast("B"), owner=blob,
                                   encoding="sparse"))
        else:
            flat = t.reshape(-1).view(torch.uint8)
            out.append(TensorBytes(name, dtype, tuple(t.shape), memoryview(flat.numpy()).cast("B"), owner=t))
    return out


def delta_state_dict(previous: Mapping[str, Any], new: Mapping[str, Any], sparse_below: float = SPARSE_BELOW
                     ) -> dict[str, Any]:
    """`plan_delta` as tensors for a safetensors body (HTTP `/weights/upload?base_version=`): a sparse tensor as
    `NAME:indices` and `NAME:values`."""
    out: dict[str, Any] = {}
    for name, t, sparse in plan_delta(previous, new, sparse_below):
        if sparse is not None:
            out[f"{name}:indices"], out[f"{name}:values"] = sparse
        else:
            out[name] = t
    return out


class PushedState:
    """What was last pushed to one server role, as CPU copies in the pushed dtype, and its version: the base a
    next push may send a delta against (`push_weights(..., delta_from=)`)."""

    def __init__(self) -> None:
        self.version: str | None = None
        self.tensors: dict[str, Any] = {}

    def record(self, tensors: Mapping[str, Any], version: str) -> None:
        self.tensors = {name: t.clone() for name, t in tensors.items()}
        self.version = version

    def forget(self) -> None:
        self.version, self.tensors = None, {}


def iter_chunks(tensors: list[TensorBytes], chunk_bytes: int = CHUNK_BYTES) -> Iterator[RawChunk]:
    """The concatenated tensor bytes in pieces of at most `chunk_bytes`, without copying."""
    if not 0 < chunk_bytes <= CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {CHUNK_BYTES}]")
    chunk, offset = RawChunk(0), 0
    size = 0
    for t in tensors:
        pos = 0
        while pos < len(t.data):
            take = min(chunk_bytes - size, len(t.data) - pos)
            chunk.parts.append(t.data[pos : pos + take])
            pos += take
            size += take
            if size == chunk_bytes:
                yield chunk
                offset += size
                chunk, size = RawChunk(offset), 0
    if size:
        yield chunk


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def serialize_push(msg: Any) -> bytes:
    """Request serializer for PushWeights: protobuf messages as usual, RawChunks encoded by hand.

    A RawChunk becomes PushWeightsRequest{chunk: WeightChunk{offset: 1, data: 2}} in standard wire format.
    """
    if not isinstance(msg, RawChunk):
        return msg.SerializeToString()  # type: ignore[no-any-return]
    size = sum(len(p) for p in msg.parts)
    head = b"\x08" + _varint(msg.offset) + b"\x12" + _varint(size)
    return b"".join([b"\x12", _varint(len(head) + size), head, *msg.parts])


# -- the trainer's half of a push over a process group (SGLang's /init_weights_update_group protocol) ----------
class GroupPushError(RuntimeError):
    """The server refused a push over a group or from CUDA IPC handles, or the group failed; the message is the
    server's."""


def _post(url: str, payload: Mapping[str, Any], token: str | None, timeout_s: float) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body
        raise GroupPushError(f"{url}: HTTP {exc.code}: {message}") from None


class _Call:
    """An HTTP call running on its own thread while this one broadcasts."""

    def __init__(self, url: str, payload: Mapping[str, Any], token: str | None, timeout_s: float) -> None:
        import threading

        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, payload, token, timeout_s), daemon=True)
        self._thread.start()

    def _run(self, url: str, payload: Mapping[str, Any], token: str | None, timeout_s: float) -> None:
        try:
            self.result = _post(url, payload, token, timeout_s)
        except BaseException as exc:
            self.error = exc

    def wait(self) -> dict[str, Any]:
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class WeightGroup:
    """A private process group with one server (rank 1), this process being rank 0: `push` broadcasts a state
    dict in buckets, each announced by an `/update_weights_from_distributed` call. Build it with `join`."""

    def __init__(self, http_url: str, pg: Any, group_name: str, token: str | None, timeout_s: float) -> None:
        self.http_url, self.pg, self.group_name, self.token, self.timeout_s = http_url, pg, group_name, token, timeout_s

    @classmethod
    def join(cls, http_url: str, *, admin_token: str | None = None, group_name: str = "specroll-weights",
             backend: str = "gloo", master_address: str = "127.0.0.1", master_port: int | None = None,
             timeout_s: float = 120.0) -> WeightGroup:
        import datetime

        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        port = master_port or _free_port()
        call = _Call(f"{http_url}/init_weights_update_group",
                     {"master_address": master_address, "master_port": port, "rank_offset": 1, "world_size": 2,
                      "group_name": group_name, "backend": backend, "timeout_s": timeout_s}, admin_token, timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        store, _, _ = next(rendezvous(f"tcp://{master_address}:{port}", 0, 2, timeout=timeout))
        store.set_timeout(timeout)
        pg, _ = _new_process_group_helper(2, 0, [], Backend(backend), PrefixStore(group_name, store),
                                          group_name=group_name, backend_options=None, timeout=timeout)
        _world.pg_group_ranks[pg] = {0: 0, 1: 1}
        call.wait()
        return cls(http_url, pg, group_name, admin_token, timeout_s)

    def push(self, state: Mapping[str, Any], version: str, *, mode: str = "wait", cast: bool = False,
             bucket_bytes: int = 256 * 2**20) -> dict[str, Any]:
        """Broadcast `state` (Hugging Face names) as `version`; returns the server's reply to the last bucket (the
        swap). The server checks the whole manifest first: a refused push broadcasts nothing."""
        import torch.distributed as dist

        tensors = [(n, t.detach().contiguous()) for n, t in state.items()]
        names = [n for n, _ in tensors]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        _post(f"{self.http_url}/weights/check", {"names": names, "dtypes": dtypes, "shapes": shapes, "cast": cast},
              self.token, self.timeout_s)
        buckets: list[list[tuple[str, Any]]] = [[]]
        size = 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, t))
            size += nbytes
        reply: dict[str, Any] = {}
        for bucket in buckets:
            call = _Call(f"{self.http_url}/update_weights_from_distributed", {
                "names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                "weight_version": version, "mode": mode, "cast": cast}, self.token, self.timeout_s)
            try:  # queued at once: gloo sends one while the next is handed over
                for handle in [dist.broadcast(t, 0, group=self.pg, async_op=True) for _, t in bucket]:
                    handle.wait()
            except RuntimeError:  # the server left the group: its reply says why
                call.wait()
                raise
            reply = call.wait()
        return reply

    def close(self) -> None:
        import torch.distributed as dist

        try:
            _post(f"{self.http_url}/destroy_weights_update_group", {"group_name": self.group_name}, self.token,
                  self.timeout_s)
        finally:
            dist.destroy_process_group(self.pg)


# -- a same-GPU push from a trainer's own memory (CUDA IPC handles, service/api/cuda_ipc.py) ------------------
def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def cuda_ipc_tensors(state: Mapping[str, Any], dtype: Any = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """The JSON handles of a state dict's CUDA tensors, and the tensors they point into, which the caller keeps
    until the server has answered. A contiguous tensor of the push's dtype is shared where it lives; any other is
    copied once on its GPU first."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    shared, out = [], []
    for name, t in state.items():
        if not t.is_cuda:
            raise ValueError(f"tensor {name!r} is on {t.device}: CUDA IPC shares GPU memory only")
        t = t.detach().to(target or t.dtype).contiguous()
        _rebuild, args = reduce_tensor(t)
        (_cls, size, _stride, offset, _storage_cls, _dtype, device, handle, storage_bytes, storage_offset,
         _grad, counter, counter_offset, event, event_sync) = args
        out.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(size),
                    "offset": offset, "device": device, "handle": _b64(handle), "storage_bytes": storage_bytes,
                    "storage_offset": storage_offset, "ref_counter": _b64(counter),
                    "ref_counter_offset": counter_offset, "event": _b64(event), "event_sync": bool(event_sync)})
        shared.append(t)
    return out, shared


def push_cuda_ipc(http_url: str, state: Mapping[str, Any], version: str, *, admin_token: str | None = None,
                  role: str = "target", mode: str = "wait", dtype: Any = None, cast: bool = False,
                  timeout_s: float = 600.0) -> dict[str, Any]:
    """Push `state` (Hugging Face names, tensors on a GPU of this host) as `version` through
    `/update_weights_from_tensor`: the server copies each tensor out of this process's memory into its spare and
    answers once done (the push's reply). Raises GroupPushError with the server's message when refused."""
    import torch

    handles, shared = cuda_ipc_tensors(state, dtype)
    try:
        return _post(f"{http_url}/update_weights_from_tensor",
                     {"ipc_tensors": handles, "weight_version": version, "role": role, "mode": mode, "cast": cast},
                     admin_token, timeout_s)
    finally:
        del shared
        torch.cuda.ipc_collect()  # frees what the server no longer maps
