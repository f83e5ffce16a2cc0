"""The engine inbox's messages check what they carry where they are built, and a stopped loop takes none."""

from __future__ import annotations

import pytest

from service.backend.base import NotReady, Staged
from service.engine.inbox import CommitWeights, Pause, Resume
from service.engine.loop import EngineLoop


def test_a_message_checks_its_mode_once_where_it_is_built() -> None:
    assert Pause("ABORT").mode == "abort" and Pause("").mode == "wait"
    with pytest.raises(ValueError, match="mode must be one of"):
        Pause("later")
    assert CommitWeights(Staged("target", 0), "v2", "Keep").mode == "keep"
    with pytest.raises(ValueError, match="mode must be one of"):
        CommitWeights(Staged("target", 0), "v2", "soon")
    # a drafter commit never holds generation back, whatever mode it was sent with
    assert CommitWeights(Staged("drafter", 0), "d2", "wait").mode == "keep"


def test_a_stopped_loop_takes_no_more_messages() -> None:
    loop = EngineLoop(lambda: None)  # never started: stop posts the shutdown, which closes the inbox
    loop.stop()
    with pytest.raises(NotReady, match="shutting down"):
        loop.resume()
    with pytest.raises(NotReady):
        loop.post(Resume())
