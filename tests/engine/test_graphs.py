"""Graphed decode / verify forwards (service/engine/cached_model.py).

On CPU the static-buffer forwards run without capture (`capture=False`): the same bucketing, padding and buffer
handling as on a GPU, compared with the eager step. The `cuda` tests capture real CUDA graphs and compare the
engine with and without them (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same, assert_same_up_to_near_ties, make_checkpoint, peaked_checkpoint
from reference import chi_square_pvalue, exact_joint

from service.config import EngineConfig
from service.engine import cached_model as graphs_mod
from service.engine import strategy_driver
from service.engine.cached_model import StepGraphs, key_buckets
from service.engine.llm_engine import LLMEngine
from service.engine.strategy import AdaptiveStrategy, Arm
from service.models.loader import load_model
from service.params import SamplingParams

PROMPTS = [[5, 6, 7], list(range(40, 70)), [300], [9, 8, 7, 6, 5], [17] * 12]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def engine_on(device: str, target, eager: bool, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(target), device=device, max_model_len=200, max_num_seqs=16,
                                  enforce_eager=eager, **kw))


def uncaptured(engine: LLMEngine) -> list[StepGraphs]:
    """Give the target (and a draft model) static-buffer forwards run without capture, as on a GPU."""
    cached = [engine.runner.target] + [d.cached for d in engine.drafters.values() if d.name == "draft"]
    for c in cached:
        c.graphs = StepGraphs(c, c.cache.num_slots, capture=False)
    return [c.graphs for c in cached]


def test_a_step_that_builds_a_graph_is_not_a_cost_measurement(target, draft, monkeypatch):
    engine = engine_on("cpu", target, True, drafter=f"{draft},suffix")
    uncaptured(engine)
    seen = []
    record = AdaptiveStrategy.record

    def spy(self, s, batch_size, seconds, *args, **kwargs):
        seen.append(seconds)
        record(self, s, batch_size, seconds, *args, **kwargs)

    monkeypatch.setattr(AdaptiveStrategy, "record", spy)
    engine.generate(PROMPTS, GREEDY)
    assert engine.runner.builds() > 0
    assert 0 < seen.count(None) <= engine.runner.builds()  # steps that built a graph: not timed
    assert sum(x is not None for x in seen) > seen.count(None)  # the others are


def test_key_buckets_double_up_to_the_cache():
    assert key_buckets(1000) == [128, 256, 512, 1000]
    assert key_buckets(128) == [128]


@pytest.mark.parametrize("spec", [dict(), dict(drafter="draft", spec="fixed", spec_k=3), dict(drafter="suffix")],
                         ids=["plain", "draft-k3", "suffix-adaptive"])
def test_padded_buckets_match_the_eager_step(target, draft, spec, monkeypatch):
    """Batches of 5 (bucket 8) draining to 1, keys crossing buckets of 16, 32, 64...: same output as eager."""
    monkeypatch.setattr(graphs_mod, "MIN_KEYS", 16)
    if spec.get("drafter") == "draft":
        spec = dict(spec, drafter=str(draft))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 40, 25, 3, 33)]
    want = engine_on("cpu", target, True, **spec).generate(PROMPTS, params)
    engine = engine_on("cpu", target, True, **spec)
    graphs = uncaptured(engine)
    assert_same(want, engine.generate(PROMPTS, params), atol=1e-4)
    for g in graphs:
        built = set(next(iter(g._graphs.values()))[2])
        assert {b for b, _, _ in built} >= {8, 1}  # padded batch buckets were used, down to one row
        assert len({L for _, _, L in built}) >= 2  # and several key buckets
    if spec.get("spec") == "fixed":
        assert len(graphs) == 2 and engine.stats.spec_drafts > 0
        assert any(q == 4 for _, q, _ in next(iter(graphs[0]._graphs.values()))[2])  # verify of k + 1 positions


def test_graphs_are_kept_per_model_across_pushes(target):
    """A push installs another model object: its own graphs; pushing the first one back finds its graphs."""
    engine = engine_on("cpu", target, True)
    [graphs] = uncaptured(engine)
    first = engine.runner.model
    engine.generate(PROMPTS[:2], GREEDY)
    built = graphs.built
    other = load_model(target, torch.float32, torch.device("cpu"))
    engine.swap_target(other, "1")
    engine.generate(PROMPTS[:2], GREEDY)
    assert graphs.built > built and len(graphs._graphs) == 2
    built = graphs.built
    engine.swap_target(first, "2")
    engine.generate(PROMPTS[:2], GREEDY)
    assert graphs.built == built  # the first model's graphs again


def run_suffix_steps(engine: LLMEngine, monkeypatch) -> list[tuple[list[int], object, int]]:
    """Generate choosing the suffix table at k = 8 on every step it has drafts for, as the strategy values it
    (`cut`: the verify pass the runner will run); per decode step (its proposals, that arm, the depth the
    runner verified)."""
    choose, seen = AdaptiveStrategy.choose, []

    def recorded(self, batch_size, proposals=None, room=None, catch_up=None):
        s = choose(self, batch_size, proposals, room, catch_up)
        if proposals:
            caps = [min(n, r) for n, r in zip(proposals["suffix"], room, strict=True)]  # within each row's room
            s = self.cut(Arm("suffix", 8), max(caps, default=0))
        seen.append(((proposals or {}).get("suffix"), s))
        return s

    monkeypatch.setattr(AdaptiveStrategy, "choose", recorded)  # slotted: patch the class
    monkeypatch.setattr(strategy_driver, "MAX_HOLD", 1)  # a choice per step
    params = SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=3, ignore_eos=True)
    engine.generate(PROMPTS, params)
    decode = [r for r in engine.stats.recent if r.kind != "prefill"]
    assert len(seen) == len(decode)
    return [(p, s, r.k) for (p, s), r in zip(seen, decode, strict=True)]


def test_the_strategy_prices_the_depth_a_graphed_runner_verifies(target, monkeypatch):
    """With graphs, a verify pass cut to the longest proposal runs at the next captured depth: the strategy
    values an arm at that depth too (`verified`), so the step it values is the step that runs and is recorded."""
    engine = engine_on("cpu", target, True, drafter="suffix")
    uncaptured(engine)
    engine.strategy.rounds_to_ks = True  # what the engine sets when it captures CUDA graphs (the cuda test)
    steps = [(p, s, k) for p, s, k in run_suffix_steps(engine, monkeypatch) if s.k]
    for proposals, s, ran in steps:
        assert ran == s.k and s.k in engine.strategy.ks, (proposals, s, ran)
    assert any(s.k > max(p) for p, s, _ in steps), steps  # rounded up (5 -> 6, 7 -> 8) at least once


# -- on a GPU -----------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_the_strategy_prices_the_depth_the_graphs_verify(target, monkeypatch):
    engine = engine_on("cuda", target, False, drafter="suffix")
    assert engine.strategy.rounds_to_ks
    for proposals, s, ran in run_suffix_steps(engine, monkeypatch):
        assert ran == s.k and (not s.k or s.k in engine.strategy.ks), (proposals, s, ran)


@pytest.mark.cuda
@pytest.mark.parametrize("spec", [dict(), dict(drafter="draft", spec="fixed", spec_k=4),
                                  dict(drafter="draft,suffix")], ids=["plain", "draft-k4", "adaptive"])
@pytest.mark.parametrize("dtype,atol", [("float32", 1e-3), ("bfloat16", 0.1)])
def test_cuda_graphs_match_eager(target, draft, spec, dtype, atol):
    if "drafter" in spec:
        spec = dict(spec, drafter=spec["drafter"].replace("draft", str(draft), 1))
    eager = engine_on("cuda", target, True, dtype=dtype, **spec)
    graphed = engine_on("cuda", target, False, dtype=dtype, **spec)
    want, got = eager.generate(PROMPTS, GREEDY), graphed.generate(PROMPTS, GREEDY)
    assert graphed.runner.target.graphs is not None and graphed.runner.target.graphs.built > 0
    assert eager.runner.target.graphs is None
    if dtype == "float32":
        assert_same_up_to_near_ties(want, got, atol)  # adaptive: timing-driven k, so other verify shapes
    else:  # bf16: near-ties may flip; the greedy output must mostly agree and logprobs stay close
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(want, got, strict=True))
        assert same >= len(PROMPTS) - 1
    if "fixed" in spec.values():
        assert graphed.drafters["draft"].cached.graphs.built > 0
        assert graphed.stats.spec_drafts > 0


@pytest.mark.cuda
def test_cuda_graphs_follow_a_weight_push(target, tmp_path):
    other_path = peaked_checkpoint(seed=2)
    engine = engine_on("cuda", target, False)
    before = engine.generate(PROMPTS, GREEDY)
    pushed = engine_on("cuda", other_path, True)
    engine.swap_target(pushed.runner.model, "1")
    assert_same(pushed.generate(PROMPTS, GREEDY), engine.generate(PROMPTS, GREEDY), atol=1e-3)
    assert before[0].outputs[0].token_ids != pushed.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)], ids=["t1.0", "t0.7-p0.9"])
def test_cuda_graphs_sample_the_target_distribution(tiny_vocab_model, kw, tmp_path):
    """Speculative sampling through graphed draft and verify forwards: the joint law of three tokens."""
    draft = make_checkpoint("llama", tied=False, vocab_size=16, seed=99, init_std=0.3)
    engine = LLMEngine(EngineConfig(model=str(tiny_vocab_model), device="cuda", max_model_len=32, max_num_seqs=400,
                                    drafter=str(draft), spec="fixed", spec_k=2))
    outs = engine.generate([[1, 2, 3]] * 100, [SamplingParams(n=200, max_tokens=3, seed=7000 + i, ignore_eos=True,
                                                              **kw) for i in range(100)])
    assert engine.runner.target.graphs.built > 0 and engine.stats.spec_draft_tokens > 0
    codes = [(a * 16 + b) * 16 + c for o in outs for a, b, c in (x.token_ids for x in o.outputs)]
    p = chi_square_pvalue(codes, exact_joint(tiny_vocab_model, [1, 2, 3], kw))
    assert p > 0.01, f"chi-square p={p:.4g}"
