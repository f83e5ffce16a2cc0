"""Weight and control endpoints (admin token), rewards, server info and weight versions.

Uploads are raw safetensors bodies, never held whole in memory and never unpickled: a full upload streams straight
into the push's buffers once its header has been checked like a manifest (no file); a delta upload (sparse parts
named NAME:indices / NAME:values) goes through a temporary file read with ``safetensors.torch.load_file``.
What the tensors must be is the one weight validation every path runs (service/backend/weight_check.py).
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, ValidationError

import client.checksums as checksums
from service.api.compat import (
    VLLM_PAUSE,
    next_version,
    pause_mode,
    reset_prefix_cache,
    sglang_server_info,
    vllm_config,
)
from service.api.compat import pause as compat_pause
from service.api.context import ServiceContext
from service.api.cuda_ipc import PICKLED, IpcTensor, checked_handles, open_tensors, settle
from service.api.deps import UPLOAD_PATH, AdminCtx, ApiCtx
from service.api.disconnect import unless_disconnected
from service.api.generation import InvalidRequest
from service.api.push_protocol import PushError, PushResult, check_role_version
from service.api.push_service import check_mode_or_error
from service.backend.weight_check import Declared
from service.safetensors_io import CheckpointError, read_header

router = APIRouter(tags=["admin"])


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    version: str
    role: str = "target"
    mode: str = "wait"
    cast: bool = False  # cast the folder's dtype to the served one (never done unasked)


class PauseRequest(BaseModel):
    mode: str | None = None
    clear_cache: bool = False


class AbortRequest(BaseModel):
    request_id: str | None = None
    rid: str | None = None
    all: bool = False


class RewardsRequest(BaseModel):
    rewards: dict[str, float]


class DiskUpdateRequest(BaseModel):
    """SGLang's payload (AReaL sends model_path and abort_all_requests only)."""

    model_config = ConfigDict(extra="ignore")
    model_path: str
    weight_version: str | None = None  # None: the next number after the serving version
    mode: str | None = None
    abort_all_requests: bool = False  # SGLang: abort running requests first (mode abort)
    flush_cache: bool = True
    load_format: str | None = None
    cast: bool = False  # ours: cast the folder's dtype to the served one (never done unasked)


class TensorUpdateRequest(BaseModel):
    """SGLang's colocated push, its tensors as CUDA IPC handles in JSON (service/api/cuda_ipc.py)."""

    model_config = ConfigDict(extra="ignore")
    ipc_tensors: list[IpcTensor] | None = None  # ours: the handles
    serialized_named_tensors: list[Any] | None = None  # SGLang's pickled tensors: refused
    weight_version: str | None = None  # None: the next number after the serving version
    role: str = "target"
    mode: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True
    load_format: str | None = None
    cast: bool = False


def _reply(result: PushResult) -> dict[str, Any]:
    return asdict(result)


def _sglang_push(ctx: ServiceContext, req: DiskUpdateRequest | TensorUpdateRequest) -> tuple[str, str]:
    """The mode and version of an SGLang push: abort_all_requests means abort unless a mode is given; without a
    weight_version, the next number after the serving one."""
    mode = req.mode or ("abort" if req.abort_all_requests else "wait")
    return mode, req.weight_version or next_version(ctx.backend.stats().policy_version)


async def _sglang_reply(ctx: ServiceContext, req: DiskUpdateRequest | TensorUpdateRequest, result: PushResult,
                        **extra: Any) -> dict[str, Any]:
    if req.flush_cache:
        await reset_prefix_cache(ctx)
    return {"success": True, "message": "weights updated", **extra, **_reply(result)}


SPOOL_BYTES = 8 * 2**20  # body bytes gathered in memory before they are hashed and written out


def _load_file(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    try:
        read_header(path)  # the header checked against the body first (safetensors takes a name given twice)
    except CheckpointError as exc:
        raise PushError(f"the body is not a valid safetensors file: {exc}") from exc
    try:
        return load_file(str(path))
    except Exception as exc:  # malformed header or data
        raise PushError(f"the body is not a valid safetensors file: {exc}") from exc


def _body_digest(params: dict[str, str | None]) -> tuple[str, str] | None:
    given = [(kind, value) for kind, value in params.items() if value is not None]
    if len(given) > 1:
        raise PushError(f"give one checksum of the body, not {[k for k, _ in given]}")
    return given[0] if given else None


def _write(f: BinaryIO, digest: Any, data: bytes) -> None:
    digest.update(data)
    f.write(data)


async def _receive_to_file(request: Request, path: Path, kind: str) -> tuple[int, str]:
    """Stream the body to `path` (never held whole in memory); returns its size and digest of `kind`."""
    digest, size, pending = checksums.new(kind), 0, bytearray()
    with path.open("wb") as f:
        async for data in request.stream():
            pending += data
            size += len(data)
            if len(pending) >= SPOOL_BYTES:
                await asyncio.to_thread(_write, f, digest, bytes(pending))
                pending.clear()
        await asyncio.to_thread(_write, f, digest, bytes(pending))
    return size, digest.hexdigest()


@router.post(UPLOAD_PATH, openapi_extra={"requestBody": {"required": True, "description": "a safetensors file",
                                                         "content": {"application/octet-stream": {
                                                             "schema": {"type": "string", "format": "binary"}}}}})
async def upload_weights(request: Request, ctx: AdminCtx, version: Annotated[str, Query()],
                         role: str = "target", mode: str = "wait", dtype: str | None = None,
                         sha256: Annotated[str | None, Query(description="hex sha256 of the body")] = None,
                         xxh3_128: Annotated[str | None, Query(description="hex xxh3_128 of the body")] = None,
                         crc32c: Annotated[str | None, Query(description="hex crc32c of the body")] = None,
                         cast: Annotated[bool, Query(description="cast to the served dtype")] = False,
                         base_version: Annotated[str, Query(description="a delta against this served version")] = "",
                         ) -> dict[str, Any]:
    """Push weights as a safetensors body (Hugging Face tensor names, the complete set for the role). With
    `base_version`, a delta: only the tensors that changed, a sparse one as `NAME:indices` (int32/int64) with
    `NAME:values`; refused (409) unless that version is served. At most one checksum of the whole body
    (xxh3_128 and crc32c run at memory speed, sha256 several times slower: docs/weights.md)."""
    digest = _body_digest({"sha256": sha256, "xxh3_128": xxh3_128, "crc32c": crc32c})
    if not base_version:
        length = request.headers.get("content-length")
        return _reply(await ctx.pushes.push_body(role, version, request.stream(),
                                                 length=int(length) if length else None, mode=mode, dtype=dtype,
                                                 cast=cast, digest=digest,
                                                 guard=lambda work: unless_disconnected(request, work)))
    kind = checksums.kind_of(digest[0]) if digest else checksums.LEGACY
    with tempfile.TemporaryDirectory(prefix="specroll-upload-") as tmp:
        path = Path(tmp) / "upload.safetensors"
        size, got = await _receive_to_file(request, path, kind)
        if not size:
            raise PushError("the body is empty: send the safetensors bytes")
        if digest is not None and got != digest[1].lower():
            raise PushError(f"checksum mismatch: the body hashes to {got} ({kind}), the request says {digest[1]}")
        tensors = await asyncio.to_thread(_load_file, path)
    return _reply(await unless_disconnected(request, ctx.pushes.push_tensors(role, version, tensors, mode, dtype,
                                                                             cast, base_version)))


@router.post("/weights/load")
async def load_weights(req: LoadRequest, ctx: AdminCtx, request: Request) -> dict[str, Any]:
    """Load weights from a safetensors folder the server can read."""
    return _reply(await unless_disconnected(request, ctx.pushes.load_path(req.role, req.version, req.path,
                                                                           req.mode, req.cast)))


@router.post("/update_weights_from_disk")
async def update_from_disk(req: DiskUpdateRequest, ctx: AdminCtx, request: Request) -> dict[str, Any]:
    """SGLang's update from a folder the server can read: /weights/load for the target. abort_all_requests
    aborts running requests first (mode abort); without it they finish first (wait) unless a mode is given."""
    if req.load_format not in (None, "auto", "safetensors"):
        raise InvalidRequest(f"load_format={req.load_format!r} is not supported: safetensors folders only")
    mode, version = _sglang_push(ctx, req)
    result = await unless_disconnected(request, ctx.pushes.load_path("target", version, req.model_path, mode,
                                                                      req.cast))
    return await _sglang_reply(ctx, req, result, num_paused_requests=0)


@router.post("/update_weights_from_tensor")
async def update_from_tensor(req: TensorUpdateRequest, ctx: AdminCtx, request: Request) -> dict[str, Any]:
    """A push from a trainer's GPU memory on this host: each tensor is copied from the trainer's memory into the
    spare, and the answer comes once the copies are done (the trainer may then free or change its tensors)."""
    if req.serialized_named_tensors is not None:
        raise InvalidRequest(PICKLED)
    if req.ipc_tensors is None:
        raise InvalidRequest("ipc_tensors is required: the tensors' CUDA IPC handles (client.weights.push_cuda_ipc)")
    if req.load_format not in (None, "auto", "direct"):
        raise InvalidRequest(f"load_format={req.load_format!r} is not supported: the tensors are loaded as sent")
    mode, version = _sglang_push(ctx, req)
    check_role_version(req.role, version)
    check_mode_or_error(mode, req.role)
    handles = checked_handles(req.ipc_tensors)  # all refused before the trainer's memory is mapped
    ctx.pushes.check(req.role, [Declared(t.name, t.dtype, tuple(t.shape)) for t in req.ipc_tensors], req.cast)
    tensors = await asyncio.to_thread(open_tensors, handles)
    try:
        result = await unless_disconnected(request, ctx.pushes.push_tensors(req.role, version, tensors, mode,
                                                                             cast=req.cast))
    finally:
        await asyncio.to_thread(settle, tensors)
    return await _sglang_reply(ctx, req, result)


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
async def pause(ctx: AdminCtx, request: Request, mode: Annotated[str | None, Query()] = None,
                clear_cache: Annotated[bool | None, Query()] = None) -> dict[str, Any]:
    """Pause generation: abort (end running requests), wait (let them finish; returns once idle), keep (they
    stay, and go on where they were on resume). The mode comes in a JSON body or, as vLLM's /pause takes it, the
    query (`?mode=keep&clear_cache=false`, no body). clear_cache then drops cached KV (not with keep).
    A wait whose client disconnects first is withdrawn: the server is not left paused."""
    body = await request.body()
    try:
        req = PauseRequest.model_validate_json(body) if body.strip() else PauseRequest()
    except ValidationError as exc:
        raise InvalidRequest(f"invalid pause body: {exc.errors()[0].get('msg', 'invalid')}") from exc
    if mode is not None and req.mode is not None and mode != req.mode:
        raise InvalidRequest(f"mode is {mode!r} in the query and {req.mode!r} in the body: give one")
    backend_mode = pause_mode(mode or req.mode, VLLM_PAUSE, "wait")
    clear = bool(req.clear_cache if clear_cache is None else clear_cache)
    aborted = await unless_disconnected(request, compat_pause(ctx, backend_mode, clear))
    return {"paused": True, "status": "paused", "aborted": aborted}


@router.post("/resume")
async def resume(ctx: AdminCtx) -> dict[str, Any]:
    await ctx.resume()
    return {"paused": False, "status": "resumed"}


@router.post("/abort")
async def abort(req: AbortRequest, ctx: AdminCtx) -> dict[str, Any]:
    return {"aborted": await ctx.abort(req.request_id or req.rid, req.all)}


@router.post("/rewards")
async def rewards(req: RewardsRequest, ctx: AdminCtx) -> dict[str, int]:
    return {"accepted": ctx.report_rewards(req.rewards)}


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(ctx: ApiCtx, request: Request, config_format: Literal["text", "json"] | None = None,
                      ) -> dict[str, Any]:
    """specroll's state, with the fields SGLang's /get_server_info has that slime reads and, for vLLM clients
    (TRL reads `config_format=json`), a `vllm_config` with the fields they read. `speculative_sampling` (HTTP
    only: the gRPC message has no such field) says whether sampled requests are served under speculation."""
    info = {**sglang_server_info(ctx), **ctx.info(admin=ctx.auth.is_admin(request.headers.get("authorization"))),
            "control_auth": ctx.auth.control_auth,  # none: control calls need no token (a trusted network)
            "speculative_sampling": ctx.model().speculative_sampling}
    config = vllm_config(ctx)
    info["vllm_config"] = str(config) if config_format == "text" else config
    return info
