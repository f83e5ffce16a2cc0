"""Blocking client: the asyncio client driven by a private event loop on a background thread."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from client import weights as wt
from client.aio import AsyncSpecrollClient, Prompt
from client.types import Completion, PushResult, Sample, ServerInfo, TokenChunk

T = TypeVar("T")
_END = object()


class SpecrollClient:
    """Same methods as AsyncSpecrollClient, blocking. Safe to call from several threads."""

    def __init__(self, target: str = "127.0.0.1:50051", **kw: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="specroll-client", daemon=True)
        self._thread.start()

        async def make() -> AsyncSpecrollClient:
            return AsyncSpecrollClient(target, **kw)

        self._client = self._run(make())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> SpecrollClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_until_ready(self, timeout_s: float = 120.0) -> ServerInfo:
        return self._run(self._client.wait_until_ready(timeout_s))

    def server_info(self) -> ServerInfo:
        return self._run(self._client.server_info())

    def generate(self, prompts: Sequence[Prompt], *, n: int = 1, **kw: Any) -> list[Completion]:
        return self._run(self._client.generate(prompts, n=n, **kw))

    def generate_one(self, prompt: Prompt, *, n: int = 1, **kw: Any) -> Completion:
        return self._run(self._client.generate_one(prompt, n=n, **kw))

    def stream(self, prompt: Prompt, *, n: int = 1, **kw: Any) -> Iterator[TokenChunk | Sample]:
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()

        async def pump() -> None:
            try:
                async for ev in self._client.stream(prompt, n=n, **kw):
                    q.put(ev)
            except BaseException as exc:  # handed to the consumer
                q.put(exc)
            q.put(_END)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := q.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()

    def push_weights(self, weights: Mapping[str, Any] | str | Path, version: str, **kw: Any) -> PushResult:
        if isinstance(weights, Mapping):
            # Cast here, on the caller's thread. On the client's loop thread, which lives on, a casting copy would
            # give that thread an OpenMP team of its own; with more OpenMP threads than cores, GNU OpenMP stops idle
            # members spinning, and every small parallel op of the caller's (a CPU trainer's) waits for its team to
            # wake (the same effect on the server: service/cpu_threads.py).
            weights = wt.on_cpu(weights, kw.pop("dtype", None))
        return self._run(self._client.push_weights(weights, version, **kw))

    def push_delta(self, weights: Mapping[str, Any], version: str, **kw: Any) -> PushResult:
        weights = wt.on_cpu(weights, kw.pop("dtype", None))  # on the caller's thread (see push_weights)
        return self._run(self._client.push_delta(weights, version, **kw))

    def push_weights_shm(self, weights: Mapping[str, Any], version: str, **kw: Any) -> PushResult:
        """A same-host push through shared memory (see `AsyncSpecrollClient.push_weights_shm`)."""
        weights = wt.on_cpu(weights, kw.pop("dtype", None))  # on the caller's thread (see push_weights)
        return self._run(self._client.push_weights_shm(weights, version, **kw))

    def push_weights_memfd(self, weights: Mapping[str, Any], version: str, **kw: Any) -> PushResult:
        """A same-host push through a sealed memfd (see `AsyncSpecrollClient.push_weights_memfd`)."""
        weights = wt.on_cpu(weights, kw.pop("dtype", None))  # on the caller's thread (see push_weights)
        return self._run(self._client.push_weights_memfd(weights, version, **kw))

    def load_weights(self, path: str, version: str, **kw: Any) -> PushResult:
        return self._run(self._client.load_weights(path, version, **kw))

    def pause(self, mode: str = "wait") -> list[str]:
        return self._run(self._client.pause(mode))

    def resume(self) -> None:
        self._run(self._client.resume())

    def abort(self, request_id: str | None = None, *, all: bool = False) -> list[str]:
        return self._run(self._client.abort(request_id, all=all))

    def report_rewards(self, rewards: Mapping[str, float]) -> int:
        return self._run(self._client.report_rewards(rewards))
