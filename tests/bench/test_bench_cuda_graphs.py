"""bench/cuda_graphs.py's bookkeeping without a GPU: `--out` keeps what a run stopped at a time limit measured.
The measurement itself needs CUDA (the bench refuses to run without it) and runs on device loans
(bench/device_check.sh)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bench import cuda_graphs


class Stopped(Exception):
    """The time limit, as the timeout around the bench would stop it."""


@pytest.fixture
def fake_gpu(monkeypatch) -> SimpleNamespace:
    """CUDA reported present, and each (mode, batch, eager) measurement a fixed figure; `stop_after` calls, the
    next one raises `Stopped`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test device")
    state = SimpleNamespace(stop_after=None, calls=0)

    def measured(model, dtype, batch, new_tokens, repeats, eager, **kw):
        if state.calls == state.stop_after:
            raise Stopped
        state.calls += 1
        return (100.0 if eager else 250.0) * batch, 0.5

    monkeypatch.setattr(cuda_graphs, "tokens_per_s", measured)
    return state


def test_a_stopped_run_keeps_what_it_measured(fake_gpu, tmp_path) -> None:
    out = tmp_path / "graphs.json"
    fake_gpu.stop_after = 5  # plain at batches 1 and 2 (eager and graphs each), then stopped inside plain batch 4
    with pytest.raises(Stopped):
        cuda_graphs.main(["--model", str(tmp_path), "--batches", "1,2,4", "--out", str(out)])
    partial = json.loads(out.read_text())
    assert partial["complete"] is False
    assert set(partial["tokens_per_s"]) == {"plain_b1", "plain_b2"}
    assert partial["graphs_over_eager"] == {"plain_b1": 2.5, "plain_b2": 2.5}


def test_a_whole_run_writes_the_same_json_it_prints(fake_gpu, tmp_path, capsys) -> None:
    out = tmp_path / "graphs.json"
    assert cuda_graphs.main(["--model", str(tmp_path), "--batches", "1,2", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert printed["complete"] is True
    assert set(printed["tokens_per_s"]) == {f"{m}_b{b}" for m in cuda_graphs.MODES for b in (1, 2)}
