"""Server-sent events for the HTTP APIs: the updates of the N generations of one request, merged into one
stream in arrival order. Errors found before the first token become HTTP errors (the first update of each
generation is awaited before the response starts); later errors end the stream with an error event. Closing
the stream (client gone) aborts the requests still running."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

from service.api.generation import Generation, Update, start_all

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _close(tasks: list[asyncio.Task[None]], iters: list[AsyncIterator[Update]]) -> None:
    """Stop the pumps and close the update streams (which aborts requests still running)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for it in iters:
        with contextlib.suppress(RuntimeError):
            await it.aclose()  # type: ignore[attr-defined]


async def stream_updates(gens: Sequence[Generation], render: Callable[[int, Update], bytes],
                         tail: Callable[[], list[bytes]] = list) -> StreamingResponse:
    """Start `gens` (all admitted or none), then stream `render(j, update)` for each update of generation j,
    then `tail()` and [DONE]."""
    start_all(gens)
    iters = [g.updates() for g in gens]
    try:
        firsts = [await anext(it) for it in iters]
    except BaseException:
        await _close([], iters)
        raise

    async def events() -> AsyncIterator[bytes]:
        queue: asyncio.Queue[tuple[int, Update | BaseException] | None] = asyncio.Queue()

        async def pump(j: int) -> None:
            try:
                async for upd in iters[j]:
                    await queue.put((j, upd))
            except Exception as exc:  # handed to the response
                await queue.put((j, exc))
            await queue.put(None)

        for j, first in enumerate(firsts):
            queue.put_nowait((j, first))
        tasks = [asyncio.create_task(pump(j)) for j in range(len(gens))]
        pending = len(gens)
        try:
            while pending:
                item = await queue.get()
                if item is None:
                    pending -= 1
                    continue
                j, upd = item
                if isinstance(upd, BaseException):
                    yield sse({"error": {"message": str(upd), "type": "internal_error"}})
                    break
                yield render(j, upd)
            else:
                for chunk in tail():
                    yield chunk
            yield DONE
        finally:
            await _close(tasks, iters)

    return StreamingResponse(events(), media_type="text/event-stream")
