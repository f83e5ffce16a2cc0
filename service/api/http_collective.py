"""SGLang's weight-sync endpoints over a process group (admin token): what slime's and AReaL's trainers call.

The payloads are SGLang's; `mode`, `cast` and `timeout_s` are ours and optional. `/weights/check` tells a trainer
what a push would be refused for before it broadcasts anything (our client calls it first).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from service.api.collective import DEFAULT_TIMEOUT_S
from service.api.deps import AdminCtx
from service.api.push_protocol import PushResult
from service.backend.weight_check import Declared

router = APIRouter(tags=["admin"])


class InitGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S  # ours: how long a broadcast may stall before the group is given up


class UpdateDistributedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    flush_cache: bool = True  # every swap drops the prefixes cached under the old weights
    abort_all_requests: bool = False
    load_format: str | None = None
    mode: str | None = None  # ours: wait | abort | keep (abort_all_requests means abort)
    cast: bool = False  # ours: cast to the served dtype


class DestroyGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    group_name: str = "weight_update_group"


class CheckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    role: str = "target"
    cast: bool = False


@router.post("/init_weights_update_group")
async def init_weights_update_group(req: InitGroupRequest, ctx: AdminCtx) -> dict[str, Any]:
    """Join the trainer's process group (it is rank 0 and hosts the TCP store); returns once joined."""
    await ctx.pushes.groups.init(req.master_address, req.master_port, req.rank_offset, req.world_size,
                                 req.group_name, req.backend, req.timeout_s)
    return {"success": True, "message": f"joined weight update group {req.group_name}"}


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(req: UpdateDistributedRequest, ctx: AdminCtx) -> dict[str, Any]:
    """Receive one bucket the trainer broadcasts from rank 0; the bucket that completes the checkpoint swaps it in."""
    version = req.weight_version or "distributed"
    mode = "abort" if req.abort_all_requests else (req.mode or "wait")
    out = await ctx.pushes.groups.update(req.group_name, req.names, req.dtypes, req.shapes, version, mode, req.cast,
                                         req.load_format)
    if isinstance(out, PushResult):
        return {"success": True, "message": f"weights {out.version} serve", **asdict(out)}
    return {"success": True, "message": f"bucket received; {out} tensors to go", "remaining": out}


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(req: DestroyGroupRequest, ctx: AdminCtx) -> dict[str, Any]:
    await ctx.pushes.groups.destroy(req.group_name)
    return {"success": True, "message": f"weight update group {req.group_name} destroyed"}


@router.post("/weights/check")
async def check_weights(req: CheckRequest, ctx: AdminCtx) -> dict[str, Any]:
    """Refuse (400, the reason) what a push of these tensors would be refused for; nothing is sent or changed."""
    if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
        raise ValueError("names, dtypes and shapes must be equally long")
    ctx.pushes.check(req.role, [Declared(n, d, tuple(s)) for n, d, s in zip(req.names, req.dtypes, req.shapes,
                                                                           strict=True)], req.cast)
    return {"ok": True}
