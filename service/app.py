"""The composition root: one backend, two APIs, the rollout buffer and the in-process drafter trainer, wired
together, and their lifecycle.

`run_server` is what ``specroll serve`` runs (until SIGINT/SIGTERM); `BackgroundServer` runs the same thing
on a thread with its own event loop (tests, benchmarks, notebooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from service.api.auth import Auth
from service.api.context import ServiceContext
from service.api.generation import Limits
from service.api.grpc_server import build_grpc_server, set_health
from service.api.http_server import create_app, header_deadline
from service.api.push_service import PushService
from service.backend.admission import Admission, AdmissionCollector, AdmissionLimits
from service.backend.base import NotReady, RolloutBackend, StatsSnapshot
from service.backend.hooks import Hooks
from service.backend.metrics import Metrics
from service.buffer import BufferConfig, MemoryBuffer, RedisBuffer, attach_buffer
from service.config import EngineConfig

logger = logging.getLogger(__name__)

BACKENDS = ("native", "vllm")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    admin_token: str | None = None
    api_token: str | None = None
    redis_url: str | None = None
    served_model_name: str | None = None
    load_root: str | tuple[str, ...] | None = None  # the folders weights may be loaded from (None: anywhere)
    limits: Limits = field(default_factory=Limits)
    shutdown_grace_s: float = 5.0
    buffer: BufferConfig | None = None  # rollout buffer; None: Redis at redis_url, else in memory
    backend: str = "native"  # native | vllm
    vllm: Any = None  # service.vllm.config.VllmConfig for --backend vllm (None: defaults)
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)  # the bounded queue of work
    control_auth: str = "token"  # token: control calls need the admin token; none: open (trusted networks only)


class _Uvicorn(uvicorn.Server):
    """Uvicorn without its own signal handling: the process-level handler stops both servers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_backend(engine_config: EngineConfig, config: ServerConfig, metrics: Metrics, hooks: Hooks,
                  admission: Admission) -> RolloutBackend:
    """The backend `config.backend` names, on the model `engine_config.model` (already resolved)."""
    if config.backend == "vllm":
        from service.vllm.backend import VllmBackend

        return VllmBackend(engine_config, config.vllm, metrics, hooks, admission)
    from service.engine.native import NativeBackend

    return NativeBackend(engine_config, metrics, hooks, admission)


class SpecrollServer:
    """The composition root: one backend, the gRPC and HTTP servers on it, the rollout buffer on its finished
    rollouts and, without Redis, the in-process drafter trainer."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig | None = None) -> None:
        self.config = config = config or ServerConfig()
        if config.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {config.backend!r}")
        self.engine_config = engine_config
        self.hooks = Hooks()
        self.metrics = Metrics()
        admission = Admission(config.admission)
        self.backend = build_backend(engine_config, config, self.metrics, self.hooks, admission)
        self.metrics.registry.register(AdmissionCollector(admission))
        self.metrics.ready_fn = lambda: self.backend.ready
        self.metrics.stats_fn = self._stats
        pushes = PushService(self.backend, self.metrics, config.limits.max_upload_bytes, config.load_root)
        self.ctx = ServiceContext(self.backend, pushes, self.metrics, Auth(config.admin_token, config.api_token,
                                                                          config.control_auth),
                                  config.limits, config.served_model_name or "")
        if self.ctx.auth.control_open:
            logger.warning("control calls (pause, resume, abort, weight loads) need no token (--control-auth none): "
                           "anyone who reaches this server can change its weights; limit who reaches it (a "
                           "NetworkPolicy, a private network)")
        self.grpc_port = config.grpc_port
        self.http_port = config.http_port
        self._stop: asyncio.Event | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.started = threading.Event()
        self.buffer = attach_buffer(self._buffer_config(), self.hooks, self.metrics.registry)
        if isinstance(self.buffer, RedisBuffer):
            self.ctx.degraded_fn = self.buffer.degraded
        self.trainer = self._start_trainer()

    def _stats(self) -> StatsSnapshot | None:
        try:
            return self.backend.stats()
        except NotReady:
            return None

    def _buffer_config(self) -> BufferConfig:
        sc = self.config
        cfg: BufferConfig = sc.buffer or BufferConfig(redis_url=sc.redis_url, embedded_trainer=False)
        if cfg.redis_url is None and sc.redis_url:
            cfg.redis_url = sc.redis_url
        return cfg

    def _start_trainer(self) -> Any:
        """The in-process drafter trainer: without Redis, reading the memory buffer (it stays off on a backend
        that lends it no drafter copy and teacher)."""
        cfg = self._buffer_config()
        if not isinstance(self.buffer, MemoryBuffer) or not cfg.embedded_trainer:
            return None
        from drafter_trainer.config import TrainerConfig
        from drafter_trainer.embedded import EmbeddedTrainer

        trainer_cfg = cfg.trainer
        if trainer_cfg is None:
            gate = cfg.trainer_gate
            if gate == "auto":
                gate = "idle" if str(self.engine_config.device).startswith("cpu") else "tail"
            trainer_cfg = TrainerConfig(consumer="in-process", gate=gate)
        trainer = EmbeddedTrainer(self.backend, self.buffer, self.metrics.registry, cfg.trainer_dir, trainer_cfg)
        trainer.start()
        return trainer

    def _stop_trainer(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()
            self.trainer = None

    async def serve(self) -> None:
        """Start everything, serve until `stop()` is called, then shut down gracefully."""
        self._aloop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        cfg = self.config
        self.backend.start()
        grpc_server, health, self.grpc_port = build_grpc_server(self.ctx, f"{cfg.host}:{cfg.grpc_port}")
        await set_health(health, False)
        await grpc_server.start()
        http = _Uvicorn(uvicorn.Config(create_app(self.ctx), host=cfg.host, port=cfg.http_port, log_level="warning",
                                       access_log=False, lifespan="off", timeout_graceful_shutdown=2,
                                       http=header_deadline(cfg.limits.header_timeout_s)))
        http_task = asyncio.create_task(http.serve())
        while not http.started and not http_task.done():
            await asyncio.sleep(0.01)
        if http_task.done():
            await grpc_server.stop(0)
            self.backend.stop()
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
            await asyncio.to_thread(self._stop_trainer)  # before the engine: its last push has a server
            await asyncio.to_thread(self.backend.stop)
            if self.buffer is not None:
                await asyncio.to_thread(self.buffer.close)
            await stopping
            await http_task
            self.ctx.close()

    async def _mark_ready(self, health: Any) -> None:
        await asyncio.to_thread(self.backend.wait_loaded)
        if self.backend.load_error is None:
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
    code = 0
    if server.backend.load_error is not None:
        logger.error("the model failed to load: %s", server.backend.load_error)
        code = 1
    if server.backend.must_exit_hard():  # everything is closed; a backend thread cannot be joined
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class BackgroundServer:
    """Run a SpecrollServer on a daemon thread; use as a context manager."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig | None = None) -> None:
        self.server = SpecrollServer(engine_config, config)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specroll-server", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as exc:
            self._error = exc
            self.server.started.set()

    def start(self, timeout: float = 300.0, wait_ready: bool = True) -> BackgroundServer:
        self._thread.start()
        if not self.server.started.wait(timeout) or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error}")
        if wait_ready:
            self.server.backend.wait_loaded(timeout)
            if self.server.backend.load_error is not None:
                raise RuntimeError(f"model failed to load: {self.server.backend.load_error}")
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
