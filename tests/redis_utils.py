"""A redis-server of a test's own, which the test stops and restarts."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from helpers import stop_process
from probes import wait_for

from service.netutil import free_port


def redis_ping(port: int) -> bool:
    """Whether a redis-server answers PING on 127.0.0.1:`port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class OwnRedis:
    """A redis-server with an append-only file, so a stop and restart keeps what it had."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.dir = free_port(), workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server not installed (bash scripts/test.sh installs it)")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "yes", "--dir", str(self.dir), "--loglevel", "warning"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_for(lambda: redis_ping(self.port), 15, "redis-server")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
