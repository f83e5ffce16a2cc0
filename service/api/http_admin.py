"""Weight and control endpoints (admin token), rewards, server info and weight versions.

Uploads are raw safetensors bodies, streamed to a temporary file and read with ``safetensors.torch.load_file``
(the body is never held whole in memory); nothing is ever unpickled.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict

from service.api.deps import UPLOAD_PATH, AdminCtx, ApiCtx
from service.api.disconnect import unless_disconnected
from service.api.push_protocol import PushError, PushResult

router = APIRouter(tags=["admin"])


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    version: str
    role: str = "target"
    mode: str = "wait"


class PauseRequest(BaseModel):
    mode: str = "wait"


class AbortRequest(BaseModel):
    request_id: str | None = None
    rid: str | None = None
    all: bool = False


class RewardsRequest(BaseModel):
    rewards: dict[str, float]


class DiskUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_path: str
    weight_version: str
    mode: str = "wait"


def _reply(result: PushResult) -> dict[str, Any]:
    return asdict(result)


SPOOL_BYTES = 8 * 2**20  # body bytes gathered in memory before they are hashed and written out


def _load_file(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # malformed header or data
        raise PushError(f"the body is not a valid safetensors file: {exc}") from exc


def _write(f: BinaryIO, digest: Any, data: bytes) -> None:
    digest.update(data)
    f.write(data)


async def _receive_to_file(request: Request, path: Path) -> tuple[int, str]:
    """Stream the body to `path` (never held whole in memory); returns its size and sha256."""
    digest, size, pending = hashlib.sha256(), 0, bytearray()
    with path.open("wb") as f:
        async for data in request.stream():
            pending += data
            size += len(data)
            if len(pending) >= SPOOL_BYTES:
                await asyncio.to_thread(_write, f, digest, bytes(pending))
                pending.clear()
        await asyncio.to_thread(_write, f, digest, bytes(pending))
    return size, digest.hexdigest()


def _check_upload(tensors: dict[str, Any]) -> None:
    """What a well-formed upload is beyond its safetensors framing (which `load` checks: the header must cover
    the body exactly): one dtype for every tensor (never silently cast) and finite values only."""
    import torch

    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    if len(dtypes) > 1:
        raise PushError(f"the upload mixes dtypes {dtypes}: send every tensor in one dtype")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise PushError(f"tensor {name!r} holds NaN or infinite values: the body is corrupt or the weights "
                            "diverged")


@router.post(UPLOAD_PATH, openapi_extra={"requestBody": {"required": True, "description": "a safetensors file",
                                                         "content": {"application/octet-stream": {
                                                             "schema": {"type": "string", "format": "binary"}}}}})
async def upload_weights(request: Request, ctx: AdminCtx, version: Annotated[str, Query()],
                         role: str = "target", mode: str = "wait", dtype: str | None = None,
                         sha256: Annotated[str | None, Query(description="hex sha256 of the body")] = None,
                         ) -> dict[str, Any]:
    """Push weights as a safetensors body (Hugging Face tensor names, the complete set for the role)."""
    with tempfile.TemporaryDirectory(prefix="specroll-upload-") as tmp:
        path = Path(tmp) / "upload.safetensors"
        size, digest = await _receive_to_file(request, path)
        if not size:
            raise PushError("the body is empty: send the safetensors bytes")
        if sha256 is not None and digest != sha256.lower():
            raise PushError(f"checksum mismatch: the body hashes to {digest}, the request says {sha256}")
        tensors = await asyncio.to_thread(_load_file, path)
    await asyncio.to_thread(_check_upload, tensors)
    return _reply(await unless_disconnected(request, ctx.pushes.push_tensors(role, version, tensors, mode, dtype)))


@router.post("/weights/load")
async def load_weights(req: LoadRequest, ctx: AdminCtx, request: Request) -> dict[str, Any]:
    """Load weights from a safetensors folder the server can read."""
    return _reply(await unless_disconnected(request, ctx.pushes.load_path(req.role, req.version, req.path,
                                                                           req.mode)))


@router.post("/update_weights_from_disk")
async def update_from_disk(req: DiskUpdateRequest, ctx: AdminCtx, request: Request) -> dict[str, Any]:
    """SGLang-style alias of /weights/load for the target."""
    result = await unless_disconnected(
        request, ctx.pushes.load_path("target", req.weight_version, req.model_path, req.mode))
    return {"success": True, "message": "weights updated", **_reply(result)}


@router.get("/weights/version")
async def weight_version(ctx: ApiCtx) -> dict[str, str]:
    ctx.model()
    stats = ctx.backend.stats()
    return {"policy_version": stats.policy_version, "drafter_version": stats.drafter_version}


@router.get("/get_weight_version")
async def get_weight_version(ctx: ApiCtx) -> dict[str, str]:
    ctx.model()
    return {"weight_version": ctx.backend.stats().policy_version}


@router.post("/pause")
async def pause(req: PauseRequest, ctx: AdminCtx, request: Request) -> dict[str, Any]:
    """Pause generation: abort (end running requests), wait (let them finish; returns once idle), keep.
    A wait whose client disconnects first is withdrawn: the server is not left paused."""
    aborted = await unless_disconnected(request, ctx.pause(req.mode))
    return {"paused": True, "aborted": aborted}


@router.post("/resume")
async def resume(ctx: AdminCtx) -> dict[str, Any]:
    await ctx.resume()
    return {"paused": False}


@router.post("/abort")
async def abort(req: AbortRequest, ctx: AdminCtx) -> dict[str, Any]:
    return {"aborted": await ctx.abort(req.request_id or req.rid, req.all)}


@router.post("/rewards")
async def rewards(req: RewardsRequest, ctx: AdminCtx) -> dict[str, int]:
    return {"accepted": ctx.report_rewards(req.rewards)}


@router.get("/server_info")
async def server_info(ctx: ApiCtx, request: Request) -> dict[str, Any]:
    # speculative_sampling: HTTP only (the gRPC message has no such field; sampled requests are refused with it)
    return ctx.info(admin=ctx.auth.is_admin(request.headers.get("authorization"))) | {
        "speculative_sampling": ctx.model().speculative_sampling}
