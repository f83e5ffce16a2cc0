"""Penalties stay exact under speculative decoding: a verify position counts the drafts before it.

Checked against an independent recompute: transformers' logits of the target alone, penalised token by token
by `reference.penalised` (plain Python over the prompt and the output, no engine code). Greedy tokens with SD
on equal SD off and the recompute; returned logprobs equal the recompute's processed distribution; the law of
three sampled tokens matches the exact penalised law for each drafter kind the sampled tests run.
"""

from __future__ import annotations

import pytest
import torch
from helpers import peaked_checkpoint
from reference import chi_square_pvalue, exact_joint, penalised, processed_probs
from test_spec_decode import assisted, assisted_rows

from service.config import EngineConfig
from service.engine.batch_tensors import penalties_of
from service.engine.llm_engine import LLMEngine
from service.engine.types import Sequence
from service.params import SamplingError, SamplingParams

PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [17, 17, 17, 17, 2]]
# Each strong enough to change the greedy path of this target (a repeat is otherwise common)
PENALTIES = {
    "frequency": dict(frequency_penalty=1.5),
    "presence+repetition": dict(presence_penalty=1.2, repetition_penalty=1.5),
    "negative": dict(frequency_penalty=-0.5, repetition_penalty=0.7),  # rewards repeats: long accepted runs
}


@pytest.fixture(scope="module")
def target():
    return peaked_checkpoint()


@pytest.fixture(scope="module")
def hf(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def reference_greedy(hf, prompt: list[int], n: int, pen: dict) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(penalised(logits, prompt, out, **pen).argmax()))
    return out


def engine(target, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16, **kw))


def test_penalties_are_validated_once():
    for kw, words in ((dict(frequency_penalty=2.5), "frequency_penalty must be in [-2, 2]"),
                      (dict(presence_penalty=-2.1), "presence_penalty must be in [-2, 2]"),
                      (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
                      (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
                      (dict(frequency_penalty="1"), "frequency_penalty must be a finite number")):
        with pytest.raises(SamplingError, match=words.replace("[", r"\[").replace("]", r"\]")):
            SamplingParams(**kw)
    assert not SamplingParams(frequency_penalty=0, presence_penalty=0.0, repetition_penalty=1).penalised


def test_each_verify_position_counts_the_drafts_before_it():
    """`at_positions` = the penalties of each position computed on its own, with the drafts before it counted."""
    V, cpu = 12, torch.device("cpu")
    seqs = [Sequence("a", 0, [1, 2], SamplingParams(frequency_penalty=0.7, presence_penalty=0.3,
                                                    repetition_penalty=1.4), 0),
            Sequence("b", 0, [3], SamplingParams(), 1),  # no penalty: its logits stay as they are
            Sequence("c", 0, [4, 4], SamplingParams(frequency_penalty=-1.0), 2)]
    seqs[0].output_token_ids += [5, 5, 2]
    seqs[2].output_token_ids += [7]
    pen = penalties_of(seqs, V, cpu)
    logits = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(0))
    drafts = torch.tensor([[5, 6, 6], [1, 2, 3], [7, 7, 0]])
    got = pen.at_positions(logits, drafts)
    assert torch.equal(got[1], logits[1])
    for b, s in enumerate(seqs):
        for j in range(4):
            out = s.output_token_ids + drafts[b, :j].tolist()
            p = s.params
            want = penalised(logits[b, j], s.prompt_token_ids, out, p.frequency_penalty, p.presence_penalty,
                             p.repetition_penalty)
            torch.testing.assert_close(got[b, j], want, atol=1e-6, rtol=0)
            assert torch.equal(pen.apply(logits[:, j], drafts[:, :j])[b], got[b, j])  # the drafters' way


@pytest.mark.parametrize("setting", list(PENALTIES))
def test_greedy_with_penalties_equals_sd_off_and_the_recompute(target, hf, setting):
    pen = PENALTIES[setting]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **pen)
    base = [o.outputs[0].token_ids for o in engine(target).generate(PROMPTS, params)]
    unpenalised = [o.outputs[0].token_ids for o in engine(target).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    assert base != unpenalised  # the penalties change the path
    assert base == [reference_greedy(hf, p, 24, pen) for p in PROMPTS]
    for drafter, k in ((str(target), 4), ("suffix", 4), ("eagle", 3)):
        e = engine(target, drafter=drafter, spec="fixed", spec_k=k)
        got = [o.outputs[0].token_ids for o in e.generate(PROMPTS, params)]
        assert got == base, drafter
        assert e.stats.spec_drafts > 0 or drafter == "suffix"  # the table drafts repeats only
        if drafter == str(target):  # the target drafting for itself, penalised alike: every draft accepted
            assert e.stats.spec_accepted_tokens == e.stats.spec_draft_tokens > 0


def test_logprobs_with_penalties_are_those_of_the_penalised_distribution(target, hf):
    """Sampled with SD on (the target as its own drafter and the suffix table): each logprob and the top-3 are
    the recompute's processed distribution after the penalties; raw logprobs stay unpenalised."""
    kw = dict(temperature=0.8, top_p=0.9)
    pen = dict(frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.3)
    params = SamplingParams(n=2, max_tokens=16, seed=11, ignore_eos=True, top_logprobs=3, raw_logprobs=True,
                            **kw, **pen)
    e = assisted(engine(target, drafter=f"{target},suffix"), 3)
    outs = e.generate(PROMPTS, params)
    assert min(assisted_rows(e)) > 0  # rows verified the draft model's drafts and the table's
    for prompt, out in zip(PROMPTS, outs, strict=True):
        for comp in out.outputs:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + comp.token_ids])).logits[0, len(prompt) - 1 : -1]
            for t, tok in enumerate(comp.token_ids):
                p = processed_probs(penalised(logits[t], prompt, comp.token_ids[:t], **pen), **kw)
                assert abs(comp.logprobs[t] - p[tok].log().item()) < 1e-4
                best = p.topk(3)
                kept = [i for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True) if v > 0]
                assert list(comp.top_logprobs[t])[: len(kept)] == kept
                assert abs(comp.raw_logprobs[t] - logits[t].log_softmax(-1)[tok].item()) < 1e-4


# -- the sampled distribution -------------------------------------------------------------------------
JOINT_PENALTIES = dict(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "k"), [("suffix", 3), ("agree", 3), ("disagree", 2), ("eagle", 2),
                                         ("agree+suffix", 3)])
def test_joint_distribution_of_three_penalised_tokens_matches(tiny_vocab_model, tiny_drafters, name, k):
    """20,000 samples of three tokens (temperature 0.8, every penalty) against the exact penalised law. The first
    decode step verifies two drafts: the third token is sampled at a position whose counts hold the second."""
    prompt = [1, 2, 3]
    kw = dict(temperature=0.8)
    model, _, host = name.partition("+")
    drafter = f"{tiny_drafters[model]},{host}" if host else tiny_drafters[name]
    e = LLMEngine(EngineConfig(model=str(tiny_vocab_model), max_model_len=32, max_num_seqs=400,
                               drafter=drafter, spec="fixed", spec_k=k))
    if host:
        assisted(e, k)
    params = [SamplingParams(n=200, max_tokens=4, seed=7000 + i, ignore_eos=True, **kw, **JOINT_PENALTIES)
              for i in range(100)]
    triples = [c.token_ids[:3] for o in e.generate([prompt] * 100, params) for c in o.outputs]
    assert len(triples) == 20_000
    assert e.stats.spec_accepted_tokens > 0
    codes = [(a * 16 + b) * 16 + c for a, b, c in triples]
    p = chi_square_pvalue(codes, exact_joint(tiny_vocab_model, prompt, kw, penalties=JOINT_PENALTIES))
    assert p > 0.01, f"chi-square p={p:.4g}"
