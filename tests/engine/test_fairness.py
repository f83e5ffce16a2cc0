"""The scheduler's fairness rule on a real engine: one request never takes every slot, so a small request that
arrives behind a request with as many samples as slots starts at once (counted in engine steps), and neither
request's output changes (lossless)."""

from __future__ import annotations

import pytest
from helpers import default_checkpoint

from service.config import EngineConfig
from service.engine.llm_engine import LLMEngine
from service.engine.scheduler import Scheduler
from service.engine.types import Request, Sequence
from service.params import SamplingParams

SLOTS = 8
HOG_TOKENS = 60


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(default_checkpoint()), max_model_len=128,
                                  max_num_seqs=SLOTS, enforce_eager=True))


def run_alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    [out] = engine.generate([prompt], params)
    return [c.token_ids for c in out.outputs]


def collect(outputs: list, got: dict[tuple[str, int], list[int]]) -> set[str]:
    finished = set()
    for o in outputs:
        got.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        if o.finished:
            finished.add(f"{o.request_id}:{o.index}")
    return finished


@pytest.mark.parametrize("hog_params", [
    SamplingParams(n=SLOTS, temperature=0, max_tokens=HOG_TOKENS, ignore_eos=True),
    SamplingParams(n=SLOTS, temperature=1.0, seed=5, max_tokens=HOG_TOKENS, ignore_eos=True),
], ids=["greedy-hog", "seeded-hog"])
def test_a_one_token_request_under_a_full_slot_hog_finishes_in_two_steps(engine, hog_params):
    hog_prompt, small_prompt = [5, 6, 7, 8, 9], [11, 12, 13]
    small_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    hog_alone, small_alone = run_alone(engine, hog_prompt, hog_params), run_alone(engine, small_prompt, small_params)

    got: dict[tuple[str, int], list[int]] = {}
    engine.add_request(hog_prompt, hog_params, request_id="hog")
    for _ in range(3):  # the hog is decoding, with every slot it may take
        collect(engine.step(), got)
    assert engine.num_running == engine.scheduler.share < SLOTS
    engine.add_request(small_prompt, small_params, request_id="small")
    steps, finished = 0, set()
    while "small:0" not in finished:
        finished |= collect(engine.step(), got)
        steps += 1
        assert steps <= HOG_TOKENS  # without the share it waits for a hog sample to end (HOG_TOKENS steps)
    assert steps <= 2, f"the small request took {steps} engine steps under the hog"
    while engine.has_unfinished():
        collect(engine.step(), got)
    assert got[("small", 0)] == small_alone[0]
    assert [got[("hog", i)] for i in range(SLOTS)] == hog_alone  # every hog sample as it runs alone


def request(rid: str, prompt: list[int], n: int) -> Request:
    params = SamplingParams(n=n)
    return Request(rid, prompt, params, [Sequence(rid, i, prompt, params, seed=i) for i in range(n)])


def test_a_request_over_its_share_starts_the_rest_as_its_own_samples_end():
    sched = Scheduler(num_slots=8, max_num_batched_tokens=512)
    assert sched.share == 7
    hog, behind = request("hog", [1, 2, 3], 8), request("behind", [4, 5], 2)
    sched.add(hog)
    sched.add(behind)
    first = sched.schedule()
    assert [s.request_id for s in first.seqs] == ["hog"] * 7  # behind needs 2: only the reserve's 1 is free
    assert sched.num_waiting_seqs == 3
    sched.release(hog.seqs[0])  # a hog sample ends: the hog's room and a second free slot
    hog.seqs[0].status = hog.seqs[0].status.FINISHED
    second = sched.schedule()
    assert [(s.request_id, s.index) for s in second.seqs] == [("hog", 7)]  # first in line, within its share
    assert sched.num_waiting_seqs == 2 and list(sched.waiting) == [behind]
    touched = sched.abort("hog")
    assert sorted(s.index for s in touched) == list(range(1, 8))  # running ones, each once
