"""The project's image, built and run: the Dockerfile built the way an air-gapped cluster builds it (a local
Debian base from debootstrap, the torch wheel from a local wheel folder passed by build argument), then a
container started from it answers readiness, one completion, the gRPC health service and its own HEALTHCHECK,
reads its admin token from a secret file, and runs the sidecar's subcommand.

Skipped (with the reason) where dockerd cannot run; in CI (``CI`` set) it must run."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from deploy_utils import POLL_S, REPO, STARTING, require_binary, unavailable
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import stop_process
from probes import metric, metric_lines, wait_for

from service.netutil import free_port

logger = logging.getLogger(__name__)

BASE_IMAGE = "specroll-base:bookworm"
IMAGE = "specroll:test"
TOKEN = "image-test-admin-token"
BUILD_TIMEOUT_S = 1500
DOCKERD_START_S = 60


def _docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        pytest.fail(f"docker {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def _daemon_up() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A working docker daemon: the running one, or a dockerd this fixture starts (as root) and stops."""
    require_binary("docker")
    if _daemon_up():
        yield
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        unavailable("no docker daemon and dockerd cannot be started here (needs the binary and root)")
    log_path = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([str(dockerd)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + DOCKERD_START_S
        while proc.poll() is None and not _daemon_up() and time.monotonic() < deadline:
            time.sleep(1.0)
        if proc.poll() is not None or not _daemon_up():
            unavailable(f"dockerd did not start: {log_path.read_text(errors='replace')[-2000:]}")
        yield
    finally:
        stop_process(proc, 30)


def _local_torch_wheels() -> Path | None:
    """The folder pip's configured find-links points at, if it holds the torch 2.13.0 CPU wheel."""
    links = os.environ.get("PIP_FIND_LINKS") or subprocess.run(
        ["python3", "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True).stdout
    for entry in links.split():
        folder = Path(entry.removeprefix("file://"))
        if folder.is_dir() and any(folder.glob("torch-2.13.0*cpu*.whl")):
            return folder
    return None


def _bind_wheel_server(handler: Any) -> http.server.ThreadingHTTPServer:
    """Bind on the port the last run used when it is free (the wheel URL is a build argument, so the same URL
    keeps docker's cached torch layer), else on a free one, remembered for next time."""
    memo = Path(os.environ.get("SPECROLL_BASE_CACHE") or Path.home() / ".cache" / "specroll-ci") / "wheel-port"
    try:
        return http.server.ThreadingHTTPServer(("127.0.0.1", int(memo.read_text())), handler)
    except (OSError, ValueError):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(str(server.server_address[1]))
    except OSError:
        logger.warning("cannot remember the wheel server's port in %s", memo)
    return server


@pytest.fixture(scope="module")
def wheel_server() -> Iterator[str | None]:
    """The local wheel folder served on loopback (an air-gapped cluster's wheel mirror); None: use the public index."""
    folder = _local_torch_wheels()
    if folder is None:
        yield None
        return
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = _bind_wheel_server(handler)
    server.RequestHandlerClass.log_message = lambda *a, **k: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def image(docker: None, wheel_server: str | None) -> str:
    """The image built from the Dockerfile (docker's layer cache makes a rebuild after code changes short)."""
    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode != 0:
        require_binary("debootstrap")
        out = subprocess.run(["bash", str(REPO / "deploy/docker/build-base.sh"), BASE_IMAGE], capture_output=True,
                             text=True, timeout=BUILD_TIMEOUT_S)
        if out.returncode != 0:
            pytest.fail(f"building the base image failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    args = ["build", "--network", "host", "--build-arg", f"BASE={BASE_IMAGE}", "-t", IMAGE]
    if wheel_server is not None:
        args += ["--build-arg", "TORCH_INDEX=", "--build-arg", f"PIP_FIND_LINKS={wheel_server}"]
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    out = subprocess.run(["docker", *args, str(REPO)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                         env=env)
    if out.returncode != 0:
        pytest.fail(f"docker build failed:\n{out.stdout[-5000:]}\n{out.stderr[-3000:]}")
    return IMAGE


@pytest.fixture(scope="module")
def container(image: str, redis_server: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int | str]]:
    """A container on the host network (loopback only, free ports), the admin token mounted as a secret file,
    its rollout buffer in a real redis-server."""
    secrets = tmp_path_factory.mktemp("secrets")
    (secrets / "admin-token").write_text(TOKEN)
    os.chmod(secrets / "admin-token", 0o644)
    http_port, grpc_port = free_port(), free_port()
    name = "specroll-test-" + hashlib.sha1(str(secrets).encode()).hexdigest()[:10]
    _docker("run", "-d", "--name", name, "--network", "host", "--health-interval", "2s",
            "-e", "SPECROLL_HOST=127.0.0.1", "-e", f"SPECROLL_HTTP_PORT={http_port}",
            "-e", f"SPECROLL_GRPC_PORT={grpc_port}", "-e", "SPECROLL_ADMIN_TOKEN_FILE=/run/secrets/admin-token",
            "-e", f"SPECROLL_REDIS_URL={redis_server}",
            "-v", f"{secrets / 'admin-token'}:/run/secrets/admin-token:ro", image)
    try:
        yield {"name": name, "http": http_port, "grpc": grpc_port, "secret": str(secrets / "admin-token"),
               "redis": redis_server, "image": image}
    finally:
        logs = _docker("logs", name, check=False)
        logger.info("container logs:\n%s", (logs.stdout + logs.stderr)[-4000:])
        _docker("rm", "-f", name, check=False)


def _logs(name: str) -> str:
    out = _docker("logs", name, check=False)
    return (out.stdout + out.stderr)[-4000:]


def test_image_metadata(image: str) -> None:
    [info] = json.loads(_docker("image", "inspect", image).stdout)
    config = info["Config"]
    assert config["User"] == "specroll"
    assert config["Entrypoint"] == ["specroll-entrypoint"]
    assert "/health" in " ".join(config["Healthcheck"]["Test"])
    assert {"8000/tcp", "50051/tcp"} <= set(config["ExposedPorts"])


def test_container_serves(container: dict[str, int | str]) -> None:
    base = f"http://127.0.0.1:{container['http']}"
    name = str(container["name"])
    ready = wait_for(lambda: httpx.get(f"{base}/ready", timeout=2).status_code == 200, 300, "/ready",
                     every=POLL_S, ignoring=STARTING, detail=lambda: _logs(name))
    assert ready
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "3+a4=", "max_tokens": 12, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "default-v2" and body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"])
    assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["text"]
    # the admin token came from the secret file: the right one is accepted, none is refused
    assert httpx.post(f"{base}/resume", timeout=10).status_code == 401
    assert httpx.post(f"{base}/resume", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).status_code == 200
    # the image's compiler and headers serve compiled forwards and the cpp attention kernel (not eager ones),
    # compiled while the container already serves (it answered above)
    def logs() -> str:
        out = _docker("logs", name, check=False)
        return out.stdout + out.stderr

    wait_for(lambda: re.search(r"compiled \d+ decode / verify forwards in the background .*"
                               r"steps run them from now on", logs()), 300, "compiled forwards",
             every=POLL_S, ignoring=STARTING, detail=lambda: logs()[-4000:])
    # an idle server switches to them too, and says so to Prometheus
    gauge = "\nspecroll:compiling 0.0\n"
    wait_for(lambda: gauge in httpx.get(f"{base}/metrics", timeout=5).text, 10, gauge.strip(), every=POLL_S,
             ignoring=STARTING)
    text = logs()
    for eager in ("no C++ compiler", "no Python headers", "cpp attention kernel is not available"):
        assert eager not in text, text[-4000:]


def test_grpc_health_service(container: dict[str, int | str]) -> None:
    base = f"http://127.0.0.1:{container['http']}"
    wait_for(lambda: httpx.get(f"{base}/ready", timeout=2).status_code == 200, 300, "/ready", every=POLL_S,
             ignoring=STARTING)
    with grpc.insecure_channel(f"127.0.0.1:{container['grpc']}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specroll.v1.Rollout"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_healthcheck_turns_healthy(container: dict[str, int | str]) -> None:
    name = str(container["name"])

    def status() -> str:
        state = json.loads(_docker("inspect", name).stdout)[0]["State"]
        assert state["Running"], _logs(name)
        return state["Health"]["Status"]

    wait_for(lambda: status() == "healthy", 300, "the image's HEALTHCHECK to report healthy", every=POLL_S,
             ignoring=STARTING, detail=lambda: _logs(name))
    [state] = [json.loads(_docker("inspect", name).stdout)[0]["State"]]
    assert state["Health"]["Log"][-1]["ExitCode"] == 0


def test_entrypoint_runs_subcommands_and_refuses_a_missing_secret(image: str) -> None:
    out = _docker("run", "--rm", "--network", "none", image, "drafter-trainer", "--help", timeout=120)
    assert "--checkpoint-dir" in out.stdout and "--metrics-port" in out.stdout
    out = _docker("run", "--rm", "--network", "none", "-e", "SPECROLL_ADMIN_TOKEN_FILE=/nonexistent", image,
                  timeout=120, check=False)
    assert out.returncode == 2 and "SPECROLL_ADMIN_TOKEN_FILE" in out.stderr


def _trainer_metric(port: int, name: str) -> float | None:
    # Prometheus' own Accept header: the names must come back as defined (specroll:..., not specroll_...)
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"accept": accept}, timeout=5).text
    return metric(text, name) if metric_lines(text, name) else None


def test_sidecar_container_reads_the_rollout_stream(container: dict[str, int | str]) -> None:
    """The drafter-trainer sidecar from the same image: token from the secret file, checkpoints in the image's
    checkpoint folder as uid 10001, metrics on its port, and it consumes the server's rollouts from Redis."""
    base = f"http://127.0.0.1:{container['http']}"
    wait_for(lambda: httpx.get(f"{base}/ready", timeout=2).status_code == 200, 300, "/ready", every=POLL_S,
             ignoring=STARTING)
    metrics_port = free_port()
    name = f"{container['name']}-trainer"
    _docker("run", "-d", "--name", name, "--network", "host",
            "-e", "SPECROLL_ADMIN_TOKEN_FILE=/run/secrets/admin-token",
            "-e", f"SPECROLL_REDIS_URL={container['redis']}",
            "-v", f"{container['secret']}:/run/secrets/admin-token:ro", str(container["image"]),
            "drafter-trainer", "--server", f"127.0.0.1:{container['grpc']}", "--metrics-port", str(metrics_port),
            "--checkpoint-dir", "/opt/specroll/checkpoints")
    try:
        wait_for(lambda: _trainer_metric(metrics_port, "specroll:trainer_lag") is not None, 300,
                 "the sidecar's metrics", every=POLL_S, ignoring=STARTING, detail=lambda: _logs(name))
        for i in range(8):
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "3+a4=", "max_tokens": 16, "n": 2,
                                                            "temperature": 1.0, "seed": i}, timeout=120)
            assert r.status_code == 200, r.text
        wait_for(lambda: (_trainer_metric(metrics_port, "specroll:trainer_entries_consumed_total") or 0) > 0, 300,
                 "the sidecar to consume rollouts", every=POLL_S, ignoring=STARTING, detail=lambda: _logs(name))
        state = json.loads(_docker("inspect", name).stdout)[0]["State"]
        assert state["Running"], _logs(name)
    finally:
        _docker("rm", "-f", name, check=False)
