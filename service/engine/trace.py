"""A per-step trace of the adaptive strategy, for operators asking why it ran what it ran (`--strategy-trace`).

One JSON line per decode step: what ran, how long it took, what it emitted, and what the strategy believed of
each drafter when it chose. Prometheus has the steps per arm; this has each step. A stale suffix table that the
draft model stood in for over ~300 steps was found with such a trace (speculative/shadow.py). Each line also has
the host milliseconds around the forwards (`host_ms`: the choice with the lookahead drafters' lookahead, appending the
tokens, the strategy's feedback): 1-2% of a CPU step, but a GPU step takes a few milliseconds in all.

The engine thread writes it, line-buffered. A write that fails (disk full, file removed) logs once and stops
the trace; it never fails a step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, TextIO

logger = logging.getLogger(__name__)


class StepTrace:
    def __init__(self, path: str) -> None:
        self.path = path
        self._file: TextIO | None = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    @property
    def active(self) -> bool:
        return self._file is not None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({"time": round(time.time(), 6), **record}, separators=(",", ":")) + "\n")
        except (OSError, ValueError) as exc:  # ValueError: written after close
            logger.warning("strategy trace %s stopped: %s", self.path, exc)
            self.close()

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()
