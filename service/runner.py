"""The model runner: the only place that turns scheduled sequences into tensors and runs the model."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from service.kv_cache import KVCache
from service.models.llama import AttnMeta, CausalLM
from service.models.rope import Rope
from service.sampler import SampleResult, SamplingBatch, sample
from service.scheduler import SchedulerOutput
from service.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenResult:
    """Host-side result of sampling one token for one sequence."""

    token: int
    logprob: float
    raw_logprob: float | None
    top: dict[int, float] | None


def to_host(res: SampleResult, seqs: list[Sequence]) -> list[TokenResult]:
    """One device->host transfer for everything sampled this step."""
    cols = [res.tokens.double()[:, None], res.logprobs.double()[:, None]]
    if res.raw_logprobs is not None:
        cols.append(res.raw_logprobs.double()[:, None])
    if res.top_ids is not None:
        cols += [res.top_ids.double(), res.top_values.double()]
    rows = torch.cat(cols, dim=1).tolist()
    k = 0 if res.top_ids is None else res.top_ids.shape[1]
    has_raw = res.raw_logprobs is not None
    out = []
    for seq, row in zip(seqs, rows, strict=True):
        raw = row[2] if has_raw and seq.params.raw_logprobs else None
        top = None
        if seq.params.top_logprobs:
            base = 2 + has_raw
            n = seq.params.top_logprobs
            top = {int(i): v for i, v in zip(row[base : base + n], row[base + k : base + k + n], strict=True)}
        out.append(TokenResult(int(row[0]), row[1], raw, top))
    return out


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.cfg = model.config
        self.cache = cache
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.rope = Rope(self.cfg, cache.max_positions, device, self.dtype)

    # -- tensor building --------------------------------------------------------------------------
    def build_meta(self, slot_lo: int, starts: list[int], q_lens: list[int]) -> tuple[AttnMeta, torch.Tensor]:
        """Rows b = slots slot_lo + b append q_lens[b] tokens at positions starts[b]...; returns meta and
        the [B, Q] position tensor (padding entries point at the scratch position)."""
        B, Q = len(starts), max(q_lens)
        dev = self.device
        start = torch.tensor(starts, dtype=torch.int64, device=dev)
        q_len = torch.tensor(q_lens, dtype=torch.int64, device=dev)
        offs = torch.arange(Q, device=dev)
        pos = start[:, None] + offs[None, :]  # [B, Q]
        valid = offs[None, :] < q_len[:, None]
        scratch = self.cache.scratch_pos
        write_pos = torch.where(valid, pos, scratch)
        kv_len = max(s + n for s, n in zip(starts, q_lens, strict=True))
        keys = torch.arange(kv_len, device=dev)
        mask = keys[None, None, :] <= pos[:, :, None]  # [B, Q, L]
        G = self.cfg.num_heads // self.cfg.num_kv_heads
        mask = mask[:, None] if Q == 1 else mask[:, None].repeat(1, 1, G, 1)  # [B, 1, G*Q or 1, L]
        slots = (torch.arange(B, device=dev) + slot_lo)[:, None].expand(B, Q)
        cos, sin = self.rope.lookup(write_pos)
        meta = AttnMeta(slot_lo, kv_len, slots.reshape(-1), write_pos.reshape(-1), mask, cos, sin)
        return meta, write_pos

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """input_ids [B, Q] -> final hidden states [B, Q, hidden]."""
        return self.model(input_ids, meta, self.cache.k, self.cache.v)

    # -- one engine step --------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[list[Sequence], list[TokenResult]]:
        """Run the scheduled forward and sample one token per sequence. Returns (seqs, results)."""
        self.cache.copy_slots(out.moves)
        if out.kind == "prefill":
            return self._prefill(out)
        return self._decode(out)

    def _prefill(self, out: SchedulerOutput) -> tuple[list[Sequence], list[TokenResult]]:
        prompts = [r.prompt_token_ids for r in out.requests]
        q_lens = [len(p) for p in prompts]
        Q = max(q_lens)
        ids = torch.tensor([p + [0] * (Q - len(p)) for p in prompts], dtype=torch.int64, device=self.device)
        meta, _ = self.build_meta(out.slot_lo, [0] * len(prompts), q_lens)
        hidden = self.forward(ids, meta)  # [P, Q, hidden]
        last = torch.tensor([n - 1 for n in q_lens], device=self.device)
        logits = self.model.logits(hidden[torch.arange(len(prompts), device=self.device), last])  # [P, V]
        self.cache.copy_slots(out.forks)
        seqs = [s for r in out.requests for s in r.seqs]
        row_of = torch.tensor([i for i, r in enumerate(out.requests) for _ in r.seqs], device=self.device)
        sb = SamplingBatch.build(seqs, self.cfg.vocab_size, self.device)
        return seqs, to_host(sample(logits[row_of], sb), seqs)

    def _decode(self, out: SchedulerOutput) -> tuple[list[Sequence], list[TokenResult]]:
        seqs = out.seqs
        ids = torch.tensor([[s.last_token] for s in seqs], dtype=torch.int64, device=self.device)
        meta, _ = self.build_meta(0, [s.num_cached for s in seqs], [1] * len(seqs))
        hidden = self.forward(ids, meta)  # [B, 1, hidden]
        logits = self.model.logits(hidden[:, 0])
        sb = SamplingBatch.build(seqs, self.cfg.vocab_size, self.device)
        return seqs, to_host(sample(logits, sb), seqs)
