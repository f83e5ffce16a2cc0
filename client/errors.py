"""Typed exceptions for specroll's client, mapped from gRPC status codes."""

from __future__ import annotations

import grpc


class SpecrollError(Exception):
    """Any error the server reported (or a transport failure); `code` is the gRPC status name."""

    code = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(SpecrollError, ValueError):
    """The request was malformed or does not fit the model (bad prompt, bad push, ...)."""

    code = "INVALID_ARGUMENT"


class Unauthenticated(SpecrollError):
    """No token or a wrong token was sent."""

    code = "UNAUTHENTICATED"


class PermissionDenied(SpecrollError):
    """The call is not allowed (admin calls disabled on the server, a path outside the load root)."""

    code = "PERMISSION_DENIED"


class Unavailable(SpecrollError):
    """The server is not reachable or not ready (model still loading, shutting down)."""

    code = "UNAVAILABLE"


class FailedPrecondition(SpecrollError):
    """The server cannot do this in its configuration (e.g. a drafter push without a draft model)."""

    code = "FAILED_PRECONDITION"


class DeadlineExceeded(SpecrollError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class ServerError(SpecrollError):
    """The server failed to run a valid request."""

    code = "INTERNAL"


_BY_CODE: dict[grpc.StatusCode, type[SpecrollError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidArgument,
}


def from_rpc_error(exc: grpc.RpcError) -> SpecrollError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, ServerError)
    return cls(details or str(code), code.name if code is not None else None)
