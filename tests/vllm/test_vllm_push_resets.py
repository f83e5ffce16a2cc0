"""What a push resets on the vLLM backend, through a real server (a draft model at k <= 3, specroll's online depth).

- The prefix cache: after a target push no token is computed from KV of the old weights. A request that starts
  after the push never hits a block the old weights filled, whatever the push's mode, and one kept running through
  it (mode keep) goes on from KV the new weights recompute.
- The online depth's acceptance: a drafter pushed after a collapse is drafted with at once, even at one row."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from service_utils import ADMIN, checkpoint_tensors, engine_config, perturbed, running, start_server, write_checkpoint
from vllm_utils import check_cut_at_push, hf_greedy, hf_of

from client import SpecrollClient
from service.api.generation import Limits
from service.backend.admission import request_share
from service.vllm.config import VllmConfig, vllm_drafter
from service.vllm.profile import Profile, cache_path, candidate_ks, save
from service.vllm.stats import vllm_counters

pytestmark = pytest.mark.vllm

LEN = 512
BLOCK = 128  # vLLM's CPU block size: this prompt fills one block, which prefix caching keeps
PROMPT = [(3 * i + 1) % 16 for i in range(BLOCK + 20)]
LONG = [5, 6, 7]
SLOTS = 64
# greedy rows of one prompt: enough for outputs made before a push to reach the server after it, and all running
# at once (a request runs at most its share of the slots; its other samples start later, like a later request)
ROWS = request_share(SLOTS)


K = 3
# A scripted start-up profile: a step costs 1 ms plus 0.5 ms a draft at every batch size, the drafter's first
# three positions are accepted at 0.9 / 0.81 / 0.73. So k = 3 everywhere, and k = 0 once acceptance collapses
# (below 0.5 at the first position; the collapsed drafter's, shrunk towards the prior, stays near 0.2).
PROFILE = Profile({(b, k): 1e-3 + 5e-4 * k for b in (1, 8) for k in candidate_ks(K)}, (0.9, 0.81, 0.73))


@pytest.fixture(scope="module")
def server(vllm_model, tmp_path_factory):
    """The draft model is the target's own checkpoint: every draft is accepted until a push changes one."""
    engine_kw = {"max_model_len": LEN, "max_num_seqs": SLOTS, "kv_cache_memory_gb": 0.125,
                 "drafter": str(vllm_model), "spec": "adaptive", "spec_k": K}
    vcfg = VllmConfig(num_speculative_tokens=K, gpu_memory_utilization=0.3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECROLL_CACHE", str(tmp_path_factory.mktemp("cache")))
        import vllm

        config = engine_config(vllm_model, **engine_kw)
        save(cache_path(config, vcfg, vllm_drafter(config.drafter, Path(vllm_model)), vllm.__version__), PROFILE)
        srv = start_server(vllm_model, engine_kw=engine_kw, backend="vllm", limits=Limits(max_tokens=LEN),
                           vllm=vcfg)
    yield from running(srv)


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_no_token_after_a_push_comes_from_the_old_weights_kv(server, vllm_model, tmp_path, mode):
    base = checkpoint_tensors(vllm_model)
    new = perturbed(base, seed=3)
    started, done = threading.Event(), []

    def long_rollouts() -> None:  # greedy, long enough to be running when the push lands
        with SpecrollClient(server.grpc_target) as c:
            for ev in c.stream(LONG, n=ROWS, max_tokens=LEN - len(LONG), temperature=0.0, ignore_eos=True):
                started.set()
                if hasattr(ev, "finish_reason"):
                    done.append(ev)

    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(base, f"{mode}-old")
        cached = c.generate_one(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True).samples[0].token_ids
        thread = threading.Thread(target=long_rollouts)
        thread.start()
        assert started.wait(60)
        c.push_weights(new, f"{mode}-new", mode=mode)
        after = c.generate_one(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True).samples[0].token_ids
        thread.join(300)
    old_model, new_model = hf_of(vllm_model), hf_of(write_checkpoint(vllm_model, new, tmp_path / "new"))
    assert cached == hf_greedy(old_model, PROMPT, 8) != hf_greedy(new_model, PROMPT, 8)
    assert after == hf_greedy(new_model, PROMPT, 8)  # not from the block the old weights cached
    assert len(done) == ROWS
    if mode != "keep":
        assert all([v.policy_version for v in r.version_spans] == [f"{mode}-old"] for r in done)
        return
    # The rows ran through the push, and went on from KV the new weights recomputed.
    assert all([v.policy_version for v in r.version_spans] == [f"{mode}-old", f"{mode}-new"] for r in done)
    check_cut_at_push(done, f"{mode}-old", LONG, old_model, new_model, LEN - len(LONG))


def _drafts(c: SpecrollClient, prompt: list[int]) -> int:
    """How many drafts vLLM verified for one greedy request of 40 tokens at one row."""
    before = vllm_counters().get("spec_drafts", 0)
    c.generate_one(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
    return vllm_counters().get("spec_drafts", 0) - before


def test_a_drafter_pushed_after_a_collapse_is_drafted_with_at_once(server, vllm_model):
    """A drafter that proposes other tokens than the target (pushed, as a stale drafter would be after policy
    pushes) collapses the measured acceptance, so one row stops drafting (at most a probe every 64 steps). The good
    drafter pushed back is drafted with in the very next request: the push restarts the acceptance from the
    profile's. Without that, one row would wait for probes, one draft each, to outweigh the collapse."""
    base = checkpoint_tensors(vllm_model)
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(base, "online-base")
        c.push_weights(base, "online-good", role="drafter")
        assert _drafts(c, [1, 2, 3]) >= 8  # 40 tokens, 4 a step
        c.push_weights(perturbed(base, seed=5, scale=4.0), "online-bad", role="drafter")
        drafts = [_drafts(c, [1, 2, 3 + i]) for i in range(6)]
        assert min(drafts) <= 1, drafts  # collapsed: no drafts at one row but a probe
        c.push_weights(base, "online-back", role="drafter")
        assert _drafts(c, [4, 5, 6]) >= 8
