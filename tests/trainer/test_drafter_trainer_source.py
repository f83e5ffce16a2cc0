"""The sidecar's Redis consumer against a real redis-server, without a specroll server."""

from __future__ import annotations

import time
import uuid

import redis

from drafter_trainer.config import TrainerConfig
from drafter_trainer.source import RedisSource

IDLE = 0.7  # seconds; claim_idle_ms is 100 ms less


def config(redis_url: str, stream: str, consumer: str, **kw) -> TrainerConfig:
    return TrainerConfig(redis_url=redis_url, stream=stream, consumer=consumer, claim_idle_ms=int(IDLE * 1000) - 100,
                         max_deliveries=3, **kw)


def test_resume_failures_dead_letter_and_in_flight_entries(redis_server):
    r = redis.Redis.from_url(redis_server)
    stream = f"src:{uuid.uuid4().hex[:8]}"
    ids = [r.xadd(stream, {"n": str(i)}).decode() for i in range(10)]
    first = RedisSource(r, config(redis_server, stream, "a"))
    assert [e.entry_id for e in first.read(7, 10)] == ids[:7]  # delivered to "a", never acked: "a" crashes
    again = RedisSource(r, config(redis_server, stream, "a"))  # "a" restarts: its own pending first, in pages
    assert [e.entry_id for e in again.read(4, 10)] == ids[:4]
    assert [e.entry_id for e in again.read(4, 10)] == ids[4:7]
    again.ack(ids[:3])
    assert [e.entry_id for e in again.read(10, 10)] == ids[7:]
    assert again.lag() == (0, 7)

    other = RedisSource(r, config(redis_server, stream, "b"))
    time.sleep(IDLE)  # everything "a" holds has been idle long enough to be taken over ...
    again._next_claim = 0.0
    assert again.read(10, 10) == []  # ... but "a" refreshes what it holds (XCLAIM JUSTID) before claiming
    assert other.read(10, 10) == []  # so "b" finds nothing idle for claim_idle_ms
    again.ack(ids[4:])
    [bad] = again._with_deliveries(again._entries([[stream, r.xrange(stream, ids[3], ids[3])]]))
    assert bad.deliveries == 2  # read by "a", then again from its own pending list after the restart
    again.fail(bad, "boom")  # stays pending; "a" no longer holds it
    time.sleep(IDLE)
    [claimed] = other.read(10, 10)  # taken over by "b" once idle (XAUTOCLAIM counts a delivery)
    assert claimed.entry_id == ids[3] and claimed.deliveries == 3
    other.fail(claimed, "boom again")  # the max_deliveries-th failure: dead-lettered and acked
    [(_, dead)] = r.xrange(f"{stream}:dead")
    assert dead[b"dl_entry_id"].decode() == ids[3] and dead[b"dl_reason"] == b"boom again"
    assert other.dead_lettered == 1 and r.xpending(stream, "drafter-trainer")["pending"] == 0

    r.xadd(stream, {"n": "late"})
    assert [e.fields for e in other.read(1, 10)] == [{b"n": b"late"}]
    r.xtrim(stream, maxlen=0)  # pending entries trimmed away are acked, not retried forever
    time.sleep(IDLE)
    gone = RedisSource(r, config(redis_server, stream, "c"))
    assert gone.read(10, 10) == [] and gone.trimmed > 0
    r.close()
