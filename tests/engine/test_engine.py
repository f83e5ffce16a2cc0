"""Engine behaviour: continuous batching, batch invariance, stop/length/abort, n samples, logprobs."""

from __future__ import annotations

import pytest
import torch
from helpers import default_checkpoint, make_checkpoint

from service.config import EngineConfig
from service.engine.llm_engine import LLMEngine
from service.engine.scheduler import Scheduler
from service.engine.types import Request, Sequence
from service.params import SamplingError, SamplingParams


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=str(default_checkpoint()), max_model_len=256, max_num_seqs=40))


def rand_prompts(n, vocab=512, seed=0, lo=2, hi=24):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
     SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=40, ignore_eos=True)],
    ids=["greedy", "seeded"],
)
def test_batch_invariance(engine, params):
    target = rand_prompts(1, seed=42)[0]
    [alone] = engine.generate([target], params)
    others = rand_prompts(31, seed=7)
    other_params = [SamplingParams(temperature=1.0, max_tokens=int(5 + 3 * i), ignore_eos=True) for i in range(31)]
    mixed = engine.generate([*others[:15], target, *others[15:]], [*other_params[:15], params, *other_params[15:]])
    assert mixed[15].outputs[0].token_ids == alone.outputs[0].token_ids
    torch.testing.assert_close(mixed[15].outputs[0].logprobs, alone.outputs[0].logprobs, atol=1e-5, rtol=0)


def test_short_requests_do_not_wait_for_long_ones(engine):
    long_id = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    for _ in range(5):
        engine.step()
    short_id = engine.add_request([8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished_order = []
    while engine.has_unfinished():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order == [short_id, long_id]


def test_stop_tokens_and_max_tokens(engine):
    prompt = [3, 4, 5, 6]
    [ref] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    toks = ref.outputs[0].token_ids
    assert ref.outputs[0].finish_reason == "length" and len(toks) == 30
    stop = toks[10]
    [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(stop,)))
    first = toks.index(stop)
    assert out.outputs[0].token_ids == toks[: first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_abort_mid_generation_keeps_partial_output(engine):
    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    keep = engine.add_request([4, 5], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    got: dict[str, list[int]] = {rid: [], keep: []}
    reasons = {}
    for _ in range(6):
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert engine.abort(rid)
    assert not engine.abort("no-such-request")
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert reasons == {rid: "abort", keep: "length"}
    assert len(got[rid]) == 6 and len(got[keep]) == 20
    [ref] = engine.generate([[4, 5]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert got[keep] == ref.outputs[0].token_ids


def test_n_samples_share_prefill_and_differ(engine):
    params = SamplingParams(n=8, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    [out] = engine.generate([[7, 8, 9, 10]], params)
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(seqs) == 8 and len(set(seqs)) > 1
    # the same seed gives the same 8 samples; each sample equals a single-sample request with that seed.
    [again] = engine.generate([[7, 8, 9, 10]], params)
    assert [tuple(c.token_ids) for c in again.outputs] == seqs
    [greedy] = engine.generate([[7, 8, 9, 10]], SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def request(rid: str, prompt: list[int], n: int = 1) -> Request:
    seqs = [Sequence(request_id=rid, index=i, prompt_token_ids=prompt, params=SamplingParams(n=n), seed=i)
            for i in range(n)]
    return Request(rid, prompt, SamplingParams(n=n), seqs)


def test_requests_repeating_a_prompt_share_one_prefill_row():
    """A GRPO group sent as separate requests: admitted together, one prefill row per distinct prompt, whose
    K/V is copied into the slots of every other sample with that prompt."""
    group, other = [7, 8, 9, 10, 11, 12], [40, 41, 42]
    sched = Scheduler(num_slots=8, max_num_batched_tokens=512)
    for i, (prompt, n) in enumerate([(group, 1), (other, 1), (group, 2), (group, 1), (other, 1)]):
        sched.add(request(str(i), prompt, n))
    batch = sched.schedule()
    assert batch.kind == "prefill" and batch.prompts == [group, other] and batch.slot_lo == 0
    assert [(s.request_id, s.index) for s in batch.seqs] == [("0", 0), ("1", 0), ("2", 0), ("2", 1), ("3", 0),
                                                             ("4", 0)]
    assert batch.row_of == [0, 1, 0, 0, 0, 1] and [s.slot for s in batch.seqs] == list(range(6))
    assert [(f.src, f.dst, f.length) for f in batch.forks] == [(0, 2, 6), (0, 3, 6), (0, 4, 6), (1, 5, 3)]


def test_a_repeated_prompt_adds_nothing_to_the_prefill_budget():
    sched = Scheduler(num_slots=16, max_num_batched_tokens=100)
    for i in range(12):  # 12 x 40 tokens, but only two distinct prompts: 80 prefill tokens
        sched.add(request(str(i), [1 + i % 2] * 40))
    sched.add(request("new", [9] * 40))  # a third distinct prompt would make 120
    batch = sched.schedule()
    assert len(batch.requests) == 12 and len(batch.prompts) == 2 and len(sched.waiting) == 1


def test_the_schedulers_pause_state_holds_admission_or_freezes_the_batch():
    """Held: running sequences decode, no waiting request starts. Paused: no batch at all, and the compaction a
    finished sequence left waits (its copy length is read when a batch runs again)."""
    sched = Scheduler(num_slots=4, max_num_batched_tokens=512)
    for i in range(3):
        sched.add(request(str(i), [5 + i] * 4))
    assert sched.schedule().kind == "prefill"
    sched.add(request("late", [9] * 4))
    sched.pause.held = True
    batch = sched.schedule()
    assert batch.kind == "decode" and len(batch.seqs) == 3 and len(sched.waiting) == 1
    first = batch.seqs[0]
    first.num_cached = 4
    sched.release(first)  # the last running sequence moves into slot 0
    sched.pause.paused = True
    assert sched.schedule().kind == "idle" and sched.schedule().moves == []
    sched.pause.paused = sched.pause.held = False
    batch = sched.schedule()
    assert batch.kind == "prefill" and [(m.src, m.dst) for m in batch.moves] == [(2, 0)]


def test_shared_prefill_rows_give_what_each_request_gets_alone(engine):
    group, other = rand_prompts(2, seed=11, lo=8)
    prompts = [group, other, group, group, other]
    params = [SamplingParams(n=1 + (i == 2), temperature=1.0, seed=100 + i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    together = engine.generate(prompts, params)
    for p, sp, got in zip(prompts, params, together, strict=True):
        [alone] = engine.generate([p], sp)
        for a, b in zip(alone.outputs, got.outputs, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_eos_stops_unless_ignored(tmp_path):
    path = make_checkpoint("llama", tied=True)
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=64))
    [ref] = engine.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eos = ref.outputs[0].token_ids[4]
    engine.eos_token_ids = (eos,)
    [out] = engine.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=20))
    assert out.outputs[0].token_ids[-1] == eos and out.outputs[0].finish_reason == "stop"


def test_max_model_len_caps_generation(engine):
    [out] = engine.generate([list(range(1, 250))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"


def test_bad_input_is_rejected_with_a_message(engine):
    with pytest.raises(SamplingError, match="out of range"):
        engine.add_request([1, 99999])
    with pytest.raises(SamplingError, match="at least one token"):
        engine.add_request([])
    with pytest.raises(SamplingError, match="max_model_len"):
        engine.add_request(list(range(1, 300)))
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingError, match="temperature"):
        SamplingParams(temperature=-1)


def test_many_more_requests_than_slots(engine):
    prompts = rand_prompts(100, seed=3)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    [single] = engine.generate([prompts[77]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert single.outputs[0].token_ids == outs[77].outputs[0].token_ids


def test_slot_compaction_keeps_every_sequence_exact(engine):
    """Sequences leave at different steps, so others move slots; each must match its solo run exactly."""
    prompts = rand_prompts(24, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=3 + (i * 7) % 29, ignore_eos=True) for i in range(24)]
    batched = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        [solo] = engine.generate([prompt], p)
        assert out.outputs[0].token_ids == solo.outputs[0].token_ids
        torch.testing.assert_close(out.outputs[0].logprobs, solo.outputs[0].logprobs, atol=1e-5, rtol=0)
