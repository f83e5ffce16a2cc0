"""One trainer per consumer group: a lease in Redis.

The holder sets ``<stream>:lease:<group>`` to a token of its own (SET NX PX) and renews it from a thread every
third of the TTL; a Lua script extends the expiry only while the key still holds that token, and release
deletes it by the same check, so no trainer ever extends or deletes another's lease. A second trainer on the
group stands by (logged, `trainer_lease_held` 0) until the key is gone: released, or expired because its holder
died or stalled for a TTL. A holder that finds its lease gone has been replaced: it pushes no drafter and writes
no checkpoint from then on (fencing: the lease is confirmed, by the same script, right before each push and each
checkpoint) and goes back to standby.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING

import redis

if TYPE_CHECKING:
    from drafter_trainer.metrics import TrainerMetrics

logger = logging.getLogger(__name__)

_RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
          "else return 0 end")
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


def lease_key(stream: str, group: str) -> str:
    return f"{stream}:lease:{group}"


class Lease:
    """A trainer's claim on its consumer group. `acquire` blocks in standby; `held` and `confirm` fence."""

    def __init__(self, client: redis.Redis, key: str, holder: str, ttl_ms: int,
                 metrics: TrainerMetrics | None = None) -> None:
        if ttl_ms < 100:
            raise ValueError(f"the lease TTL must be >= 100 ms, got {ttl_ms}")
        self.r, self.key, self.holder, self.ttl_ms = client, key, holder, ttl_ms
        self.metrics = metrics
        self.token = ""
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._lock = threading.Lock()
        self._held = False
        self._confirmed_at = 0.0
        self._stop_renewing = threading.Event()
        self._renewer: threading.Thread | None = None

    # -- taking it ----------------------------------------------------------------------------------
    def try_acquire(self) -> bool:
        token = f"{self.holder}:{uuid.uuid4().hex}"
        if not self.r.set(self.key, token, nx=True, px=self.ttl_ms):
            return False
        with self._lock:
            self.token, self._held, self._confirmed_at = token, True, time.monotonic()
        self._set_gauge(1)
        if self.metrics is not None:
            self.metrics.lease_acquired.inc()
        self._stop_renewing.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="drafter-trainer-lease", daemon=True)
        self._renewer.start()
        logger.info("holding the trainer lease %r as %s", self.key, self.holder)
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Stand by until the lease is ours (True) or `stop` is set (False)."""
        self._set_gauge(0)
        seen: str | None = None
        while not stop.is_set():
            try:
                if self.try_acquire():
                    return True
                current = self.current_holder()
            except redis.RedisError as exc:
                logger.warning("cannot reach Redis for the trainer lease %r: %s", self.key, exc)
                current = None
            if current is not None and current != seen:
                seen = current
                logger.info("standby: the consumer group is trained by %s (lease %r); waiting for it to go",
                            current.rpartition(":")[0] or current, self.key)
            stop.wait(min(self.ttl_ms / 4000, 1.0))
        return False

    def current_holder(self) -> str | None:
        value = self.r.get(self.key)
        return None if value is None else value.decode(errors="replace")

    # -- keeping it ---------------------------------------------------------------------------------
    @property
    def held(self) -> bool:
        """Ours as far as we know: confirmed within the TTL and never found taken."""
        with self._lock:
            return self._held and time.monotonic() - self._confirmed_at < self.ttl_ms / 1000

    def confirm(self) -> bool:
        """Check with Redis that the lease is still ours, extending it; False (and lost for good) if it is not.
        A Redis error answers False without giving the lease up: the caller skips what it fences."""
        with self._lock:
            if not self._held:
                return False
            token = self.token
        try:
            ok = bool(self._renew(keys=[self.key], args=[token, self.ttl_ms]))
        except redis.RedisError as exc:
            logger.warning("cannot confirm the trainer lease %r: %s", self.key, exc)
            return False
        with self._lock:
            if ok and self.token == token:
                self._confirmed_at = time.monotonic()
                return True
            was, self._held = self._held, False
        if was:
            self._lost()
        return False

    def _lost(self) -> None:
        self._set_gauge(0)
        self._stop_renewing.set()
        if self.metrics is not None:
            self.metrics.lease_lost.inc()
        try:
            now = self.current_holder()
        except redis.RedisError:
            now = None
        logger.warning("lost the trainer lease %r (now held by %s): no more pushes or checkpoints from %s",
                       self.key, now or "nobody", self.holder)

    def _renew_loop(self) -> None:
        while not self._stop_renewing.wait(self.ttl_ms / 3000):
            if not self.confirm() and not self.held:
                with self._lock:
                    lapsed, self._held = self._held, False
                if lapsed:  # Redis unreachable for a whole TTL: another trainer may hold it by now
                    self._lost()
                return

    # -- giving it up -------------------------------------------------------------------------------
    def release(self) -> None:
        """Delete the lease if it is still ours (a standby takes it at once)."""
        self._stop_renewing.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(5)
        with self._lock:
            token, held, self._held = self.token, self._held, False
        self._set_gauge(0)
        if held:
            try:
                self._release(keys=[self.key], args=[token])
            except redis.RedisError as exc:
                logger.warning("could not release the trainer lease %r (it expires by itself): %s", self.key, exc)

    def _set_gauge(self, value: int) -> None:
        if self.metrics is not None:
            self.metrics.lease_held.set(value)
