"""Python client for specroll (gRPC): sync `SpecrollClient` and asyncio `AsyncSpecrollClient`.

    from client import SpecrollClient
    with SpecrollClient("127.0.0.1:50051", admin_token="...") as c:
        c.wait_until_ready()
        [completion] = c.generate([[1, 2, 3]], n=4, max_tokens=64, temperature=1.0, seed=0)
        c.push_weights(model.state_dict(), version="step-10", mode="wait")
"""

from client.aio import AsyncSpecrollClient
from client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Overloaded,
    PermissionDenied,
    ServerError,
    SpecrollError,
    Unauthenticated,
    Unavailable,
)
from client.sync import SpecrollClient
from client.types import Completion, PushResult, Sample, ServerInfo, TokenChunk, VersionSpan

__all__ = [
    "AsyncSpecrollClient",
    "Completion",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "Overloaded",
    "PermissionDenied",
    "PushResult",
    "Sample",
    "ServerError",
    "ServerInfo",
    "SpecrollClient",
    "SpecrollError",
    "TokenChunk",
    "Unauthenticated",
    "Unavailable",
    "VersionSpan",
]
