"""`service.heap.release_free_memory`: pages a thread freed between live buffers (what a push's layout workers
leave when each layer's new pack replaces the old one) go back to the OS."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from service.heap import release_free_memory


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc (Linux)")
def test_pages_freed_between_live_buffers_go_back_to_the_os():
    kept: list[torch.Tensor] = []

    def work() -> None:
        torch.empty(8 << 20, dtype=torch.uint8).fill_(1)  # freed at once: glibc then keeps such sizes in its heap
        buffers = [torch.empty(1 << 20, dtype=torch.uint8).fill_(1) for _ in range(600)]
        kept.extend(buffers[::2])  # every other one stays alive: the freed ones are holes, not the heap's top

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    before = _rss_mb()
    if not release_free_memory():
        pytest.skip("no glibc malloc_trim here")
    after = _rss_mb()
    assert len(kept) == 300
    assert before - after > 150, (before, after)  # about 300 MB of holes
