"""A process that runs a spool and dies mid-way, for the crash tests (tests/buffer/test_buffer_crash.py).

``spool_child.py prepend|replay DIR [K]``: with K, the process exits with 137 right after the K-th file
system call that changes or syncs the spool (replace, rename, unlink, fsync, ftruncate) once the step under
test starts; without K only ``SPECROLL_SPOOL_FAULT`` stops it. `prepend` fills the spool, reads a few
records (the head segment is half read) and prepends; `replay` reads and commits everything, printing each
record before its commit (what a consumer received). It prints ``done`` when it got to the end.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# spool.py alone (it needs the standard library only): the package would import Redis, protobuf and
# Prometheus, a second of start-up for each of the many children a test runs.
_SPEC = importlib.util.spec_from_file_location(
    "spool_under_test", Path(__file__).resolve().parents[2] / "service" / "buffer" / "spool.py")
assert _SPEC is not None and _SPEC.loader is not None
_MODULE = sys.modules[_SPEC.name] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_MODULE)
Spool = _MODULE.Spool

SEGMENT_BYTES = 400


def records(n: int, start: int = 0) -> list[bytes]:
    return [f"{i:08d}".encode() * 5 for i in range(start, start + n)]


def crash_after(k: int) -> None:
    """Exit (as if killed) right after the k-th spool-changing call from now on."""
    calls = [0]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            out = fn(*args, **kw)
            calls[0] += 1
            if calls[0] >= k:
                os._exit(137)
            return out
        return call

    for name in ("replace", "rename", "unlink", "fsync", "ftruncate"):
        setattr(os, name, wrap(getattr(os, name)))


def main() -> None:
    mode, folder = sys.argv[1], sys.argv[2]
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    if mode == "prepend":
        spool = Spool(folder, max_bytes=1 << 20, segment_bytes=SEGMENT_BYTES)
        for r in records(20):
            spool.append(r)
        spool.sync()
        spool.commit(len(spool.peek(5)))
        if k:
            crash_after(k)
        spool.prepend(records(3, start=100))
    else:
        spool = Spool(folder, max_bytes=1 << 20, segment_bytes=SEGMENT_BYTES)
        if k:
            crash_after(k)
        while got := spool.peek(4):
            for r in got:
                sys.stdout.write(r.decode() + "\n")
            sys.stdout.flush()
            spool.commit(len(got))
    spool.close()
    sys.stdout.write("done\n")


if __name__ == "__main__":
    main()
