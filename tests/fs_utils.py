"""Real file systems for disk-failure tests: a tiny tmpfs that runs out of space, and filling one up."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tiny_tmpfs(mnt: Path, size: int = 256 << 10) -> Iterator[Path]:
    """A tmpfs of `size` bytes mounted at `mnt` (needs root: the test is skipped where mount is refused)."""
    mnt.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def fill(folder: Path, leave: int) -> Path:
    """Fill `folder`'s file system with one file until about `leave` bytes are free; returns the file."""
    filler = folder / "filler"
    with open(filler, "wb") as fh:
        fh.write(b"\0" * max(0, free_bytes(folder) - leave))
    return filler
