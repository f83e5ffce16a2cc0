"""The model runner: the only place that turns scheduled sequences into tensors and runs the model."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from service.engine.batch_tensors import SamplingBatch, SamplingRows, int_tensor, last_rows, last_tokens, padded_ids
from service.engine.cached_model import CachedModel, StepGraphs
from service.engine.compiled import compiles
from service.engine.kv_cache import KVCache
from service.engine.sampler import SampleResult, sample, verify
from service.engine.speculative.passes import cut_depth, packs
from service.engine.types import SchedulerOutput, Sequence, SlotCopy, StepResult, TokenResult
from service.models.llama import AttnMeta, CausalLM

if TYPE_CHECKING:
    from service.engine.drafters.base import Drafter
    from service.engine.types import Arm


def to_host(res: SampleResult, seqs: list[Sequence], extra: torch.Tensor | None = None):
    """One device->host transfer for everything sampled this step. With `extra` ([B, m] integers, B
    dividing the number of rows), returns (results, extra as B lists) from the same transfer."""
    cols = [res.tokens.double()[:, None], res.logprobs.double()[:, None]]
    if res.raw_logprobs is not None:
        cols.append(res.raw_logprobs.double()[:, None])
    if res.top_ids is not None:
        cols += [res.top_ids.double(), res.top_values.double()]
    packed = torch.cat(cols, dim=1)
    if extra is not None:
        per = packed.shape[0] // extra.shape[0]
        packed = torch.cat([packed, extra.double().repeat_interleave(per, dim=0)], dim=1)
    rows = packed.tolist()
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
    if extra is not None:
        per = len(rows) // extra.shape[0]
        m = extra.shape[1]
        return out, [[int(v) for v in r[-m:]] for r in rows[::per]]
    return out


class ModelRunner:
    """Runs the target for prefill, decode and speculative steps; drafters plug in through `execute`."""

    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device, compiled: bool = False) -> None:
        self.target = CachedModel(model, cache, device, compiled)
        self.cache = cache
        self.device = device
        self.cfg = model.config
        self.drafters: list[Drafter] = []  # every drafter that keeps per-slot state follows slot copies
        self.prefill_drafters: list[Drafter] = []  # the drafters that may run see the prompts with the target
        self._depths: list[int] = []  # the verify depths captured at start-up (CUDA graphs)
        self.sampling = SamplingRows(self.cfg.vocab_size, device)  # decode and verify steps' sampling parameters

    @property
    def model(self) -> CausalLM:
        return self.target.model

    @model.setter
    def model(self, model: CausalLM) -> None:
        self.target.model = model

    def build_meta(self, slot_lo: int, starts: list[int], q_lens: list[int], pack: bool = False,
                   width: int | None = None) -> tuple[AttnMeta, torch.Tensor]:
        return self.target.build_meta(slot_lo, starts, q_lens, pack, width)

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """The target forward; every drafter sees the resulting hidden states (feature-based drafters)."""
        hidden = self.target.forward(input_ids, meta)
        rows = hidden.reshape(-1, hidden.shape[-1])  # packed or not, the tokens write_slots / write_pos name
        for d in self.drafters:
            d.observe_target_hidden(meta.write_slots, meta.write_pos, rows)
        return hidden

    def forward_rows(self, input_ids: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """A decode or verify forward of the target (graphed where it can be); drafters see it as above."""
        hidden, write_slots, write_pos = self.target.forward_rows(input_ids, starts)
        for d in self.drafters:
            d.observe_target_hidden(write_slots, write_pos, hidden)
        return hidden

    def apply_copies(self, copies: list[SlotCopy]) -> None:
        self.cache.copy_slots(copies)
        for d in self.drafters:
            d.apply_copies(copies)

    # -- one engine step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, arm: Arm, drafter: Drafter | None = None,
                assistant: Drafter | None = None, room: list[int] | None = None) -> StepResult:
        """Run one scheduled step: prefill, plain decode (k = 0), or draft k tokens with `drafter` and verify
        them in one target pass (a plain decode when the drafter proposed nothing for any row). With
        `arm.assist` = (name, n), `assistant` is that drafter: rows it has at least n drafts for take its.
        `room`: per row, the most drafts it can still emit (`DraftProposal.limit`); None: no limit."""
        self.apply_copies(batch.moves)
        if batch.kind == "prefill":
            return self._prefill(batch)
        built = self.builds()
        result = None
        if arm.k and drafter is not None:
            assist = (assistant, arm.assist[1]) if assistant is not None and arm.assist else None
            result = self._speculative(batch.seqs, drafter, arm.k, assist, room)
            if result is not None:
                result.arm = arm
        if result is None:
            result = self._decode(batch.seqs)
        result.captured = self.builds() > built
        return result

    def cached_models(self) -> list[CachedModel]:
        """The target and every drafter's model with its own KV cache."""
        return [self.target] + [c for d in self.drafters if (c := getattr(d, "cached", None)) is not None]

    def step_graphs(self) -> list[StepGraphs]:
        """The graphs of the target and of every drafter that has its own (empty when eager)."""
        return [c.graphs for c in self.cached_models() if c.graphs is not None]

    def builds(self) -> int:
        """CUDA graphs captured and (CPU) forwards compiled so far: a step that adds one is not a cost measurement."""
        return sum(g.built for g in self.step_graphs()) + (compiles() if self.target.compiled is not None else 0)

    def prepare(self, ks: tuple[int, ...]) -> int:
        """Before the first request: capture (GPU) or compile (CPU) the decode forwards and the verify forwards
        of k + 1 positions, k in `ks` (drafters' models: one position per row). Returns how many were built."""
        built = self.builds()
        self._depths = sorted(ks)
        with torch.inference_mode():
            for c in self.cached_models():
                if c.graphs is not None:
                    c.graphs.capture_all(self.query_lens(c, ks))
                else:
                    c.warm_up(self.query_lens(c, ks))
        return self.builds() - built

    def query_lens(self, c: CachedModel, ks: tuple[int, ...]) -> list[int]:
        """The query lengths of `c`'s uniform forwards: the target decodes and verifies k + 1, a drafter decodes."""
        return [1] + [k + 1 for k in ks] if c is self.target else [1]

    def packs_verify(self, row_lengths: list[int] | None, k: int) -> bool:
        """Whether a verify pass k drafts wide, with rows of these draft counts (None: unknown on the host), runs
        packed: only each row's last token and drafts go through the linear layers (`passes.packs`). On a CPU
        a padded position costs as much as a real one (a verify at batch 64 is matmul-bound:
        bench/step_profile.py), so a suffix table whose longest match set the width for every row paid for
        positions it never proposed."""
        if row_lengths is None:
            return False
        return packs(sum(row_lengths), len(row_lengths), k, self.target.pack_min_saved)

    def _prefill(self, out: SchedulerOutput) -> StepResult:
        prompts = out.prompts
        q_lens = [len(p) for p in prompts]
        meta, _ = self.target.build_meta(out.slot_lo, [0] * len(prompts), q_lens, pack=True)
        hidden = self.forward(padded_ids(prompts, self.device), meta)  # [P, Q, hidden], or [N, hidden] packed
        last = last_rows(q_lens, meta.packed is not None, self.device)
        logits = self.model.logits(hidden.reshape(-1, hidden.shape[-1])[last])  # [P, V]
        seqs = out.seqs
        for d in self.prefill_drafters:
            d.prefill(out.slot_lo, prompts, seqs)
        self.apply_copies(out.forks)
        row_of = int_tensor(out.row_of, self.device)
        sb = SamplingBatch.build(seqs, self.cfg.vocab_size, self.device)
        return StepResult.plain(seqs, to_host(sample(logits[row_of], sb), seqs))

    def _decode(self, seqs: list[Sequence]) -> StepResult:
        ids = last_tokens(seqs, self.device)  # [B, 1]
        logits = self.model.logits(self.forward_rows(ids, [s.num_cached for s in seqs])[:, 0])  # [B, V]
        sb = self.sampling.build(seqs)
        return StepResult.plain(seqs, to_host(sample(logits, sb), seqs))

    def _speculative(self, seqs: list[Sequence], drafter: Drafter, k: int, assist: tuple[Drafter, int] | None = None,
                     room: list[int] | None = None) -> StepResult | None:
        """Draft k tokens per row and verify them; None when the drafter proposed nothing for any row.
        `assist` = (lookahead drafter, n): rows the lookahead drafter has at least n drafts for verify its drafts.
        `room`: each row's drafts are cut to it (the rest could not be emitted)."""
        B = len(seqs)
        prev_num_tokens = [s.num_tokens for s in seqs]
        sb = self.sampling.build(seqs)
        t0 = time.perf_counter()
        draft = drafter.propose(seqs, k, sb)
        caught_up, use = draft.caught_up, None
        if assist is not None:
            draft, use = draft.take_rows(assist[0].propose(seqs, k, sb), assist[1])
        if room is not None:
            draft = draft.limit(room)
        draft_seconds = time.perf_counter() - t0
        if assist is None and draft.longest is not None and draft.longest < k:
            # No row proposed k drafts (a suffix table without long matches) or has room for k (rows near their
            # token budget): verify only as many positions as the longest proposal (with CUDA graphs, rounded up
            # to a captured depth); none at all is a plain decode step. Lossless and the same tokens as the
            # uncut pass: positions past a row's drafts are rejected anyway, and every random draw is keyed by
            # the row's seed and output position, not the width.
            # (An assisted pass is not cut: its draft model drafted k for every row, as the strategy valued it.)
            if not draft.longest:
                return None
            k = cut_depth(draft.longest, k, self._depths if self.target.graphs is not None else None)
            draft = draft.cut(k)
        last = last_tokens(seqs, self.device)  # [B, 1]
        ids = torch.cat([last, draft.tokens], dim=1)  # [B, k + 1]
        starts = [s.num_cached for s in seqs]
        if self.packs_verify(draft.row_lengths, k):
            # Rows with fewer drafts than the pass is wide compute their real positions only (see `packs_verify`).
            # The LM head runs on the real positions alone. Past a row's drafts the logits are zeros, what the LM
            # head gives a zero hidden state: nothing reads them (no draft there is accepted, and the tokens
            # sampled there are dropped).
            meta, _ = self.target.build_meta(0, starts, [n + 1 for n in draft.row_lengths], True, k + 1)
            real = self.model.logits(self.forward(ids, meta))  # [N, V]
            logits = real.new_zeros(B * (k + 1), real.shape[-1]).index_copy_(0, meta.packed, real).view(B, k + 1, -1)
        else:
            logits = self.model.logits(self.forward_rows(ids, starts))  # [B, k + 1, V]
        res = verify(logits, draft, sb)
        # One host transfer: [B, k + 1] sampled columns plus num_accepted, the draft lengths and the assisted rows.
        flat_seqs = [s for s in seqs for _ in range(k + 1)]
        cols = [res.num_accepted, draft.lengths] + ([] if use is None else [use.to(torch.int64)])
        rows, extra = to_host(res.sample, flat_seqs, extra=torch.stack(cols, 1))
        num_accepted = [e[0] for e in extra]
        assisted = [bool(e[2]) for e in extra] if use is not None else []
        # An assisted row accepted none of the drafter's own drafts (what its cache holds past the last token).
        own = [0 if assisted and assisted[b] else a for b, a in enumerate(num_accepted)]
        drafter.after_step(seqs, prev_num_tokens, own, k)
        tokens = [rows[b * (k + 1) : b * (k + 1) + num_accepted[b] + 1] for b in range(B)]
        return StepResult(seqs, tokens, prev_num_tokens, k=k, num_accepted=num_accepted,
                          num_drafted=[e[1] for e in extra], assisted=assisted, draft_seconds=draft_seconds,
                          caught_up=caught_up)
