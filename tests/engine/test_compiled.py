"""Decode and verify forwards compiled with torch.compile on CPU (service/engine/compiled.py).

Every other engine test runs the compiled path too (it is the CPU default); these compare it with
`enforce_eager` and check what the compilation itself promises: compiled before the first request, nothing
compiled again for a weight push or a second engine of the same layout, the KV cache written in place, and
eager forwards where no C++ compiler exists."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_same, assert_same_up_to_near_ties, make_checkpoint, peaked_checkpoint

from service.config import EngineConfig
from service.engine import compiled
from service.engine.llm_engine import LLMEngine
from service.models import attention
from service.models.loader import load_model
from service.params import SamplingParams

PROMPTS = [[5, 6, 7], list(range(40, 70)), [300], [9, 8, 7, 6, 5], [17] * 12]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


def engine_on(target, eager: bool, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(target), max_model_len=200, max_num_seqs=16, enforce_eager=eager, **kw))


@pytest.mark.parametrize("spec", [dict(), dict(drafter="draft", spec="fixed", spec_k=3),
                                  dict(drafter="draft,suffix")], ids=["plain", "draft-k3", "adaptive"])
def test_compiled_forwards_match_eager(target, draft, spec):
    if "drafter" in spec:
        spec = dict(spec, drafter=spec["drafter"].replace("draft", str(draft), 1))
    eager = engine_on(target, True, **spec)
    fast = engine_on(target, False, **spec)
    assert eager.runner.target.compiled is None and fast.runner.target.compiled is not None
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 40, 25, 3, 33)]
    want, got = eager.generate(PROMPTS, params), fast.generate(PROMPTS, params)
    if spec.get("spec") == "fixed":  # the same k every step: the same verify shapes as eager
        assert_same(want, got, atol=1e-4)
        assert fast.drafters["draft"].cached.compiled is not None and fast.stats.spec_drafts > 0
    else:  # adaptive picks k by timing: other shapes, other rounding of near-ties
        assert_same_up_to_near_ties(want, got, atol=1e-4)


@pytest.mark.parametrize("kernel", attention.KERNELS)
def test_compiled_before_the_first_request_and_never_again_for_a_push(target, draft, kernel, monkeypatch):
    """Start-up compiles the decode and verify variants; serving them (any batch, any k, any cache length, with
    either attention kernel), pushing a new target and starting a second engine of the same layout compile
    nothing more."""
    monkeypatch.setattr(attention, "choose", lambda *a, **kw: (kernel,) * 8)
    engine = engine_on(target, False, drafter=f"{draft},suffix")
    start = compiled.compiles()
    engine.generate(PROMPTS, GREEDY)
    many = [[i + 1] * 20 for i in range(16)]  # 16 rows x 60+ keys: past the bmm kernel's tiny-size hand-over
    engine.generate(many, SamplingParams(temperature=1.0, max_tokens=48, seed=3, ignore_eos=True))
    engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=30, seed=1))
    assert engine.stats.spec_drafts > 0
    other = peaked_checkpoint(seed=2)
    engine.swap_target(load_model(other, torch.float32, torch.device("cpu")), "1")
    got = engine.generate(PROMPTS, GREEDY)
    engine_on(target, False, drafter=f"{draft},suffix")
    assert compiled.compiles() == start
    # The pushed weights are what the compiled code computes with (parameters are inputs, not constants).
    assert_same_up_to_near_ties(engine_on(other, True, drafter=f"{draft},suffix").generate(PROMPTS, GREEDY), got,
                                atol=1e-4)


def test_a_fresh_process_compiles_nothing_after_start_up(target, draft, tmp_path):
    """The tests around run after others have compiled for these layouts; a server compiles from nothing. Its
    first compiles are the warm-up's, at 16 rows here, the same as the cache's slot count and the head size:
    sizes a compile could tie to one another, making a variant that serves that batch size alone. Long caches
    run other kernels here, and batched steps others than one-row ones (as the cpp kernel is chosen), so their
    variants are compiled at start-up too."""
    code = ("from service.config import EngineConfig\nfrom service.engine import compiled\n"
            "from service.engine.llm_engine import LLMEngine\nfrom service.models import attention\n"
            "from service.params import SamplingParams\n"
            "attention.choose = lambda *a, **kw: ('sdpa',) * 4 + ('cpp', 'sdpa', 'cpp', 'bmm')\n"
            f"e = LLMEngine(EngineConfig(model={str(target)!r}, drafter={f'{draft},suffix'!r},"
            f" max_model_len={attention.LONG_KEYS + 64}, max_num_seqs=16))\n"
            "start = compiled.compiles()\n"
            f"for rows, prompt in ((16, 20), (5, 20), (1, 20), (3, 20), (3, {attention.LONG_KEYS - 16})):\n"
            "    e.generate([[i + 1] * prompt for i in range(rows)],"
            " SamplingParams(temperature=1.0, max_tokens=30, seed=rows, ignore_eos=True))\n"
            "print('spec_drafts', e.stats.spec_drafts, 'compiled after start-up', compiled.compiles() - start)\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"spec_drafts (\d+) compiled after start-up (\d+)", proc.stdout)
    assert found and int(found[1]) > 0, proc.stdout
    assert int(found[2]) == 0, proc.stdout


def test_a_background_compile_serves_at_once_then_switches_and_compiles_nothing_more(target, draft, tmp_path):
    """`compile_background` (what `specroll serve` runs): the engine answers before its forwards are compiled,
    eagerly, with the eager engine's tokens; a thread compiles them on scratch caches (in a fresh process: dynamo
    traces every variant, seconds of work, so it is still compiling when the first requests are answered). At the
    first step after it is done, the compiled forwards of the target and the draft model serve, the adaptive
    strategy measures step costs afresh, and serving compiles nothing more: the scratch caches' guards are the
    serving caches' (made in inference mode, they were not, and every variant compiled again after the switch).
    No plain fx trace runs on the compiling thread: it patches every module's __call__ for the whole process, and an
    eager step meanwhile failed ("module is not installed as a submodule", one CI run)."""
    code = f"""
import json
import sys
import threading
import torch.fx
from helpers import assert_same_up_to_near_ties
from service.engine.background_compile import THREAD_NAME
traces = {{"plain": 0, "any": 0}}  # on the compiling thread: plain fx.Tracer ones (they resolve foreign modules)
_trace = torch.fx.Tracer.trace
def trace(self, root, *args, **kwargs):
    if threading.current_thread().name == THREAD_NAME:
        traces["any"] += 1
        traces["plain"] += type(self).call_module is torch.fx.Tracer.call_module
    return _trace(self, root, *args, **kwargs)
torch.fx.Tracer.trace = trace
from service.config import EngineConfig
from service.engine import compiled
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams
kw = dict(model={str(target)!r}, drafter={f"{draft},suffix"!r}, max_model_len=200, max_num_seqs=16)
prompts, greedy = {PROMPTS!r}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
eager = LLMEngine(EngineConfig(enforce_eager=True, **kw)).generate(prompts, greedy)
e = LLMEngine(EngineConfig(compile_background=True, **kw))
out = dict(eager_at_first=e.runner.target.compiled is None and e.drafters["draft"].cached.compiled is None,
           switch_while=sys.getswitchinterval())
assert_same_up_to_near_ties(eager, e.generate(prompts, greedy), atol=1e-4)
out.update(answered_while_compiling=not e.compiling.done, costs_measured=e.strategy.costs.model.measured,
           gauge_while_compiling=e.snapshot().compiling)
assert e.compiling.wait(600)
out.update(switch_after=sys.getswitchinterval())
e.add_request([5, 6], SamplingParams(max_tokens=2))
e.step()  # a prefill step: the switch, and no step cost measured after it
out.update(switched=e.runner.target.compiled is not None and e.drafters["draft"].cached.compiled is not None,
           costs_forgotten=not e.strategy.costs.model.measured, compiled=e.compiling is None,
           gauge_after=e.snapshot().compiling)
start = compiled.compiles()
for rows in (16, 5, 1):
    e.generate([[i + 1] * 20 for i in range(rows)], SamplingParams(temperature=1.0, max_tokens=30, seed=rows))
assert_same_up_to_near_ties(eager, e.generate(prompts, greedy), atol=1e-4)
out.update(compiled_after_switch=compiled.compiles() - start, spec_drafts=e.stats.spec_drafts, traces=traces)
print("RESULT", json.dumps(out))
"""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"RESULT (.*)", proc.stdout)
    assert found, proc.stdout
    got = json.loads(found[1])
    assert got["eager_at_first"] and got["answered_while_compiling"] and got["costs_measured"], got
    assert got["gauge_while_compiling"] and not got["gauge_after"], got  # specroll:compiling
    # the GIL changes hands every 0.1 ms while the thread compiles (eager steps waited 5 ms an op), then 5 ms again
    assert (got["switch_while"], got["switch_after"]) == (pytest.approx(1e-4), 0.005), got
    assert got["switched"] and got["costs_forgotten"] and got["compiled"], got
    assert got["compiled_after_switch"] == 0 and got["spec_drafts"] > 0, got
    assert got["traces"]["any"] > 0 and got["traces"]["plain"] == 0, got  # make_fx's traces only


def test_a_background_compile_leaves_no_plain_fx_trace_to_its_thread(tmp_path):
    """The process's one plain fx trace (inductor's, at its first codegen) runs when a background compile is set up,
    on the engine's thread, not on the compiling one while the engine serves: such a trace patches every module's
    __call__ for the whole process and failed an eager step meanwhile (one CI run). A fresh process and inductor
    cache, so inductor generates code; a tiny function is enough to reach that trace."""
    code = """
import threading
import torch
import torch.fx
from service.engine.background_compile import THREAD_NAME, BackgroundCompile
plain = []
_trace = torch.fx.Tracer.trace
def trace(self, root, *args, **kwargs):
    if type(self).call_module is torch.fx.Tracer.call_module:
        plain.append(threading.current_thread().name)
    return _trace(self, root, *args, **kwargs)
torch.fx.Tracer.trace = trace
assert BackgroundCompile([]).wait(60)  # nothing to compile: what setting one up does
thread = threading.Thread(target=lambda: torch.compile(lambda x: torch.sigmoid(x) * 2 + 1)(torch.randn(4, 8)),
                          name=THREAD_NAME)
thread.start()
thread.join()
print("PLAIN", ",".join(plain))
"""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"PLAIN (.*)", proc.stdout)
    assert found, proc.stdout
    assert found[1] == "MainThread", found[1]  # traced once, up front; none on the compiling thread


def test_kernels_for_long_caches_are_compiled_before_the_first_request_too(target, draft, monkeypatch):
    """Where decode and verify over a long cache run other attention kernels than over a short one, start-up
    compiles those variants as well: a rollout whose rows grow past `attention.LONG_KEYS` compiles nothing."""
    monkeypatch.setattr(attention, "choose", lambda *a, **kw: ("bmm", "sdpa", "sdpa", "bmm") * 2)
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=attention.LONG_KEYS + 64, max_num_seqs=4,
                                    drafter=str(draft), spec="fixed", spec_k=3))
    start = compiled.compiles()
    prompts = [[7 + i] * (attention.LONG_KEYS - 20) for i in range(3)]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 40 for o in out) and engine.stats.spec_drafts > 0
    assert compiled.compiles() == start


def test_sizes_equal_by_chance_at_warm_up_stay_apart(tmp_path):
    """With 8 cache slots the batched variants compile at 8 rows, whose decode writes 8 slots. Where such sizes
    became one (torch's duck sizing: a storage offset of 8 into the positions' tensor taken as the slot count),
    every batch of another size compiled its variant mid-rollout, with its loops chosen for that size. A layout
    no other test compiles, so no variant of an earlier test can serve these steps."""
    model = make_checkpoint("llama", tied=False, hidden_size=48, head_dim=12, intermediate_size=96,
                            root=tmp_path)
    engine = LLMEngine(EngineConfig(model=str(model), max_model_len=64, max_num_seqs=8))
    start = compiled.compiles()
    for rows in (3, 8, 5):
        out = engine.generate([[5 + i, 6, 7] for i in range(rows)], GREEDY)
        assert len(out) == rows
    assert compiled.compiles() == start


def test_compiled_decode_steps_write_the_engines_cache(target):
    engine = engine_on(target, False)
    cache = engine.runner.cache
    k_before = cache.k.clone()
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    # Slot 0, positions 0-6: the prompt's 3 (eager prefill) and 4 fed back by compiled decode steps.
    written = (cache.k[:, 0, :, :8] != k_before[:, 0, :, :8]).any(-1)  # [layers, Hkv, 8 positions]
    assert written[:, :, :7].all() and not written[:, :, 7].any()


def test_without_a_cxx_compiler_forwards_stay_eager(target, tmp_path):
    """A PATH without g++ (as in a slim container): the engine logs it and serves eagerly, with the library
    attention kernels."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from service.config import EngineConfig\nfrom service.engine.llm_engine import LLMEngine\n"
            "from service.params import SamplingParams\n"
            f"e = LLMEngine(EngineConfig(model={str(target)!r}, max_model_len=64, max_num_seqs=2))\n"
            "assert e.runner.target.compiled is None and 'cpp' not in e.runner.target.attn_kernels\n"
            "out = e.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))\n"
            "print('tokens', len(out[0].outputs[0].token_ids))\n")
    env = {"PATH": str(bindir), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HOME": os.environ.get("HOME", str(tmp_path)), "SPECROLL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens 4" in proc.stdout
    assert "no C++ compiler" in proc.stderr and "the cpp attention kernel is not available" in proc.stderr


def test_without_python_headers_forwards_stay_eager(tmp_path, monkeypatch, caplog):
    """A compiler but no Python.h (a Debian python3 without python3-dev): inductor's kernels, Python extensions,
    would fail to build at the engine's warm-up, so the engine stays eager and says why."""
    if not compiled.available.__wrapped__():
        pytest.skip("torch.compile cannot build CPU code here (no C++ compiler or no Python headers)")
    monkeypatch.setattr(compiled.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert not compiled.available.__wrapped__()
    assert "no Python headers" in caplog.text


def test_batched_variants_compile_their_loops_for_all_threads(target, tmp_path):
    """The batched decode variant is compiled at a serving size (`CachedModel.warm_up`), so inductor runs its
    fused loops on all the engine's threads; compiled at batch 2 over 2 positions they all ran on one thread, and
    the demo model decoded batch 64 at 0.6x the speed. Checked in inductor's generated code, in a fresh process
    and cache (a cached compile would not show it), on the MLP's SiLU loop: its size is batch x intermediate
    size alone (attention's loops also grow with the cache, so they may run in parallel at batch 2 already)."""
    code = ("from service.config import EngineConfig\nfrom service.engine.llm_engine import LLMEngine\n"
            f"e = LLMEngine(EngineConfig(model={str(target)!r}, max_model_len=200, max_num_seqs=16, num_threads=2))\n"
            "assert e.runner.target.compiled is not None\n")
    cache = tmp_path / "inductor"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache),
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Every file: a model forward's code names `specroll.linear` only where start-up timing chose the packed
    # kernel (service/models/packed.py), and the SiLU loops come from the MLP alone
    kernels = [k for p in cache.rglob("*.py")
               for k in re.findall(r"(cpp_fused_\w+) = async_compile\.cpp_pybinding\((.*?)\'\'\'\)", p.read_text(),
                                   re.S)]
    silu = [body for name, body in kernels if "silu" in name]
    assert len(silu) >= 2  # the batch-1 and the batched variant's (one per layer each)
    assert any("#pragma omp parallel" in body for body in silu)
