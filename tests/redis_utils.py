"""A redis-server of a test's own (stopped and restarted by the test) and polling until a condition holds."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import stop_process

from service.netutil import free_port


def wait_for(cond: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


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
        wait_for(self._up, 15, "redis-server")

    def _up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
