"""Reading a folder of safetensors files (single or sharded): which files, their headers, their tensors.

Headers are parsed and checked here, before safetensors maps a file: a header that lies (offsets past the file,
a byte span that does not fit its shape, overlapping or gapped spans, a name given twice) is a CheckpointError
naming the file and the tensor, never an exception from inside a reader. Index entries must name files inside
the folder (no `..`, no absolute paths).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath

import numpy as np
import torch
from safetensors import safe_open

from service.config import ConfigError

INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
              "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class CheckpointError(ConfigError):
    """A checkpoint folder or safetensors file that is malformed; the message names the file and tensor."""


def _index_map(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{INDEX} is not a valid checkpoint index: {exc!r}") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{INDEX}: weight_map must map tensor names to file names")
    for name, file in weight_map.items():
        parts = PurePosixPath(file).parts
        if not file or PurePosixPath(file).is_absolute() or "\\" in file or ".." in parts or file.startswith("~"):
            raise CheckpointError(f"{INDEX} maps {name!r} to {file!r}: index entries must name files inside the "
                                  "checkpoint folder")
    return weight_map


def safetensors_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        files = [path / n for n in sorted(set(_index_map(path).values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in model folder {str(path)!r}")
    for f in files:
        if not f.is_file():
            raise ConfigError(f"checkpoint index names {f.name!r} but the file is missing")
    return files


def index_map(path: Path) -> dict[str, str] | None:
    """The checked weight_map of a sharded folder (tensor name -> file name), None without an index."""
    return _index_map(path) if (path / INDEX).is_file() else None


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (safetensors dtype, shape) of one file, after checking the header against the file."""
    label = path.name
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{label}: {size} bytes, too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(f"{label}: the header claims {n} bytes; the file has {size - 8} after its length")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{label}: cannot be read: {exc}") from exc
    return {name: (dtype, shape) for name, dtype, shape, _, _ in header_spans(raw, size - 8 - n, label)}


def header_spans(raw: bytes, data_bytes: int | None, label: str) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """A safetensors header's tensors as (name, dtype, shape, begin, end) in data order, after checking that
    their spans tile the `data_bytes` that follow the header (None: a body whose length is not known yet; the
    spans must still tile [0, end of the last])."""

    def unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointError(f"{label}: the header names tensor {k!r} twice")
            out[k] = v
        return out

    try:
        header = json.loads(raw, object_pairs_hook=unique)
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{label}: the header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{label}: the header is not a JSON object")
    spans: list[tuple[int, int, str, str, tuple[int, ...]]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict):
            raise CheckpointError(f"{label}: tensor {name!r} has no dtype/shape/data_offsets entry")
        dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        if dtype not in ITEM_BYTES:
            raise CheckpointError(f"{label}: tensor {name!r} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CheckpointError(f"{label}: tensor {name!r} has a malformed shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{label}: tensor {name!r} has malformed data_offsets {offsets!r}")
        want = math.prod(shape) * ITEM_BYTES[dtype]
        if offsets[1] - offsets[0] != want:
            raise CheckpointError(f"{label}: the header lies about tensor {name!r}: shape {shape} in {dtype} is "
                                  f"{want} bytes, its data_offsets span {offsets[1] - offsets[0]}")
        if data_bytes is not None and offsets[1] > data_bytes:
            raise CheckpointError(f"{label}: the header lies about tensor {name!r}: its bytes end at {offsets[1]}, "
                                  f"past the {data_bytes} data bytes the file holds")
        spans.append((offsets[0], offsets[1], name, dtype, tuple(shape)))
    end = 0
    for begin, stop, name, _, _ in sorted(spans):
        if begin != end:
            raise CheckpointError(f"{label}: the header lies: tensor {name!r} starts at byte {begin}, the tensor "
                                  f"before it ends at {end} (spans must follow each other without gaps or overlap)")
        end = stop
    if data_bytes is not None and end != data_bytes:
        raise CheckpointError(f"{label}: the header covers {end} data bytes, the file holds {data_bytes}")
    return [(name, dtype, shape, begin, stop) for begin, stop, name, dtype, shape in sorted(spans)]


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, in file order. A file that fails to read (changed after its header was
    checked, or torn) raises CheckpointError."""
    for f in files:
        try:
            sf_cm = safe_open(str(f), framework="pt")
            sf = sf_cm.__enter__()
        except Exception as exc:  # safetensors' own error type is not part of its API
            raise CheckpointError(f"{f.name}: not a readable safetensors file: {exc}") from exc
        try:
            for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                try:
                    tensor = sf.get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(f"{f.name}: tensor {name!r} cannot be read: {exc}") from exc
                yield name, tensor
        finally:
            sf_cm.__exit__(None, None, None)


TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _read_exactly(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


def read_tensors(files: list[Path], place: Callable[[str, torch.dtype, tuple[int, ...]], torch.Tensor | None]
                 | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files in data order, each read once from its file: straight into the tensor `place`
    gives for it (its destination), else into one buffer reused for the next tensor (valid until the next is
    drawn). No intermediate tensor per file or tensor: from the page cache or tmpfs this is one copy. Headers are
    checked again as each file is opened; a file torn or changed meanwhile raises CheckpointError."""
    staging = np.empty(0, dtype=np.uint8)
    for f in files:
        label = f.name
        try:
            fd = os.open(f, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise CheckpointError(f"{label}: cannot be read: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise CheckpointError(f"{label}: {size} bytes, too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(f"{label}: the header claims {n} bytes; the file has {size - 8} after its length")
            raw = os.pread(fd, n, 8)
            for name, dtype, shape, begin, end in header_spans(raw, size - 8 - n, label):
                tdtype = TORCH_DTYPES.get(dtype)
                if tdtype is None:
                    raise CheckpointError(f"{label}: tensor {name!r} has dtype {dtype}, which cannot be loaded")
                nbytes = end - begin
                dst = place(name, tdtype, shape) if place is not None else None
                if dst is None:
                    if staging.size < nbytes:
                        staging = np.empty(nbytes, dtype=np.uint8)
                    target = staging[:nbytes]
                else:
                    target = dst.view(-1).view(torch.uint8).numpy()
                if _read_exactly(fd, memoryview(target), 8 + n + begin) != nbytes:
                    raise CheckpointError(f"{label}: tensor {name!r} cannot be read: the file ends inside it "
                                          "(it changed after its header was read)")
                yield name, dst if dst is not None else torch.from_numpy(target).view(tdtype).view(shape)
        except OSError as exc:
            raise CheckpointError(f"{label}: cannot be read: {exc}") from exc
        finally:
            os.close(fd)


def read_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes


IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.masked_bias)$")  # buffers, not weights


def shape_problems(expected: Mapping[str, tuple[int, ...]], tolerated: Mapping[str, tuple[int, ...]],
                   shapes: Mapping[str, tuple[int, ...]], partial: bool = False) -> list[str]:
    """Unknown, missing (unless `partial`) and misshaped tensors of `shapes` against a checkpoint layout;
    `tolerated` names may be present (a tied checkpoint's lm_head) and are checked when they are."""
    def want(name: str) -> tuple[int, ...] | None:
        return expected.get(name) or tolerated.get(name)

    unknown = sorted(n for n in shapes if want(n) is None and not IGNORED.search(n))
    missing = [] if partial else sorted(n for n in expected if n not in shapes)
    wrong = sorted(f"{n}: got {list(s)}, expected {list(want(n) or ())}" for n, s in shapes.items()
                   if want(n) is not None and tuple(s) != want(n))
    problems = []
    if unknown:
        problems.append(f"unknown tensors {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    if missing:
        problems.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if wrong:
        problems.append(f"wrong shapes {wrong[:8]}")
    return problems
