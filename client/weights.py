"""Turn a state_dict or a safetensors folder into a push: a manifest and chunks of raw tensor bytes.

Folders are memory-mapped and their tensor bytes are sent as they are on disk (no torch needed); state_dict
tensors are moved to CPU, optionally cast, and sent from their own memory. Chunks are encoded straight into
the PushWeightsRequest wire format so tensor bytes are copied once on the way out.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client.protogen import pb2

CHUNK_BYTES = 4 * 2**20
_ST_DTYPES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2)}


@dataclass(slots=True)
class TensorBytes:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview  # raw little-endian bytes
    sha256: str = ""
    owner: Any = None  # keeps the memory alive (a tensor or an mmap)


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


def hash_all(tensors: list[TensorBytes], threads: int = 4) -> None:
    """Fill in each tensor's sha256 (hashlib releases the GIL, so threads help)."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for t, digest in zip(tensors, pool.map(lambda x: hashlib.sha256(x.data).hexdigest(), tensors), strict=True):
            t.sha256 = digest


def manifest(tensors: list[TensorBytes], role: str, version: str, mode: str, cast: bool = False) -> Any:
    dtypes = sorted({t.dtype for t in tensors})
    if len(dtypes) != 1:
        raise ValueError(f"a push has one checkpoint dtype; these tensors have {dtypes} (pass dtype= to cast)")
    specs = [pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape), nbytes=len(t.data), sha256=t.sha256)
             for t in tensors]
    return pb2.WeightManifest(role=role, version=version, dtype=dtypes[0], tensors=specs, mode=mode, cast=cast)


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
