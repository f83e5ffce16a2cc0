"""Timed kernel choices are remembered per machine (service/models/remembered.py): a later start picks what the
first one timed, so its compiled forwards are the same graphs and inductor's cache serves them."""

from __future__ import annotations

import json

import pytest
import torch

from service.models import attention, packed, remembered

CPU = torch.device("cpu")


@pytest.fixture()
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    return tmp_path


def test_a_choice_is_timed_once_per_machine_and_thread_count(cache_root):
    calls = []

    def choose(value):
        return lambda: calls.append(value) or (value, "bmm")

    assert remembered.remembered("kind", (1, "x"), choose("sdpa")) == (("sdpa", "bmm"), False)
    assert remembered.remembered("kind", (1, "x"), choose("cpp")) == (("sdpa", "bmm"), True)  # not timed again
    assert remembered.remembered("kind", (2, "x"), choose("cpp")) == (("cpp", "bmm"), False)  # another key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert remembered.remembered("kind", (1, "x"), choose("cpp")) == (("cpp", "bmm"), False)
    finally:
        torch.set_num_threads(threads)
    assert calls == ["sdpa", "cpp", "cpp"]
    assert len(json.loads((cache_root / remembered.FILE).read_text())) == 3


def test_a_damaged_or_unwritable_file_means_timing_again(cache_root, caplog):
    (cache_root / remembered.FILE).write_text("{not json")
    assert remembered.remembered("kind", (1,), lambda: (True,)) == ((True,), False)
    assert remembered.remembered("kind", (1,), lambda: (False,)) == ((True,), True)  # rewritten whole
    blocked = cache_root / "file"
    blocked.write_text("")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SPECROLL_CACHE", str(blocked / "below"))  # a folder under a file: cannot be made
        assert remembered.remembered("kind", (1,), lambda: (False,)) == ((False,), False)
    assert "cannot remember timed choices" in caplog.text


def test_the_engines_attention_kernels_are_timed_at_the_first_start_only(cache_root, monkeypatch):
    timed = []

    def fake_median(fn, reps=3):  # bmm fastest everywhere
        name = fn.__defaults__[0][4]
        timed.append(name)
        return {"sdpa": 2.0, "bmm": 1.0, "cpp": 3.0}[name]

    monkeypatch.setattr(attention, "median_seconds", fake_median)
    monkeypatch.setattr(attention, "_chosen", {})
    first = attention.choose(2, 3, 16, torch.float32, CPU)
    assert timed and set(first) == {"bmm"}
    timed.clear()
    monkeypatch.setattr(attention, "_chosen", {})  # a new process
    assert attention.choose(2, 3, 16, torch.float32, CPU) == first and not timed
    monkeypatch.setattr(attention, "_chosen", {})
    assert attention.choose(2, 3, 16, torch.float32, CPU, lambda fn: 1.0) == ("sdpa",) * 8  # a given timer times


def test_a_changed_cpp_kernel_is_timed_again(cache_root, monkeypatch, tmp_path):
    if not attention.usable("cpp", torch.float32, 16):
        pytest.skip("the cpp attention kernel is not built here")
    timed = []
    monkeypatch.setattr(attention, "median_seconds", lambda fn, reps=3: timed.append(1) or 1.0)
    monkeypatch.setattr(attention, "_chosen", {})
    attention.choose(2, 3, 16, torch.float32, CPU)
    assert timed
    timed.clear()
    edited = tmp_path / "cache_attention.cpp"  # what `usable` runs stays built; only the source the key reads moves
    edited.write_bytes(attention.attention_cpp.SOURCE.read_bytes() + b"// another version\n")
    monkeypatch.setattr(attention.attention_cpp, "SOURCE", edited)
    monkeypatch.setattr(attention, "_chosen", {})
    attention.choose(2, 3, 16, torch.float32, CPU)
    assert timed


def test_the_packed_linears_choice_is_timed_at_the_first_start_only(cache_root, monkeypatch):
    if not packed.onednn_available():
        pytest.skip("no oneDNN here: nothing is packed")
    calibrations = []
    monkeypatch.setattr(packed, "_chosen", {})
    monkeypatch.setattr(packed, "calibrate", lambda layers, timer: calibrations.append(len(layers)) or
                        (True,) * (len(packed.ROW_CLASSES) + 1))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(packed.Linear(64, 64), packed.Linear(64, 32))

    first = model()
    assert packed.pack_linears(first) == 2 and len(calibrations) == 1
    monkeypatch.setattr(packed, "_chosen", {})  # a new process
    second = model()
    assert packed.pack_linears(second) == 2 and len(calibrations) == 1  # remembered, and every layer packed
    assert all(m.packed is not None for m in second)
