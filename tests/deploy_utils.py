"""Helpers for the deployment tests: a missing tool skips locally and fails in CI; waiting for HTTP endpoints."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from ci_reporting import in_ci

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"


def unavailable(reason: str) -> None:
    """Skip with `reason`, except in CI, where a deployment check that cannot run is a failure."""
    if in_ci():
        pytest.fail(f"{reason} (required in CI; bash scripts/test.sh installs it)")
    pytest.skip(reason)


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} not found")
    assert path is not None
    return path


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 0.5,
             on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll `check` until it returns something truthy; fail with `what` (and `on_timeout()`) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (httpx.HTTPError, OSError, ValueError) as exc:
            last = exc
        time.sleep(interval_s)
    detail = on_timeout() if on_timeout is not None else ""
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {last!r})\n{detail}")


def http_ok(url: str) -> bool:
    return httpx.get(url, timeout=2.0).status_code == 200
