"""FastAPI dependencies every HTTP router shares: the service context, checked for the caller's token."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.api.context import ServiceContext

UPLOAD_PATH = "/weights/upload"


def ctx_of(request: Request) -> ServiceContext:
    return request.app.state.ctx  # type: ignore[no-any-return]


def require_admin(request: Request) -> ServiceContext:
    ctx = ctx_of(request)
    ctx.auth.check_admin(request.headers.get("authorization"))
    return ctx


def require_api(request: Request) -> ServiceContext:
    ctx = ctx_of(request)
    ctx.auth.check_api(request.headers.get("authorization"))
    return ctx


AdminCtx = Annotated[ServiceContext, Depends(require_admin)]
ApiCtx = Annotated[ServiceContext, Depends(require_api)]
