"""Watching a running service from a test: poll until a condition holds, and read values from Prometheus text.

Every test waits through :func:`wait_for` and parses metrics through :func:`metric` / :func:`metric_lines`,
so a timeout always names what it waited for and a metric name always matches the same way
(``tests/test_test_helpers.py`` keeps a second copy from appearing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float, what: str, *, every: float = 0.05,
             ignoring: tuple[type[Exception], ...] = (), detail: Callable[[], str] | None = None) -> T:
    """Call `cond` every `every` seconds until it returns something truthy, and return that.

    An exception of a type in `ignoring` counts as "not yet" (a service still starting refuses connections).
    After `timeout` seconds it fails with `what`, the last ignored error and `detail()` (a log tail, say).
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            value = cond()
            if value:
                return value
        except ignoring as exc:
            last = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(every)
    message = f"timed out after {timeout:g} s waiting for {what}"
    if last is not None:
        message += f" (last error: {last!r})"
    if detail is not None:
        message += "\n" + detail()
    raise AssertionError(message)


def metric_lines(text: str, name: str) -> list[str]:
    """The sample lines of Prometheus text whose series is `name`, with or without labels after it.

    `name` may carry labels itself (``'x_total{kind="a"}'``) to pick one series.
    """
    return [line for line in text.splitlines() if line.startswith(name) and line[len(name):len(name) + 1] in " {"]


def metric(text: str, name: str) -> float:
    """The sum of the values of the samples :func:`metric_lines` picks (0 when there are none)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metric_lines(text, name))
