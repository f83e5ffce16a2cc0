"""One table from exceptions to what both APIs answer: an HTTP status and error type, a gRPC status code."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from service.api.auth import AuthError
from service.api.disconnect import ClientGone
from service.api.generation import InvalidRequest, ServiceError
from service.backend.admission import Overloaded
from service.backend.base import NotReady, PushError, PushTooLarge, PushUnsupported

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Status:
    http: int
    kind: str  # the error "type" in HTTP bodies (OpenAI style)
    grpc: grpc.StatusCode


# First match wins: subclasses before their bases (PushError and InvalidRequest are ValueErrors).
TABLE: tuple[tuple[type[BaseException], Status], ...] = (
    (InvalidRequest, Status(400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)),
    (PushTooLarge, Status(413, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)),
    (PushError, Status(400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)),
    (ValueError, Status(400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)),
    (PermissionError, Status(403, "permission_error", grpc.StatusCode.PERMISSION_DENIED)),
    (PushUnsupported, Status(409, "unsupported", grpc.StatusCode.FAILED_PRECONDITION)),
    (NotReady, Status(503, "unavailable", grpc.StatusCode.UNAVAILABLE)),
    (Overloaded, Status(503, "overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED)),
    (ClientGone, Status(499, "client_closed_request", grpc.StatusCode.CANCELLED)),
)
INTERNAL = Status(500, "internal_error", grpc.StatusCode.INTERNAL)
HANDLED: tuple[type[BaseException], ...] = (AuthError, ServiceError, *(cls for cls, _ in TABLE))


def status_of(exc: BaseException) -> Status:
    if isinstance(exc, AuthError):
        if exc.denied:
            return Status(403, "permission_error", grpc.StatusCode.PERMISSION_DENIED)
        return Status(401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED)
    for cls, status in TABLE:
        if isinstance(exc, cls):
            return status
    logger.error("request failed: %r", exc)
    return INTERNAL


def message_of(exc: BaseException, status: Status) -> str:
    return f"internal error: {exc}" if status is INTERNAL else str(exc)


def retry_after(exc: BaseException) -> int | None:
    """Seconds after which an overloaded server may take the request (HTTP Retry-After, gRPC trailer)."""
    return exc.retry_after_s if isinstance(exc, Overloaded) else None
