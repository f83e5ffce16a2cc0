"""Speculative decoding is lossless: greedy equality, logprobs, and the sampled joint distribution."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from helpers import make_checkpoint, peaked_checkpoint, perturbed_copy
from reference import chi_square_pvalue, exact_joint, processed_probs

from service.config import EngineConfig, ModelConfig
from service.engine import strategy_driver
from service.engine.llm_engine import LLMEngine
from service.engine.speculative.arm_costs import arm_key
from service.engine.strategy import PLAIN, AdaptiveStrategy, Arm
from service.params import SamplingParams


@pytest.fixture(scope="module")
def target():
    return peaked_checkpoint()  # varied (non-looping) greedy output


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    return {
        "suffix": "suffix",
        "self": str(target),
        "near": str(perturbed_copy(target, root / "near", 0.05)),
        "llama": str(make_checkpoint("llama", tied=False, seed=3, hidden_size=32, num_layers=1)),
        "eagle": "eagle",
    }


def run(target, prompts, params, **kw):
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16, **kw))
    return engine, engine.generate(prompts, params)


def assisted(engine: LLMEngine, k: int, n: int = 1) -> LLMEngine:
    """Pin the draft model at k, assisted by the suffix table: rows it has n or more drafts for verify its."""
    engine.strategy.fixed = Arm("draft", k, assist=("suffix", n))
    return engine


def assisted_rows(engine: LLMEngine) -> tuple[float, float]:
    """Rows verified with the draft model's drafts and with the table's, at the first position (discounted)."""
    return engine.strategy.accept["draft"].trials[0], engine.strategy.accept["suffix"].trials[0]


PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [300], [17, 17, 17, 17, 2], list(range(40, 70))]


@pytest.mark.parametrize("name", ["suffix", "self", "near", "llama", "eagle"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_identical_with_sd(target, drafters, name, k):
    params = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)
    _, base = run(target, PROMPTS, params)
    engine, spec = run(target, PROMPTS, params, drafter=drafters[name], spec="fixed", spec_k=k)
    assert engine.stats.spec_drafts > 0
    for a, b in zip(base, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        torch.testing.assert_close(b.outputs[0].logprobs, a.outputs[0].logprobs, atol=1e-4, rtol=0)
        assert b.outputs[0].finish_reason == "length"


def test_stop_and_max_tokens_inside_an_accepted_run(target, drafters):
    """The target drafting for itself accepts everything, so stops land inside accepted runs."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    _, base = run(target, PROMPTS, params)
    checked_stops = 0
    for i, out in enumerate(base):
        toks = out.outputs[0].token_ids
        fresh = [j for j in range(6, 40) if toks[j] not in toks[:j]]  # a token that first appears at j
        cuts = [SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True)]  # ends mid-run
        if fresh:
            cuts.append(SamplingParams(temperature=0, max_tokens=60, stop_token_ids=(toks[fresh[0]],)))
            checked_stops += 1
        for cut in cuts:
            _, [plain] = run(target, [PROMPTS[i]], cut)
            engine, [spec] = run(target, [PROMPTS[i]], cut, drafter=drafters["self"], spec="fixed", spec_k=7)
            assert engine.stats.spec_accepted_tokens > 0
            assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
            assert spec.outputs[0].finish_reason == plain.outputs[0].finish_reason
    assert checked_stops >= 2


def test_no_row_verifies_drafts_past_its_token_budget(target, drafters):
    """The target drafting for itself accepts every draft it verifies. A row's drafts are limited to its room
    (its tokens left, less one), so every accepted draft is emitted, a pass no row has room for k in is cut, a
    batch with no room at all runs a plain step, and output is unchanged."""
    for budgets, want_ks in (((6, 6), [4]), ((5, 10), [7, 0])):  # rooms after the prefill's token: 4 / 3 and 8
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in budgets]
        _, base = run(target, PROMPTS[:2], params)
        engine, got = run(target, PROMPTS[:2], params, drafter=drafters["self"], spec="fixed", spec_k=7)
        steps = [r for r in engine.stats.recent if r.kind != "prefill"]
        assert [r.k for r in steps] == want_ks, steps
        assert all(r.emitted_tokens == r.accepted_tokens + r.batch_size for r in steps if r.k), steps
        for a, b in zip(base, got, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids


@pytest.mark.parametrize("name", ["suffix", "near", "eagle"])
def test_sampled_logprobs_equal_a_recompute(target, drafters, name):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    kw = dict(temperature=0.8, top_p=0.9, top_k=40)
    params = SamplingParams(max_tokens=30, seed=7, ignore_eos=True, raw_logprobs=True, top_logprobs=2, **kw)
    engine, outs = run(target, PROMPTS[:3], params, drafter=drafters[name], spec="fixed", spec_k=3)
    assert engine.stats.spec_drafts > 0
    for prompt, out in zip(PROMPTS[:3], outs, strict=True):
        comp = out.outputs[0]
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + comp.token_ids])).logits[0, len(prompt) - 1 : -1]
        for t, tok in enumerate(comp.token_ids):
            want = processed_probs(logits[t], **kw)[tok].log().item()
            assert abs(comp.logprobs[t] - want) < 1e-4
            assert abs(comp.raw_logprobs[t] - logits[t].log_softmax(-1)[tok].item()) < 1e-4


def test_the_draft_model_sees_the_prompts_with_the_targets_prefill(target, drafters, monkeypatch):
    """The prompts enter the draft cache with the target's prefill (one row per distinct prompt, forked to its
    samples like the target's), so the first proposal feeds each sample only its first output token; with SD
    off the draft model does no work at all."""
    params = SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    _, base = run(target, PROMPTS, params)
    for spec in ("fixed", "off"):
        engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16,
                                        drafter=drafters["llama"], spec=spec, spec_k=3))
        cached, fed = engine.drafters["draft"].cached, []
        extend = cached.extend
        monkeypatch.setattr(cached, "extend", lambda lo, starts, rows, extend=extend, fed=fed: (
            fed.append([len(r) for r in rows]), extend(lo, starts, rows))[1])
        got = engine.generate(PROMPTS, params)
        if spec == "off":
            assert fed == []
            continue
        assert sorted(fed[0]) == sorted(len(p) for p in PROMPTS), fed[:2]  # all admitted in one prefill
        assert fed[1] == [1] * len(PROMPTS) * 3, fed[:2]
        for a, b in zip(base, got, strict=True):
            assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]


def test_after_a_drafter_push_running_samples_catch_up_and_new_ones_do_not(target, drafters, monkeypatch):
    """A pushed draft model serves the next proposal: samples running at the push catch up on all their tokens
    with the new weights; samples admitted after it were prefilled with them and feed only their output."""
    from service.models.loader import load_model

    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16,
                                    drafter=drafters["llama"], spec="fixed", spec_k=3))
    cached, fed = engine.drafters["draft"].cached, []
    extend = cached.extend
    monkeypatch.setattr(cached, "extend", lambda lo, starts, rows: (fed.append([len(r) for r in rows]),
                                                                     extend(lo, starts, rows))[1])
    params = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)
    _, base = run(target, PROMPTS, params)
    for p in PROMPTS:
        engine.add_request(p, params)
    for _ in range(3):  # the prefill and two speculative steps
        engine.step()
    before = [s.num_tokens for s in engine.scheduler.running]
    engine.swap_drafter(load_model(drafters["llama"], engine.dtype, engine.device), "1")
    engine.step()
    assert fed[-1] == before  # every token of every running sample, again
    while engine.has_unfinished():
        engine.step()
    engine.swap_drafter(load_model(drafters["llama"], engine.dtype, engine.device), "2")
    fed.clear()
    got = engine.generate(PROMPTS, params)
    assert fed[1] == [1] * len(PROMPTS) * 2, fed[:2]  # the first proposal after the prefill
    for a, b in zip(base, got, strict=True):
        assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
    engine.swap_drafter(load_model(drafters["llama"], engine.dtype, engine.device), "3")
    engine.strategy.fixed = PLAIN  # no proposal after this push: what it keeps of the samples admitted since
    engine.generate(PROMPTS, params)  # ends with them
    assert not engine.drafters["draft"]._current


def test_a_drafter_push_restarts_what_the_strategy_knows_of_it(target, drafters):
    """The strategy measured the old weights: their acceptance does not hold for the pushed ones (another
    drafter's, the suffix table's, does)."""
    from service.models.loader import load_model

    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, drafter=f"{drafters['near']},suffix"))
    params = SamplingParams(n=4, temperature=0, max_tokens=24, ignore_eos=True)
    for fixed in (Arm("draft", 2), Arm("suffix", 2)):  # both measured
        engine.strategy.fixed = fixed
        engine.generate(PROMPTS, params)
    known = {name: engine.strategy.accept[name].trials[0] for name in ("draft", "suffix")}
    assert known["draft"] > 8 and known["suffix"] > 0
    engine.swap_drafter(load_model(drafters["near"], engine.dtype, engine.device), "1")
    assert engine.strategy.accept["draft"].trials == [0.0] * len(engine.strategy.accept["draft"].trials)
    assert engine.strategy.acceptance("draft") == pytest.approx([engine.strategy.prior_alpha] * max(engine.strategy.ks))
    assert engine.strategy.accept["suffix"].trials[0] == known["suffix"]


@pytest.mark.parametrize("name", ["near", "eagle"])
def test_a_drafter_says_what_it_will_catch_up_on_and_times_it(target, drafters, monkeypatch, name):
    """Before a step a draft model (an EAGLE head) says how many tokens it would feed beyond what follows its own
    step; the step reports those tokens and their seconds to the strategy (its catch-up price, kept out of the
    arm's). A draft model got the prompts with the target's prefill; an EAGLE head feeds them on its first
    proposal."""
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, drafter=drafters[name]))
    calls, record = [], AdaptiveStrategy.record
    CAUGHT_UP = 7  # record(s, batch_size, seconds, num_accepted, ran_k, num_drafted, assisted, caught_up, shadow)
    monkeypatch.setattr(AdaptiveStrategy, "record", lambda self, *a: (calls.append(a), record(self, *a))[1])
    engine.strategy.fixed = PLAIN
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(6):  # the prefill (the draft cache gets the prompts) and five plain steps
        engine.step()
    (key, drafter), = engine.drafters.items()
    seqs = list(engine.scheduler.running)
    assert [s.num_tokens - len(s.prompt_token_ids) for s in seqs] == [6] * len(seqs)
    # A draft model: 6 unseen outputs, 2 of which follow any draft step. An EAGLE head: every position before
    # the last token (its own step feeds what that step emitted).
    missed = 4 * len(seqs) if name == "near" else sum(s.num_tokens - 1 for s in seqs)
    assert drafter.catch_up(seqs) == missed
    engine.strategy.fixed = Arm(key, 3)
    engine.step()
    tokens, seconds = calls[-1][CAUGHT_UP]
    assert tokens == missed and seconds > 0
    assert drafter.catch_up(seqs) == 0  # caught up: the next step feeds what its own step left
    engine.step()
    assert calls[-1][CAUGHT_UP] == (0, 0.0)
    assert calls[-2][0].name == f"{key}:k=3" and calls[0][CAUGHT_UP] == (0, 0.0)
    if name == "eagle":  # (a draft model lets one token pass: its own step may leave two to feed)
        engine.strategy.fixed = PLAIN
        engine.step()
        assert drafter.catch_up(seqs) == len(seqs)  # the plain step's token


def test_switching_sd_on_mid_generation_does_not_re_prefill(target, drafters):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, base = run(target, PROMPTS, params)
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, drafter=drafters["near"]))
    engine.strategy.fixed = PLAIN
    for p in PROMPTS:
        engine.add_request(p, params)
    for _ in range(12):
        engine.step()
    prompt_tokens = engine.stats.prompt_tokens
    engine.strategy.fixed = Arm("draft", 3)
    seqs = list(engine.scheduler.running)
    before = [s.num_tokens for s in seqs]
    engine.step()  # the draft model catches up on every token it missed, in this one step
    assert all(s.draft_cached >= t for s, t in zip(seqs, before, strict=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.prompt_tokens == prompt_tokens  # no request was prefilled again
    for s, want in zip(seqs, base, strict=True):
        assert s.output_token_ids == want.outputs[0].token_ids


def test_suffix_verify_is_cut_to_the_longest_proposal(target, drafters, monkeypatch):
    """A suffix table that proposes fewer than k drafts for every row gets a verify pass of only as many
    positions (none: a plain step), with the same tokens and logprobs as the full-width pass."""
    params = SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=11, ignore_eos=True)
    cut, outs = run(target, PROMPTS, params, drafter="suffix", spec="fixed", spec_k=8)
    widths = [r.k for r in cut.stats.recent if r.kind != "prefill"]
    assert any(0 < k < 8 for k in widths) and 0 in widths and 8 in widths, widths

    full = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16, drafter="suffix",
                                  spec="fixed", spec_k=8))
    propose = full.drafters["suffix"].propose
    monkeypatch.setattr(full.drafters["suffix"], "propose",
                        lambda *a: dataclasses.replace(propose(*a), row_lengths=None))  # unknown: no cut
    want = full.generate(PROMPTS, params)
    assert {r.k for r in full.stats.recent if r.kind != "prefill"} == {8}
    for a, b in zip(want, outs, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert y.token_ids == x.token_ids
            torch.testing.assert_close(y.logprobs, x.logprobs, atol=1e-4, rtol=0)


def test_the_strategy_knows_what_the_suffix_table_has_for_each_row_before_it_chooses(target, drafters, monkeypatch):
    """Before each step the suffix table says how many drafts it has for each row: the strategy never runs
    it for a batch it has nothing for, never deeper than its longest proposal, and output is unchanged."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, base = run(target, PROMPTS, params)
    monkeypatch.setattr(strategy_driver, "MAX_HOLD", 1)  # a choice per step (none held: see the next test)
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16,
                                    drafter=f"{drafters['llama']},suffix"))
    choose, seen, budgets, catch_ups = AdaptiveStrategy.choose, [], [], []

    def recorded(self, batch_size, proposals=None, room=None, catch_up=None):
        s = choose(self, batch_size, proposals, room, catch_up)
        seen.append((batch_size, proposals, s))
        if proposals is not None:
            budgets.append(max(room) + 1)
            catch_ups.append(catch_up)
        return s

    monkeypatch.setattr(AdaptiveStrategy, "choose", recorded)  # slotted: patch the class
    table, model = engine.strategy.accept["suffix"], engine.strategy.accept["draft"]
    table.hits, table.trials = [1e4] * len(table.hits), [1e4] * len(table.trials)  # its drafts are right
    model.hits, model.trials = [0.0] * len(model.hits), [1e4] * len(model.trials)  # the draft model's are not
    got = engine.generate(PROMPTS, params)
    decode = [r for r in engine.stats.recent if r.kind != "prefill"]
    assert len(seen) == len(decode)
    for (batch_size, proposals, s), r in zip(seen, decode, strict=True):
        if proposals is None:  # a new bucket's plain probe: the table is not asked
            assert s == PLAIN
            continue
        assert len(proposals["suffix"]) == batch_size and "draft" not in proposals  # a draft model cannot tell
        if s.drafter == "suffix":
            assert 0 < s.k <= max(proposals["suffix"]) and r.k == s.k, (proposals, s, r.k)
    ran = {s.drafter for _, _, s in seen}
    assert "suffix" in ran, ran
    assert any(p is not None and max(p["suffix"]) == 0 for _, p, _ in seen)
    # The draft model (never picked: its drafts are wrong) says what it missed; a table never misses anything.
    assert all("suffix" not in c for c in catch_ups) and any(c.get("draft") for c in catch_ups), catch_ups
    # The batch's longest token budget left (30 per request, one token from the prefill), as it shrinks.
    assert budgets[0] <= 29 and min(budgets) >= 1 and budgets == sorted(budgets, reverse=True), budgets
    for a, b in zip(base, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids


def test_a_choice_that_costs_much_of_a_short_step_decides_the_next_steps_too(target, drafters, tmp_path,
                                                                             monkeypatch):
    """Where the strategy's choice costs more than CHOICE_SHARE of a step, it decides up to MAX_HOLD steps: the
    held steps run its arm (plain where the suffix table has nothing), in the batch it was chosen for, with the
    table's proposals for as many rows; every step is still measured. A push ends a hold. Output is unchanged."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, base = run(target, PROMPTS, params)

    def traced(share: float, name: str) -> tuple[LLMEngine, list[dict]]:
        monkeypatch.setattr(strategy_driver, "CHOICE_SHARE", share)
        path = tmp_path / name
        engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16,
                                        drafter=f"{drafters['llama']},suffix", strategy_trace=str(path)))
        got = engine.generate(PROMPTS, params)
        for a, b in zip(base, got, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
        return engine, [json.loads(line) for line in path.read_text().splitlines()]

    _, never = traced(1e9, "never.jsonl")  # every choice far under the share of its step
    assert not any(line["held"] for line in never)
    engine, lines = traced(1e-12, "always.jsonl")  # every drawn choice far over it
    assert len(lines) == len([r for r in engine.stats.recent if r.kind != "prefill"])
    held = [i for i, line in enumerate(lines) if line["held"]]
    assert len(held) >= 3, [(line["held"], line["batch"], line["arm"], line["proposed"]) for line in lines]
    run_length = 0
    for i in range(1, len(lines)):
        line, before = lines[i], lines[i - 1]
        run_length = run_length + 1 if line["held"] else 0
        if not line["held"]:
            continue
        assert run_length <= strategy_driver.MAX_HOLD - 1, i
        assert line["batch"] == before["batch"], (i, line, before)
        chosen = lines[i - run_length]
        assert line["arm"] in (chosen["arm"], "plain"), (i, line["arm"], chosen["arm"])
        assert line["proposed"] == before["proposed"] and line["host_ms"]["choose"] >= 0, (i, line, before)
    engine.driver._held = strategy_driver._Held(Arm("draft", 2), ((1,), (0,)), 3)  # as a choice leaves it
    engine.swap_drafter(copy.deepcopy(engine.drafter_weights()[1]), "2")
    assert engine.driver._held is None


def test_a_suffix_tables_drafts_are_measured_on_the_steps_another_drafter_ran(target, drafters, monkeypatch):
    """Steps that run the draft model still tell the strategy what the suffix table would have had accepted:
    each row's table drafts set against the tokens it emitted. Recomputed here from the final outputs: the
    draft model is the target itself, so greedy k = 2 steps emit min(3, tokens left) tokens per row. The
    second pass repeats the prompts, so the table (holding the first pass's rollouts) has them right."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, base = run(target, PROMPTS, params)
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16,
                                    drafter=f"{drafters['self']},suffix"))
    lookahead, record = type(engine.drafters["suffix"]).lookahead, AdaptiveStrategy.record
    looked, shadows = [], []

    def looking(self, seqs, k):
        drafts = lookahead(self, seqs, k)
        looked.append([(seq, seq.num_tokens, list(d)) for seq, d in zip(seqs, drafts, strict=True)])
        return drafts

    def recording(self, s, batch_size, seconds, *args, **kw):
        shadows.append(kw.get("shadow", args[5] if len(args) > 5 else None))
        return record(self, s, batch_size, seconds, *args, **kw)

    monkeypatch.setattr(type(engine.drafters["suffix"]), "lookahead", looking)
    monkeypatch.setattr(AdaptiveStrategy, "record", recording)
    monkeypatch.setattr(AdaptiveStrategy, "probes_plain", lambda self, batch_size: False)
    monkeypatch.setattr(AdaptiveStrategy, "choose", lambda self, *a, **kw: Arm("draft", 2))
    for _ in range(2):
        got = engine.generate(PROMPTS, params)
        for a, b in zip(base, got, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert len(looked) == len(shadows) and engine.strategy.accept["draft"].trials[0] > 0
    hits = trials = 0
    for rows, shadow in zip(looked, shadows, strict=True):
        want = []
        for seq, start, drafts in rows:
            tokens = seq.prompt_token_ids + seq.output_token_ids
            new = tokens[start : start + 3]  # what this step emitted
            observed = min(len(drafts), len(new))
            matched = next((j for j in range(observed) if drafts[j] != new[j]), observed)
            if drafts:
                want.append((matched, observed))
        assert shadow == {"suffix": want}
        hits, trials = hits + sum(m > 0 for m, _ in want), trials + len(want)
    assert trials > 20 and 0 < hits < trials  # the first pass's table misses some
    second = [m == o for rows, shadow in zip(looked, shadows, strict=True) if rows[0][0].request_id in
              {r.request_id for r in got} for m, o in shadow["suffix"]]
    assert second and all(second)  # the rollouts of the first pass repeated
    assert engine.strategy.acceptance("suffix")[0] > 0.8  # never run: its prior, 0.6, without these


def test_the_strategy_starts_from_each_drafters_share_of_the_targets_work(target, drafters):
    """Before measuring, a draft position costs the strategy its drafter's multiply-adds over the target's: a
    draft model's by its config, the EAGLE head's (fc, one layer, the target's LM head), a suffix table's none."""
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=4,
                                    drafter=f"{drafters['llama']},suffix,eagle"))
    t, d = ModelConfig.from_dir(target), ModelConfig.from_dir(drafters["llama"])
    own = engine.strategy.own_costs
    assert own["draft"] == pytest.approx(d.macs_per_token / t.macs_per_token) and 0 < own["draft"] < own["eagle"] < 1
    assert own["suffix"] == 0 and engine.strategy.costs.model.own == [own[n] for n in engine.strategy.drafters]
    cost = {n: engine.strategy.costs.predict(arm_key(4, Arm(n, 2)), 4) for n in ("suffix", "draft", "eagle")}
    assert cost["suffix"] < cost["draft"] < cost["eagle"]


@pytest.mark.parametrize("name, kind", [("llama", "draft_model"), ("eagle", "eagle"), ("suffix", None)])
def test_a_push_finds_the_drafter_with_weights(target, drafters, name, kind):
    """The engine hands a push the drafter that has weights, behind a suffix table listed first, and serves the
    pushed module from then on; with no such drafter it has none to give and refuses a swap."""
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=4,
                                    drafter=",".join(dict.fromkeys(["suffix", drafters[name]]))))
    found = engine.drafter_weights()
    if kind is None:
        assert found is None
        with pytest.raises(ValueError, match="no drafter with weights"):
            engine.swap_drafter(torch.nn.Linear(2, 2), "1")
        return
    assert found is not None and found[0] == kind
    pushed = copy.deepcopy(found[1])
    engine.swap_drafter(pushed, "7")
    assert engine.drafter_weights() == (kind, pushed) and "@7" in engine.drafter_version
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    _, base = run(target, PROMPTS[:2], params)
    engine.strategy.fixed = Arm(next(n for n, d in engine.drafters.items() if d.weights_kind), 3)
    got = engine.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in base]


def test_the_strategy_trace_has_one_line_per_decode_step(target, drafters, tmp_path):
    """--strategy-trace: one JSON line per decode step, which together account for every token the steps
    emitted; a suffix arm's step reports no shadow rows for the table (its drafts ran). A trace file that
    breaks stops the trace, not the engine; one that cannot be opened is a configuration error."""
    from service.config import ConfigError

    path = tmp_path / "trace.jsonl"
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16,
                                    drafter=f"{drafters['llama']},suffix", strategy_trace=str(path)))
    params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=3)
    got = engine.generate(PROMPTS * 2, params)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    decode = [r for r in engine.stats.recent if r.kind != "prefill"]
    assert len(lines) == len(decode) > 0
    outputs = sum(len(r.outputs[0].token_ids) for r in got)
    assert sum(line["emitted"] for line in lines) == outputs - len(got)  # a prefill emits each row's first token
    arms = {a.name for a in engine.strategy.arms}
    for line in lines:
        assert line["arm"].split("+")[0] in arms and line["batch"] >= 1 and line["seconds"] > 0, line
        assert set(line["acceptance"]) == {"draft", "suffix"}
        host = line["host_ms"]
        assert set(host) == {"choose", "postprocess", "feedback"} and min(host.values()) >= 0, line
        assert host["choose"] + host["postprocess"] <= line["seconds"] * 1e3 + 0.002  # both within the step
        if line["arm"].startswith("suffix"):
            assert "suffix" not in line["shadow"] and line["drafted"] > 0, line
    assert any(line["shadow"].get("suffix", [0, 0])[1] for line in lines)
    assert all(line["host_ms"]["feedback"] > 0 and line["host_ms"]["postprocess"] > 0 for line in lines)
    assert any(line["host_ms"]["choose"] > 0 for line in lines)
    engine.driver.trace._file.close()  # the file breaks under the engine
    engine.generate(PROMPTS, params)
    assert engine.driver.trace is None
    with pytest.raises(ConfigError, match="strategy trace"):
        LLMEngine(EngineConfig(model=str(target), max_model_len=256, strategy_trace=str(tmp_path)))


def test_rows_a_table_has_enough_drafts_for_take_them_with_their_lengths():
    from service.engine.batch_tensors import DraftProposal

    own = DraftProposal(torch.full((3, 4), 7), torch.full((3,), 4), torch.rand(3, 4, 10), [4, 4, 4])
    table = DraftProposal(torch.arange(12).view(3, 4), torch.tensor([3, 1, 4]), None, [3, 1, 4])
    joint, use = own.take_rows(table, 2)
    assert use.tolist() == [True, False, True] and joint.one_hot_rows.tolist() == [True, False, True]
    assert joint.row_lengths == [3, 4, 4] and joint.longest == 4 and joint.lengths.tolist() == [3, 4, 4]
    assert joint.tokens[1].tolist() == [7] * 4 and joint.tokens[2].tolist() == [8, 9, 10, 11]
    assert joint.cut(2).row_lengths == [2, 2, 2] and joint.cut(2).longest == 2


def test_a_draft_model_assisted_by_the_suffix_table_is_lossless(target, drafters, monkeypatch):
    """Rows the table has drafts for verify the table's, the others the draft model's, in one step: greedy
    output and logprobs are plain decoding's, sampled logprobs match a recompute, and the draft model's cache
    stays right for rows whose accepted tokens it did not draft: its first draft is always its own greedy
    token after the sequence so far (recomputed by transformers from scratch)."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(n=3, temperature=0, max_tokens=37, ignore_eos=True)
    _, base = run(target, PROMPTS, params)
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16,
                                    drafter=f"{drafters['llama']},suffix"))
    draft_ref = AutoModelForCausalLM.from_pretrained(drafters["llama"], dtype=torch.float32).eval()
    model = engine.drafters["draft"]
    propose, checked = model.propose, []

    def checked_propose(seqs, k, sb):
        draft = propose(seqs, k, sb)
        for seq, first in zip(seqs, draft.tokens[:, 0].tolist(), strict=True):
            with torch.no_grad():
                logits = draft_ref(torch.tensor([seq.prompt_token_ids + seq.output_token_ids])).logits[0, -1]
            checked.append(first == logits.argmax().item())
        return draft

    monkeypatch.setattr(model, "propose", checked_propose)
    got = assisted(engine, 4).generate(PROMPTS, params)
    model_rows, table_rows = assisted_rows(engine)
    assert model_rows > 0 and table_rows > 0, (model_rows, table_rows)
    assert len(checked) > 100 and all(checked), checked.count(False)
    for a, b in zip(base, got, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert y.token_ids == x.token_ids
            torch.testing.assert_close(y.logprobs, x.logprobs, atol=1e-4, rtol=0)

    ref = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    kw = dict(temperature=0.8, top_p=0.9, top_k=40)
    params = SamplingParams(n=3, max_tokens=30, seed=7, ignore_eos=True, **kw)
    engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16,
                                    drafter=f"{drafters['near']},suffix"))
    outs = assisted(engine, 3).generate(PROMPTS[:3], params)
    assert min(assisted_rows(engine)) > 0
    for prompt, out in zip(PROMPTS[:3], outs, strict=True):
        for comp in out.outputs:
            with torch.no_grad():
                logits = ref(torch.tensor([prompt + comp.token_ids])).logits[0, len(prompt) - 1 : -1]
            for t, tok in enumerate(comp.token_ids):
                assert abs(comp.logprobs[t] - processed_probs(logits[t], **kw)[tok].log().item()) < 1e-4


# -- the sampled distribution -------------------------------------------------------------------------
SETTINGS = {"t1.0": dict(temperature=1.0), "t0.7-p0.9": dict(temperature=0.7, top_p=0.9), "k5": dict(top_k=5)}


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(("name", "k"), [("suffix", 3), ("agree", 1), ("agree", 3), ("disagree", 2), ("eagle", 2),
                                         ("agree+suffix", 3), ("disagree+suffix", 2)])
def test_joint_distribution_of_three_tokens_matches(tiny_vocab_model, tiny_drafters, setting, name, k):
    """"X+suffix": the draft model X assisted by the suffix table (rows it has drafts for verify the table's).
    Four tokens, the first three compared: the first decode step then has room for two drafts, all that a joint
    of three tokens can show (k = 3 is limited to them, `DraftProposal.limit`), and the second has room for
    none or one."""
    prompt = [1, 2, 3]
    kw = SETTINGS[setting]
    model, _, host = name.partition("+")
    drafter = f"{tiny_drafters[model]},{host}" if host else tiny_drafters[name]
    engine = LLMEngine(EngineConfig(model=str(tiny_vocab_model), max_model_len=32, max_num_seqs=400,
                                    drafter=drafter, spec="fixed", spec_k=k))
    if host:
        assisted(engine, k)
    params = [SamplingParams(n=200, max_tokens=4, seed=5000 + i, ignore_eos=True, **kw) for i in range(100)]
    outs = engine.generate([prompt] * 100, params)
    if host:
        assert min(assisted_rows(engine)) > 0  # both kinds of row ran
    triples = [c.token_ids[:3] for o in outs for c in o.outputs]
    assert len(triples) == 20_000 and all(len(t) == 3 for t in triples)
    assert engine.stats.spec_draft_tokens > 0
    if name == "agree":
        assert engine.stats.spec_accepted_tokens > 0.5 * engine.stats.spec_draft_tokens
    codes = [(a * 16 + b) * 16 + c for a, b, c in triples]
    p = chi_square_pvalue(codes, exact_joint(tiny_vocab_model, prompt, kw))
    assert p > 0.01, f"chi-square p={p:.4g}"
