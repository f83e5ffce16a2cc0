"""Fixtures the API tests of weight pushes share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.models import packed


@pytest.fixture(scope="module")
def every_row_class_packed() -> Iterator[None]:
    """Every row class runs the packed copies where oneDNN is here, whatever this machine's timing would pick:
    a stale pack then shows in the outputs. The choices are kept where the push's layout pipeline reads them,
    in a cache of this module's own: an earlier module's timed choice for the same shapes is not seen here."""
    every = (True,) * (len(packed.ROW_CLASSES) + 1)

    def choose(layers: list[packed.Linear], timer: object) -> tuple[bool, ...]:
        packed._chosen[packed._sample(layers)[1]] = every
        return every

    with pytest.MonkeyPatch.context() as mp:
        if packed.onednn_available():
            mp.setattr(packed, "_chosen", {})
            mp.setattr(packed, "_choose", choose)
        yield
