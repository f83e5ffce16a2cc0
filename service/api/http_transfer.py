"""vLLM's weight-transfer endpoints over a process group (admin token), as TRL and vLLM's trainer engine call them.

`/init_weight_transfer_engine {init_info}` joins the trainer's group, `/start_weight_update` opens a push,
each `/update_weights {update_info: {names, dtype_names, shapes}}` announces a bucket the trainer then
broadcasts (packed when init_info says so), `/finish_weight_update {weight_version}` swaps the checkpoint in,
`/shutdown_weight_transfer_engine` leaves the group. The payloads are vLLM's; `backend`, `timeout_s` and
`group_name` in init_info and `mode` / `cast` on start are ours and optional. Bodies vLLM lets a client leave
out (start, finish) may be empty.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from service.api.collective import (
    DEFAULT_PACKED_BYTES,
    DEFAULT_TIMEOUT_S,
    TRANSFER_GROUP,
    TransferInit,
    default_backend,
)
from service.api.deps import AdminCtx
from service.api.generation import InvalidRequest

router = APIRouter(tags=["admin"])


class InitInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    master_address: str | None = None
    master_port: StrictInt | None = None
    rank_offset: StrictInt
    world_size: StrictInt
    nccl_unique_id_b64: str | None = None
    packed: StrictBool = False
    packed_buffer_size_bytes: StrictInt = DEFAULT_PACKED_BYTES
    packed_num_buffers: StrictInt = 2
    backend: str | None = None  # ours: gloo | nccl (default: nccl where the server has CUDA)
    timeout_s: float = DEFAULT_TIMEOUT_S  # ours: how long a broadcast or the next call may stall
    group_name: str | None = None  # ours: the store prefix (default "weight-transfer")


class InitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: InitInfo


class UpdateInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[StrictInt]]
    packed: StrictBool | None = None  # vLLM before 0.28 (and TRL with it) sent packed per update


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    update_info: UpdateInfo | list[Any]


class StartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    is_checkpoint_format: StrictBool = True
    mode: str = "wait"  # ours: wait | abort | keep, as on every push
    cast: StrictBool = False  # ours: cast to the served dtype


class FinishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight_version: str | None = None


async def optional_body(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    return model.model_validate_json(body) if body.strip() else model()


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(req: InitRequest, ctx: AdminCtx) -> dict[str, Any]:
    """Join the trainer's process group (it is rank 0 and hosts the TCP store); returns once joined."""
    info = req.init_info
    if info.nccl_unique_id_b64:
        raise InvalidRequest("init_info.nccl_unique_id_b64 is not supported: give master_address and master_port "
                             "(the trainer hosts a torch.distributed TCP store there)")
    if info.master_address is None or info.master_port is None:
        raise InvalidRequest("init_info needs master_address and master_port")
    await ctx.pushes.groups.transfer_init(TransferInit(
        info.master_address, info.master_port, info.rank_offset, info.world_size, info.packed,
        info.packed_buffer_size_bytes, info.packed_num_buffers, info.backend or default_backend(), info.timeout_s,
        info.group_name or TRANSFER_GROUP))
    return {"message": "Weight transfer initialized"}


@router.post("/start_weight_update")
async def start_weight_update(request: Request, ctx: AdminCtx) -> dict[str, Any]:
    req = await optional_body(request, StartRequest)
    if not req.is_checkpoint_format:
        raise InvalidRequest("is_checkpoint_format=false is not supported: send Hugging Face checkpoint tensors")
    await ctx.pushes.groups.transfer_start(req.mode, req.cast)
    return {"message": "Weight update started"}


@router.post("/update_weights")
async def update_weights(req: UpdateRequest, ctx: AdminCtx) -> dict[str, Any]:
    """One bucket: checked against the served model before a byte is read, then received."""
    info = req.update_info
    if not isinstance(info, UpdateInfo):
        raise InvalidRequest("update_info must be one object {names, dtype_names, shapes}: a list (one entry per "
                             "worker) is not supported")
    left = await ctx.pushes.groups.transfer_update(info.names, info.dtype_names, info.shapes, info.packed)
    return {"message": "Weights updated", "remaining": left}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request, ctx: AdminCtx) -> dict[str, Any]:
    """Swap the received checkpoint in (all-or-nothing, in the push's mode)."""
    req = await optional_body(request, FinishRequest)
    out = await ctx.pushes.groups.transfer_finish(req.weight_version)
    return {"message": "Weight update finished", **asdict(out)}


@router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(ctx: AdminCtx) -> dict[str, Any]:
    await ctx.pushes.groups.transfer_shutdown()
    return {"message": "Weight transfer shut down"}
