"""Same-GPU weight pushes through CUDA IPC handles: a trainer on this host shares the GPU memory its tensors
already live in, and the server maps it and copies each tensor straight into the spare. That is one copy on the
device and no buffer of the server's own.

SGLang's /update_weights_from_tensor sends the tensors pickled (torch's multiprocessing reductions). Unpickling
what arrives over the network runs the sender's code, so that payload is refused. Ours carries the same facts as
JSON: per tensor its name, dtype and shape, and the fields of torch's CUDA storage handle (`client/weights.py`
`cuda_ipc_tensors` makes them). Before any handle is opened, `checked_handles` checks every field (the types, the
tensor's bytes inside its storage, the reference counter's name) and the route checks the names, shapes and dtype
like every push's manifest (service/backend/weight_check.py); the staging checks each tensor again as it copies.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from service.backend.base import PushError, PushUnsupported
from service.backend.weight_check import DTYPES, dtype_name

PICKLED = ("serialized_named_tensors holds pickled tensors, and the server never unpickles what arrives over the "
           "network: send the CUDA IPC handles as JSON (ipc_tensors, made by client.weights.cuda_ipc_tensors; "
           "client.weights.push_cuda_ipc sends them)")
_COUNTER_NAME = re.compile(rb"/torch_[\w.-]{1,200}")  # torch's shared-memory files for IPC reference counts


class IpcTensor(BaseModel):
    """One tensor in a trainer's GPU memory: `offset` elements into a storage of `storage_bytes` bytes, which
    starts `storage_offset` bytes into the CUDA allocation `handle` names. `ref_counter` and `event` are torch's:
    the count that keeps the trainer from freeing the memory while it is mapped here, and the event its writes
    were recorded on."""

    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str
    shape: list[int]
    offset: int
    device: int
    handle: str  # base64
    storage_bytes: int
    storage_offset: int
    ref_counter: str  # base64
    ref_counter_offset: int
    event: str | None = None  # base64
    event_sync: bool = False


def _decoded(field: str, value: str, name: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise PushError(f"tensor {name!r}: {field} is not base64") from None


@dataclass(frozen=True, slots=True)
class Handle:
    """An `IpcTensor` whose fields were checked: its dtype and the decoded handles."""

    tensor: IpcTensor
    dtype: torch.dtype
    handle: bytes
    counter: bytes
    event: bytes | None


def _checked(t: IpcTensor) -> Handle:
    dtype = DTYPES[dtype_name(t.dtype)]
    if any(n < 0 for n in t.shape):
        raise PushError(f"tensor {t.name!r}: shape {t.shape} has a negative size")
    if t.offset < 0 or t.storage_offset < 0 or t.ref_counter_offset < 0 or t.device < 0:
        raise PushError(f"tensor {t.name!r}: offsets and the device index must not be negative")
    end = (t.offset + math.prod(t.shape)) * dtype.itemsize
    if t.storage_bytes <= 0 or end > t.storage_bytes:
        raise PushError(f"tensor {t.name!r}: its {end - t.offset * dtype.itemsize} bytes at element {t.offset} do "
                        f"not lie inside its storage of {t.storage_bytes} bytes")
    counter = _decoded("ref_counter", t.ref_counter, t.name)
    if not _COUNTER_NAME.fullmatch(counter):
        raise PushError(f"tensor {t.name!r}: ref_counter {counter[:60]!r} is not a torch IPC counter's name")
    event = _decoded("event", t.event, t.name) if t.event else None
    return Handle(t, dtype, _decoded("handle", t.handle, t.name), counter, event)


def checked_handles(items: Sequence[IpcTensor]) -> list[Handle]:
    """Every field of every tensor checked, or PushError on the first that cannot be right (nothing opened)."""
    if not items:
        raise PushError("ipc_tensors is empty: the push holds no tensors")
    seen: set[str] = set()
    for t in items:
        if t.name in seen:
            raise PushError(f"tensor {t.name!r} arrives twice")
        seen.add(t.name)
    return [_checked(t) for t in items]


def open_tensors(handles: Sequence[Handle]) -> dict[str, torch.Tensor]:
    """The named tensors, mapped from the trainer's GPU memory (read only: the push copies them)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise PushUnsupported("this server sees no CUDA device, so it cannot open CUDA IPC handles: push over "
                              "HTTP, gRPC, a memfd or a process group instead")
    count = torch.cuda.device_count()
    out: dict[str, torch.Tensor] = {}
    for h in handles:
        t = h.tensor
        if t.device >= count:
            raise PushError(f"tensor {t.name!r} lives on cuda:{t.device}, but this server sees {count} device(s)")
        stride = tuple(math.prod(t.shape[i + 1:]) for i in range(len(t.shape)))  # contiguous rows
        try:
            out[t.name] = rebuild_cuda_tensor(
                torch.Tensor, tuple(t.shape), stride, t.offset, torch.UntypedStorage, h.dtype, t.device, h.handle,
                t.storage_bytes, t.storage_offset, False, h.counter, t.ref_counter_offset, h.event, t.event_sync)
        except RuntimeError as exc:
            raise PushError(f"tensor {t.name!r}: its CUDA IPC handle cannot be opened here ({exc}); the trainer "
                            "must run on this host, on a GPU this server sees") from None
    return out


def settle(tensors: dict[str, Any]) -> None:
    """Wait for the copies out of the trainer's memory, then let go of it (the trainer may free or change it once
    the server has answered)."""
    for device in {t.device for t in tensors.values()}:
        torch.cuda.synchronize(device)
    tensors.clear()
