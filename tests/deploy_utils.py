"""Helpers for the deployment tests: a missing tool skips locally and fails in CI; polling services that start."""

from __future__ import annotations

import shutil
from pathlib import Path

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


# How the deployment tests poll with probes.wait_for: every half second (each poll may run docker), and a
# service that is still starting (refused connections, half-written answers) counts as "not yet".
POLL_S = 0.5
STARTING = (httpx.HTTPError, OSError, ValueError)


def http_ok(url: str) -> bool:
    return httpx.get(url, timeout=2.0).status_code == 200
