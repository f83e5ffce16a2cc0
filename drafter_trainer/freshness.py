"""The freshness alarm: a stale drafter after a policy push, and how long it took to recover.

Before a push the served drafter has accepted length L0 on the old policy's rollouts. The first
measurement on the new policy's rollouts gives L1; when (L1 - 1) < alarm_ratio * (L0 - 1), i.e. it fell
most of the way toward 1 (no draft accepted), the alarm is raised. It clears once the served drafter
measures (L - 1) >= recover_ratio * (L0 - 1) on current rollouts; the time since the push is recorded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from drafter_trainer.metrics import TrainerMetrics

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FreshnessEvent:
    version: str
    before: float
    stale: float | None = None
    recovered: float | None = None
    seconds: float | None = None


class FreshnessAlarm:
    def __init__(self, alarm_ratio: float, recover_ratio: float, metrics: TrainerMetrics | None = None) -> None:
        self.alarm_ratio, self.recover_ratio, self.metrics = alarm_ratio, recover_ratio, metrics
        self.baseline: float | None = None  # served drafter on the current policy, latest measurement
        self.version: str | None = None
        self.since = 0.0
        self.awaiting = False  # a push happened; the first measurement on it decides
        self.stale = False
        self.events: list[FreshnessEvent] = []

    def policy_changed(self, version: str) -> None:
        if self.version is not None and version != self.version and self.baseline is not None:
            if not self.stale:  # while stale, keep measuring against the last good level
                self.events.append(FreshnessEvent(version, self.baseline))
            else:
                self.events[-1].version = version
            self.awaiting = True
            self.since = time.monotonic()
        self.version = version

    def observe(self, served_length: float) -> None:
        """A measurement of the served drafter on rollouts of the current policy version."""
        ev = self.events[-1] if self.events else None
        if self.awaiting and ev is not None:
            self.awaiting = False
            if served_length - 1 < self.alarm_ratio * (ev.before - 1):
                ev.stale = served_length
                self.stale = True
                logger.warning("stale drafter after policy push %s: accepted length %.2f -> %.2f (toward 1)",
                               ev.version, ev.before, served_length)
                if self.metrics is not None:
                    self.metrics.alarms.inc()
                    self.metrics.stale.set(1)
                return
        if self.stale and ev is not None and served_length - 1 >= self.recover_ratio * (ev.before - 1):
            self.stale = False
            ev.recovered, ev.seconds = served_length, time.monotonic() - self.since
            logger.info("drafter recovered after policy push %s: accepted length %.2f in %.1f s", ev.version,
                        served_length, ev.seconds)
            if self.metrics is not None:
                self.metrics.stale.set(0)
                self.metrics.recovery.observe(ev.seconds)
                self.metrics.last_recovery.set(ev.seconds)
        if not self.stale:
            self.baseline = served_length
