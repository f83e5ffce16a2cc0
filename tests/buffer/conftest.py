"""The buffer tests' tiny file system (tests/fs_utils.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fs_utils import tiny_tmpfs


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted at a fresh folder."""
    with tiny_tmpfs(tmp_path / "tiny") as mnt:
        yield mnt
