"""Start `specroll serve` as a separate process on free loopback ports (for the example and the benchmark)."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.netutil import free_port

logger = logging.getLogger(__name__)


@dataclass
class ServerProcess:
    """A running `specroll serve`; use as a context manager (SIGTERM on exit)."""

    model: str
    drafter: str = "none"
    spec: str = "adaptive"
    spec_k: int = 4
    drafter_trainer: bool = False
    threads: int | None = None
    max_model_len: int = 1024
    max_num_seqs: int = 64
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)
    # Compile the forwards before answering (benchmarks: no eager steps in the timed ones); else the server answers
    # at once and compiles in the background
    compile_before_serving: bool = False
    log_path: Path | None = None
    cpus: set[int] | None = None  # pin the server process to these CPU cores (Linux)
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "service.cli", "--log-level", "WARNING", "serve", "--model", self.model,
               "--drafter", self.drafter, "--spec", self.spec, "--spec-k", str(self.spec_k),
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
               "--seed", str(self.seed), "--max-message-mb", "64"]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        if not self.drafter_trainer:
            cmd.append("--no-drafter-trainer")
        if self.compile_before_serving:
            cmd.append("--compile-before-serving")
        return cmd + self.extra_args

    def start(self, timeout_s: float = 600.0) -> ServerProcess:
        env = dict(os.environ, SPECROLL_ADMIN_TOKEN=self.admin_token)
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        cpus = self.cpus
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin)
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.http_port}/ready"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specroll serve exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("specroll serve did not become ready")
            time.sleep(0.2)
        logger.info("specroll serve ready on %s (drafter %s, spec %s)", self.grpc_target, self.drafter, self.spec)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
