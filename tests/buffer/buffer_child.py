"""A process that runs the Redis buffer and dies mid-way, for the crash tests (test_buffer_crash.py).

``buffer_child.py spool URL STREAM DIR N``: N rollouts are submitted while Redis (at URL) is down; the id
of each is printed once its `stored` callback ran (the moment a client gets its final message); then the
process exits with 137 without any clean-up, records in the spool. ``buffer_child.py replay URL STREAM
DIR``: the spool is replayed into Redis; ``SPECROLL_SPOOL_FAULT`` may stop it half-way; ``done`` at the end.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from service.buffer import BufferConfig, RedisBuffer
from service.buffer.codec import spool_rollout
from service.protogen import pb2


def config(url: str, stream: str, folder: str) -> BufferConfig:
    return BufferConfig(redis_url=url, stream=stream, spool_dir=folder, queue_max=4, batch_size=6,
                        spool_max_bytes=1 << 20, spool_segment_bytes=1024, socket_timeout_s=0.5,
                        close_timeout_s=1.0)


def main() -> None:
    mode, url, stream, folder = sys.argv[1:5]
    buffer = RedisBuffer(config(url, stream, folder))
    if mode == "spool":
        n = int(sys.argv[5])
        lock, acked = threading.Lock(), []

        def stored(rid: str) -> None:
            with lock:
                acked.append(rid)
                sys.stdout.write(rid + "\n")
                sys.stdout.flush()

        for i in range(n):
            payload = pb2.RolloutPayload(rollout_id=f"r{i}", output_token_ids=[i, i + 1], finish_reason="length")
            buffer.submit(spool_rollout(payload), lambda rid=f"r{i}": stored(rid))
        deadline = time.monotonic() + 60
        while len(acked) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(137)
    deadline = time.monotonic() + 60
    while (len(buffer.spool) or buffer.queued) and time.monotonic() < deadline:
        time.sleep(0.01)
    buffer.close()
    sys.stdout.write("done\n" if not len(buffer.spool) else "spool not replayed\n")


if __name__ == "__main__":
    main()
