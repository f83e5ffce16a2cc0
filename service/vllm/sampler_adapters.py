"""The self-check's batch (`service/vllm/sampler_check.py`) put through each rejection sampler vLLM serves with.

- V1 (`vllm.v1.sample.rejection_sampler.RejectionSampler`, the V1 model runner: every CPU build, and CUDA with
  `VLLM_USE_V2_MODEL_RUNNER=0`): the module itself, with vLLM's own `Sampler` for the bonus tokens, in
  `processed_logprobs` mode, exactly as its model runner calls it.
- MRv2 (`vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils.rejection_sample`, CUDA's default): its
  kernels, fed target logits processed as MRv2's sampler hands them over (tempered, top-k / top-p masked; the
  kernels temper the draft logits themselves) and per-request state indexed the way MRv2's input batch
  indexes it. Tokens only: MRv2 computes logprobs in other kernels. Not run compiled on this project's
  machines (no GPU): a failure or an exception here refuses sampled requests, it never admits them.
"""

from __future__ import annotations

import math

import torch

from service.vllm.sampler_check import CASES, DEPTH, TOP_N, Batch, Verified, Verifier, processed


def v1_verifier(device: str | torch.device) -> Verifier:
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    sampler = RejectionSampler(Sampler(logprobs_mode="processed_logprobs"))

    def verify(batch: Batch) -> Verified:
        rows, width, vocab = batch.target_logits.shape
        dev = torch.device(device)
        index = torch.arange(rows * width, dtype=torch.int32, device=dev).view(rows, width)
        meta = SpecDecodeMetadata(
            draft_token_ids=batch.draft_tokens.flatten().to(dev, torch.int32),
            num_draft_tokens=[DEPTH] * rows,
            cu_num_draft_tokens=(torch.arange(1, rows + 1, dtype=torch.int32) * DEPTH).to(dev),
            cu_num_sampled_tokens=(torch.arange(1, rows + 1, dtype=torch.int32) * width).to(dev),
            target_logits_indices=index[:, :DEPTH].flatten().contiguous(),
            bonus_logits_indices=index[:, DEPTH].contiguous(), logits_indices=index.flatten())
        empty = torch.empty(0, device=dev)
        sampling = SamplingMetadata(
            temperature=batch.temperature.to(dev), all_greedy=False, all_random=False,
            top_p=batch.top_p.to(dev), top_k=batch.top_k.to(dev), generators={}, max_num_logprobs=TOP_N,
            no_penalties=True, prompt_token_ids=None, frequency_penalties=empty, presence_penalties=empty,
            repetition_penalties=empty, output_token_ids=[[] for _ in range(rows)], allowed_token_ids_mask=None,
            bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
            spec_token_ids=batch.draft_tokens.tolist())
        draft_probs = None if batch.draft_probs is None else batch.draft_probs.reshape(-1, vocab).to(dev)
        out = sampler(meta, draft_probs, batch.target_logits.reshape(-1, vocab).to(dev), sampling)
        tokens = out.sampled_token_ids.long().cpu()
        lp = out.logprobs_tensors.logprobs.cpu().view(rows, width, TOP_N + 1)
        return Verified(tokens=tokens, logprobs=lp[..., 0], top_logprobs=lp[..., 1:])

    return verify


def mrv2_verifier(device: str | torch.device) -> Verifier:
    """MRv2's rejection kernels (CUDA, Triton). Importable from vLLM or from its kernel files alone
    (`tests/vllm/gpu_mrv2_sampler.py` loads them with a stub of `vllm.triton_utils`)."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    def verify(batch: Batch) -> Verified:
        rows, width, vocab = batch.target_logits.shape
        dev = torch.device(device)
        case_of_row = torch.tensor(batch.case_of_row)
        processed_logits = torch.empty(rows, width, vocab, dtype=torch.float32)
        for c, case in enumerate(CASES):  # what MRv2's sampler hands the kernels: tempered, top-k / top-p masked
            mine = case_of_row == c
            keep = processed(batch.target_logits[mine], case) > 0
            tempered = batch.target_logits[mine] / (case.temperature if case.temperature > 0 else 1.0)
            processed_logits[mine] = tempered.masked_fill(~keep, -math.inf)
        flat = processed_logits.reshape(-1, vocab).to(dev)
        # logits row r * width + j: draft position j of request r (j = DEPTH: the bonus position); the token in
        # row j + 1 is the draft verified by row j
        sampled_in = torch.full((rows, width), -1, dtype=torch.int64)
        sampled_in[:, 1:] = batch.draft_tokens
        cu = torch.arange(0, rows + 1, dtype=torch.int32) * width
        local_pos = torch.arange(width, dtype=torch.int32).repeat(rows)
        idx_mapping = torch.arange(rows, dtype=torch.int32)
        draft_logits = None
        if batch.draft_probs is not None:  # per request state [rows, DEPTH, V], tempered by the kernels like
            # the target's: log q times the temperature, so the kernels' division gives back q
            scale = batch.temperature.where(batch.temperature > 0, 1.0).view(-1, 1, 1)
            draft_logits = (batch.draft_probs.log() * scale).contiguous().to(dev)
        temperature = batch.temperature.to(dev)
        seeds = torch.randint(0, 2**62, (rows,), dtype=torch.int64).to(dev)
        sampled, num_sampled = rejection_sample(
            flat, draft_logits, sampled_in.flatten().to(dev, torch.int32), cu.to(dev),
            local_pos.to(dev, torch.int64), idx_mapping.to(dev), idx_mapping.repeat_interleave(width).to(dev),
            local_pos.to(dev), temperature, seeds, DEPTH)
        sampled = sampled.long().cpu()
        n = num_sampled.long().cpu()
        tokens = torch.where(torch.arange(width).unsqueeze(0) < n.unsqueeze(1), sampled[:, :width], -1)
        return Verified(tokens=tokens, logprobs=None, top_logprobs=None)  # MRv2's logprobs: other kernels

    return verify
