"""Fixtures the API tests of weight pushes share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.models import packed


@pytest.fixture(scope="module")
def every_row_class_packed() -> Iterator[None]:
    """Every row class runs the packed copies where oneDNN is here, whatever this machine's timing would pick:
    a stale pack then shows in the outputs."""
    with pytest.MonkeyPatch.context() as mp:
        if packed.onednn_available():
            mp.setattr(packed, "_choose", lambda layers, timer: (True,) * (len(packed.ROW_CLASSES) + 1))
        yield
