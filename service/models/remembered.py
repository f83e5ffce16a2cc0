"""Timed choices (attention kernels, prepacked linears) remembered per machine, so every start picks the same ones.

The engine times its candidate kernels at start-up and serves the fastest (service/models/attention.py, packed.py).
On a shared machine timings move by 10-30% between runs, so near-ties flipped from one start to the next, and the
compiled forwards' graphs with them: inductor's cache, keyed by the graph, then missed, and a server compiled its
forwards again at every start (the demo model: ~110 s on 2 cores, against ~20 s from the cache; 2 hits in 10 in a
container whose image had compiled them at build time). So the first start times and writes its choices to
`<cache root>/choices.json`, and later starts with the same torch, CPU and thread count read them (and, for the
attention kernels, the same source of our own: attention.py puts its hash in the key). Delete the file to time
again. An unreadable or unwritable file only means timing again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from service.config import default_cache_root
from service.models.timing import cpu_flags

logger = logging.getLogger(__name__)

FILE = "choices.json"


def _machine() -> str:
    """What a timing depends on besides the shapes timed: torch, the CPU and the calling thread's thread count."""
    return hashlib.sha256(f"{torch.__version__}|{cpu_flags()}|{torch.get_num_threads()}".encode()).hexdigest()[:16]


def remembered(kind: str, key: tuple, choose: Callable[[], tuple]) -> tuple[tuple, bool]:
    """`choose()` the first time on this machine, its remembered value after; returns (value, whether remembered).
    Values are tuples of JSON scalars."""
    path = default_cache_root() / FILE
    name = f"{kind}|{_machine()}|{key!r}"
    table = _read(path)
    if isinstance(table.get(name), list):
        return tuple(table[name]), True
    value = choose()
    table = _read(path)  # another process may have written meanwhile: keep its entries
    table[name] = list(value)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{FILE}.")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=0)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("cannot remember timed choices in %s (%s): the next start times them again", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return value, False


def _read(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}
