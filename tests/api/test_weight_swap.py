"""The swap of a weight push on a real server: staged weights come laid out for the CPU's kernels (float32 in
the layout its kernels want, oneDNN packs), so the engine thread only swaps references; a reused spare is laid out
anew (stale packs would serve the old weights); `--weight-spare` decides when the push buffer is made."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_checkpoint
from probes import wait_for
from service_utils import ADMIN, checkpoint_tensors, perturbed, start_server, write_checkpoint

from client import SpecrollClient
from service.app import BackgroundServer
from service.cli import build_parser, cmd_serve
from service.config import ConfigError, EngineConfig
from service.models import packed

EAGER = {"enforce_eager": True, "drafter": "none"}
PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11], [300, 2]]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "raw_logprobs": True}
SAMPLED: dict[str, Any] = {"temperature": 0.9, "seed": 4, "max_tokens": 12, "ignore_eos": True,
                           "raw_logprobs": True}


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return make_checkpoint("qwen2", tied=False, dtype=torch.float32)


@pytest.fixture(scope="module")
def pushes(base_dir) -> list[dict[str, torch.Tensor]]:
    base = checkpoint_tensors(base_dir)
    return [perturbed(base, seed=1), perturbed(base, seed=2)]


def _serving(srv: BackgroundServer) -> torch.nn.Module:
    return srv.server.backend.loop.engine.runner.model


def _outputs(srv: BackgroundServer) -> list[tuple[list[int], list[float], list[float]]]:
    """One request at a time: the batches, hence the kernels' row counts and roundings, are the same on both."""
    with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
        comps = [c.generate([p], **params)[0] for params in (GREEDY, SAMPLED) for p in PROMPTS]
    return [(s.token_ids, s.logprobs, s.raw_logprobs) for comp in comps for s in comp.samples]


def test_a_float32_push_is_laid_out_before_its_swap(every_row_class_packed, base_dir, pushes, monkeypatch):
    """Staged weights, a new module (first push) and then the replaced ones (the spare), are laid out before the
    commit; the engine thread lays out nothing."""
    srv = start_server(base_dir, engine_kw={**EAGER, "weight_spare": "on-demand"})
    try:
        backend = srv.server.backend
        laid_out_on: list[str] = []  # the threads that laid out: whole models, or layers as their bytes landed
        real_model, real_layer = packed.pack_linears, packed._lay_out

        def whole(model: torch.nn.Module, timer: Any = None) -> int:
            laid_out_on.append(threading.current_thread().name)
            return real_model(model, timer)

        def layer(m: packed.Linear, *args: Any) -> None:
            laid_out_on.append(threading.current_thread().name)
            real_layer(m, *args)

        monkeypatch.setattr(packed, "pack_linears", whole)
        monkeypatch.setattr(packed, "_lay_out", layer)
        replaced = _serving(srv)
        for i, weights in enumerate(pushes):
            laid_out_on.clear()
            staged = backend.stage_weights("target", weights.items())
            assert laid_out_on and "specroll-engine" not in laid_out_on, laid_out_on  # laid out while staging
            module = staged.payload
            assert (module is replaced) == (i == 1)  # the second push loads into the weights the first replaced
            layers = [m for m in module.modules() if isinstance(m, packed.Linear)]
            assert layers and packed.prepared(module)
            # float32: stored as pushed where the packed copies serve the small products, else transposed
            assert all(m.weight.is_contiguous() == packed.onednn_available() for m in layers)
            if packed.onednn_available():
                assert all(m.packed is not None for m in layers)
            replaced = _serving(srv)
            backend.commit_weights(staged, f"v{i}", "keep").result(120)
            assert _serving(srv) is module
            assert "specroll-engine" not in laid_out_on, laid_out_on  # the commit only swapped references
    finally:
        srv.stop()


def test_back_to_back_float32_pushes_serve_exactly_the_pushed_weights(every_row_class_packed, base_dir, pushes,
                                                                      tmp_path):
    """Spare made at start: the first push loads into it, the second into the weights the first replaced (laid
    out for the start weights until that push lays them out again). Outputs then equal a fresh server's on the
    pushed weights: greedy and sampled tokens, logprobs and raw logprobs."""
    srv = start_server(base_dir, engine_kw={**EAGER, "weight_spare": "start"})
    try:
        stager = srv.server.backend.stager
        spare, original = stager.spare("target"), _serving(srv)
        assert spare is not None and spare is not original
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            first = c.push_weights(pushes[0], "p1", mode="keep")
            assert _serving(srv) is spare and stager.spare("target") is original
            second = c.push_weights(pushes[1], "p2", mode="keep")
            assert _serving(srv) is original and stager.spare("target") is spare
        assert first.swap_seconds >= 0 and second.swap_seconds >= 0  # the server reports its hold
        got = _outputs(srv)
    finally:
        srv.stop()
    fresh = start_server(write_checkpoint(base_dir, pushes[1], tmp_path / "p2"), engine_kw=EAGER)
    try:
        want = _outputs(fresh)
    finally:
        fresh.stop()
    assert got == want


@pytest.mark.parametrize("policy", ["on-demand", "free"])
def test_without_a_spare_at_start_the_first_push_makes_its_buffer(base_dir, pushes, policy):
    srv = start_server(base_dir, engine_kw={**EAGER, "weight_spare": policy})
    try:
        stager = srv.server.backend.stager
        assert stager.spare("target") is None
        original = _serving(srv)
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            c.push_weights(pushes[0], "p1", mode="keep")
        assert _serving(srv) is not original
        assert stager.spare("target") is (original if policy == "on-demand" else None)
    finally:
        srv.stop()



def _status_mb(field: str = "VmRSS") -> float:
    """This process's `field` of /proc/self/status (VmRSS: resident now; VmHWM: its peak) in MB."""
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith(field + ":")) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the resident set from /proc")
def test_free_gives_the_replaced_weights_back_to_the_os():
    """`--weight-spare free` holds one copy between pushes: the replaced weights (and their packs) are freed and
    the heap trimmed once the swap drops them. Without the trim, glibc kept their pages: the server grew by
    about a model per push over its first pushes."""
    base = make_checkpoint("qwen2", tied=False, hidden_size=1024, intermediate_size=2816, num_layers=8,
                           vocab_size=8192, dtype=torch.bfloat16)
    new = perturbed(checkpoint_tensors(base), seed=9)
    model_mb = sum(t.numel() * t.element_size() for t in new.values()) / 2**20
    srv = start_server(base, engine_kw={**EAGER, "dtype": "bfloat16", "weight_spare": "free"})
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            c.generate_one([1, 2, 3], max_tokens=4, temperature=0.0)
            start = _status_mb()
            for i in range(3):
                c.push_weights(new, f"free-{i}", mode="keep")
            # kept, the replaced copies (weights and packs) grow it by more than a model over these pushes; the rest
            # of the process (other modules' servers gone before) moves it by tens of MB
            wait_for(lambda: _status_mb() < start + model_mb, timeout=20,
                     what=f"the resident set back within a model ({model_mb:.0f} MB) of {start:.0f} MB",
                     detail=lambda: f"{_status_mb():.0f} MB")
            assert srv.server.backend.stager.spare("target") is None
    finally:
        srv.stop()


def _packs_mb(model: torch.nn.Module) -> float:
    return sum(m.packed.numel() * m.packed.element_size() for m in model.modules()
               if isinstance(m, packed.Linear) and m.packed is not None) / 2**20


@pytest.mark.skipif(not Path("/proc/self/clear_refs").is_file(), reason="resets the peak resident set in /proc")
def test_a_push_into_a_reused_spare_peaks_near_the_spare(every_row_class_packed, tmp_path):
    """A push drops the spare's old packs before laying out new ones, and their memory goes back to the OS then,
    not at the end: those packs were allocated on other threads (here the start's), whose glibc arenas the new
    packs are not all drawn from, so kept they made the push peak above the server before it by up to a set of
    packs (docs/measurements.md has the bench's runs)."""
    if not packed.onednn_available():
        pytest.skip("no oneDNN here: no packed copies to replace")
    base = make_checkpoint("qwen2", tied=False, hidden_size=1024, intermediate_size=2816, num_layers=4,
                           vocab_size=4096, dtype=torch.float32)
    new = [write_checkpoint(base, perturbed(checkpoint_tensors(base), seed=s), tmp_path / f"p{s}") for s in (3, 4)]
    srv = start_server(base, engine_kw={**EAGER, "weight_spare": "start"})
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            c.load_weights(str(new[0]), "peak-1", mode="keep")  # into the spare made at start: its packs are new
            packs_mb = _packs_mb(_serving(srv))
            assert packs_mb > 100
            before = _status_mb()
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
            c.load_weights(str(new[1]), "peak-2", mode="keep")  # into the start's model, packed at start
            peak = _status_mb("VmHWM")
    finally:
        srv.stop()
    # kept, a share of those packs (how much depends on which arenas the threads drew) stays beside the new ones;
    # returned first, a folder load adds only its own few buffers
    assert peak - before < packs_mb / 8, f"peak {peak:.0f} MB, {before:.0f} MB before, packs {packs_mb:.0f} MB"


def test_the_weight_spare_setting_is_checked():
    with pytest.raises(ConfigError, match="weight_spare must be one of start, on-demand, free"):
        EngineConfig(model="m", weight_spare="twice")
    args = build_parser().parse_args(["serve", "--weight-spare", "start", "--free-replaced-weights"])
    with pytest.raises(ValueError, match="contradicts --weight-spare start"):
        cmd_serve(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--weight-spare", "later"])
