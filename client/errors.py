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


class Overloaded(Unavailable):
    """The server's queue is full (RESOURCE_EXHAUSTED); it asks to retry after `retry_after_s` seconds. The
    client retries it like UNAVAILABLE, waiting at least that long."""

    code = "RESOURCE_EXHAUSTED"
    retry_after_s: float = 1.0


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
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidArgument,  # a message over the size limit; Overloaded below
}


def from_rpc_error(exc: grpc.RpcError) -> SpecrollError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, ServerError)
    retry_after = _retry_after(exc) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    if retry_after is not None:
        err = Overloaded(details or str(code), code.name)
        err.retry_after_s = retry_after
        return err
    return cls(details or str(code), code.name if code is not None else None)


def _retry_after(exc: grpc.RpcError) -> float | None:
    """The server's retry-after trailer (seconds), sent with RESOURCE_EXHAUSTED when it is overloaded."""
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == "retry-after":
            try:
                return float(value)
            except ValueError:
                return None
    return None
