"""HTTP calls that wait stop when their client disconnects: admin calls (a push or pause in mode wait) and
non-streaming generation (streams notice a disconnect when they write).

The work runs as a task; a watcher reads the connection's ASGI messages and cancels the task on
``http.disconnect``. Cancelling a waiting push or pause withdraws it (see EngineLoop): nothing is applied for
a client that left, the staged weights are freed and the admission hold is released. Cancelling a generation
aborts its engine requests, so no work runs for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its call finished; the call was cancelled."""


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (then raises ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done() and not watcher.done():  # we were cancelled ourselves
            task.cancel()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    if task.done() and not task.cancelled() and task.exception() is None:
        return task.result()  # it completed while being cancelled
    logger.warning("%s %s: the client disconnected; the call was cancelled", request.method, request.url.path)
    raise ClientGone(f"{request.method} {request.url.path}: the client disconnected")
