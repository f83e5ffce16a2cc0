"""One process, one engine, two APIs: wiring of the engine loop, gRPC and HTTP servers, and their lifecycle.

`run_server` is what ``specroll serve`` runs (until SIGINT/SIGTERM); `BackgroundServer` runs the same thing
on a thread with its own event loop (tests, benchmarks, notebooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import uvicorn

from service.api.auth import Auth
from service.api.context import ServiceContext
from service.api.generation import Limits
from service.api.grpc_server import build_grpc_server, set_health
from service.api.http_server import create_app
from service.api.push_service import WeightManager
from service.backend.admission import Admission, AdmissionCollector, AdmissionLimits
from service.backend.hooks import Hooks
from service.backend.metrics import Metrics
from service.buffer import BufferConfig, attach_buffer
from service.config import EngineConfig
from service.engine.loop import EngineLoop

if TYPE_CHECKING:
    from service.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    admin_token: str | None = None
    api_token: str | None = None
    redis_url: str | None = None
    served_model_name: str | None = None
    load_root: str | None = None
    limits: Limits = field(default_factory=Limits)
    shutdown_grace_s: float = 5.0
    buffer: BufferConfig | None = None  # rollout buffer; None: Redis at redis_url, else in memory
    reuse_weight_buffers: bool = True  # keep replaced weights as the buffer for the next push
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)  # the bounded queue of work


class _Uvicorn(uvicorn.Server):
    """Uvicorn without its own signal handling: the process-level handler stops both servers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class SpecrollServer:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig | None = None,
                 engine_factory: Callable[[], LLMEngine] | None = None) -> None:
        self.config = config = config or ServerConfig()
        self.engine_config = engine_config

        def default_factory() -> LLMEngine:
            from service.engine.llm_engine import LLMEngine

            return LLMEngine(engine_config)

        self.hooks = Hooks()
        self.metrics = Metrics()
        self.loop = EngineLoop(engine_factory or default_factory, self.metrics, self.hooks,
                               Admission(config.admission))
        self.metrics.registry.register(AdmissionCollector(self.loop.admission))
        self.metrics.ready_fn = lambda: self.loop.ready.is_set() and self.loop.alive
        weights = WeightManager(self.loop, self.metrics, config.limits.max_upload_bytes, config.load_root,
                                config.reuse_weight_buffers)
        self.ctx = ServiceContext(self.loop, weights, self.metrics, self.hooks,
                                  Auth(config.admin_token, config.api_token), config.limits,
                                  config.served_model_name or "")
        self.grpc_port = config.grpc_port
        self.http_port = config.http_port
        self._stop: asyncio.Event | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.started = threading.Event()
        self.buffer = attach_buffer(self)

    async def serve(self) -> None:
        """Start everything, serve until `stop()` is called, then shut down gracefully."""
        self._aloop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        cfg = self.config
        self.loop.start()
        grpc_server, health, self.grpc_port = build_grpc_server(self.ctx, f"{cfg.host}:{cfg.grpc_port}")
        await set_health(health, False)
        await grpc_server.start()
        http = _Uvicorn(uvicorn.Config(create_app(self.ctx), host=cfg.host, port=cfg.http_port, log_level="warning",
                                       access_log=False, lifespan="off", timeout_graceful_shutdown=2))
        http_task = asyncio.create_task(http.serve())
        while not http.started and not http_task.done():
            await asyncio.sleep(0.01)
        if http_task.done():
            await grpc_server.stop(0)
            self.loop.stop()
            http_task.result()
            raise OSError(f"HTTP server could not start on {cfg.host}:{cfg.http_port}")
        self.http_port = http.servers[0].sockets[0].getsockname()[1] if http.servers else cfg.http_port
        logger.info("serving HTTP on %s:%d and gRPC on %s:%d", cfg.host, self.http_port, cfg.host, self.grpc_port)
        self.started.set()
        ready_task = asyncio.create_task(self._mark_ready(health))
        try:
            await self._stop.wait()
        finally:
            logger.info("shutting down")
            ready_task.cancel()
            await set_health(health, False)
            http.should_exit = True
            stopping = grpc_server.stop(cfg.shutdown_grace_s)
            await asyncio.to_thread(self.buffer.stop_trainer)  # before the engine: its last push has a server
            await asyncio.to_thread(self.loop.stop)
            await asyncio.to_thread(self.buffer.close)
            await stopping
            await http_task

    async def _mark_ready(self, health: Any) -> None:
        await asyncio.to_thread(self.loop.loaded_or_failed.wait)
        if self.loop.error is None:
            await set_health(health, True)
            logger.info("model loaded; ready")

    def stop(self) -> None:
        """Thread-safe: ask `serve` to shut down."""
        if self._aloop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._aloop.call_soon_threadsafe(self._stop.set)


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Serve until SIGINT or SIGTERM; returns the process exit code."""
    server = SpecrollServer(engine_config, config)

    async def main() -> None:
        aloop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            aloop.add_signal_handler(sig, server.stop)
        await server.serve()

    asyncio.run(main())
    if server.loop.error is not None:
        logger.error("the model failed to load: %s", server.loop.error)
        return 1
    return 0


class BackgroundServer:
    """Run a SpecrollServer on a daemon thread; use as a context manager."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig | None = None,
                 engine_factory: Callable[[], LLMEngine] | None = None) -> None:
        self.server = SpecrollServer(engine_config, config, engine_factory)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specroll-server", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as exc:
            self._error = exc
            self.server.started.set()

    def start(self, timeout: float = 120.0, wait_ready: bool = True) -> BackgroundServer:
        self._thread.start()
        if not self.server.started.wait(timeout) or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error}")
        if wait_ready:
            self.server.loop.loaded_or_failed.wait(timeout)
            if self.server.loop.error is not None:
                raise RuntimeError(f"model failed to load: {self.server.loop.error}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.stop()
        self._thread.join(timeout)

    @property
    def http_url(self) -> str:
        return f"http://{self.server.config.host}:{self.server.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.server.config.host}:{self.server.grpc_port}"

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
