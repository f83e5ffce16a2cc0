"""Logit processing and sampling, vectorised over rows with per-row parameters.

Processing (the distribution a token is drawn from, and whose logprob we return):
    penalties (engine/penalties.py) -> logits / temperature -> keep top_k -> keep smallest set with mass >= top_p
    -> drop p < min_p * p_max -> renormalise.  Greedy rows (temperature 0) are processed with temperature 1 and
    take the argmax of the penalised logits.
Randomness is counter-based: the uniform for a row is a hash of (sequence seed, output position, stream),
so a seeded sequence samples the same tokens whatever else shares its batch, with no per-row generator.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace

import torch

from service.engine.penalties import Penalties
from service.engine.sequence import Sequence

_M32 = 0xFFFFFFFF
STREAM_SAMPLE, STREAM_ACCEPT, STREAM_DRAFT = 0, 1, 2


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) on int64 tensors holding values < 2^32 (a new tensor)."""
    x = x & _M32
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= _M32
    x ^= x >> 15
    x *= 0x846CA68B
    x &= _M32
    x ^= x >> 16
    return x


def seed_keys(seeds: torch.Tensor) -> torch.Tensor:
    """The part of a row's uniforms that depends on its seed alone (int64 [N] -> [N]): hashed once per batch
    (`SamplingBatch.build`), not in every draw. A draw's own hashing is then half the ops it was: at batch 1
    each op is a few microseconds of dispatch, and the hash was most of a plain step's sampling."""
    return _mix32(_mix32((seeds >> 32) + 0x9E3779B9) ^ (seeds & _M32))


def uniforms(keys: torch.Tensor, counters: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for rows' seed keys [N] (`seed_keys`) and counters [N] or [N, K] (counters >= 0);
    float32, counters' shape. A function of (seed, counter, stream) alone; `stream` may differ by column ([K])."""
    if counters.dim() == 2:
        keys = keys[:, None]
    h = _mix32(keys ^ (counters & _M32))
    h = _mix32(h ^ (counters >> 32) ^ (stream * 0x85EBCA6B))
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors [N], plus which optional steps any row needs."""

    temperature: torch.Tensor  # 1.0 for greedy rows
    greedy: torch.Tensor  # bool
    top_p: torch.Tensor
    top_k: torch.Tensor  # long, vocab size where disabled
    min_p: torch.Tensor
    seed_keys: torch.Tensor  # int64: each row's seed, hashed (`seed_keys`)
    counters: torch.Tensor  # int64: output position of the token being sampled
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    all_greedy: bool
    need_raw: bool
    num_top_logprobs: int
    # Steps a batch can skip (each a pass over [rows, vocab] at a full batch; the defaults skip nothing)
    any_greedy: bool = True  # False: no row takes an argmax
    unit_temperature: bool = False  # True: every row's temperature is 1.0 (x / 1.0 == x)
    penalties: Penalties | None = None  # None: no row has a penalty

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
        """The batch of these sequences' parameters, at their current output positions."""
        params = [s.params for s in seqs]
        sb = cls.of([p.temperature for p in params], [p.top_p for p in params], [p.top_k for p in params],
                    [p.min_p for p in params], [s.seed for s in seqs], [len(s.output_token_ids) for s in seqs],
                    vocab_size, device, need_raw=any(p.raw_logprobs for p in params),
                    num_top_logprobs=max((p.top_logprobs for p in params), default=0))
        sb.penalties = Penalties.build(seqs, vocab_size, device)
        return sb

    def penalised(self, logits: torch.Tensor, drafted: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, V] with the rows' penalties at their next position (after `drafted` [N, j] of this step's
        drafts), or the same tensor where no row has a penalty."""
        return logits if self.penalties is None else self.penalties.apply(logits, drafted)

    @classmethod
    def of(cls, temps: list[float], top_ps: list[float], top_ks: list[int], min_ps: list[float], seeds: list[int],
           counters: list[int], vocab_size: int, device: torch.device, need_raw: bool = False,
           num_top_logprobs: int = 0) -> SamplingBatch:
        """Per-row parameters (temperature 0: greedy; top_k outside (0, vocab): off) as two host-built tensors (one
        float32, one int64) whose columns are the fields, and the flags saying which steps any row needs."""
        greedy = [t == 0 for t in temps]
        top_k = [k if 0 < k < vocab_size else vocab_size for k in top_ks]
        floats = torch.tensor(
            [[1.0 if g else t, p, m, float(g)] for g, t, p, m in zip(greedy, temps, top_ps, min_ps, strict=True)],
            dtype=torch.float32, device=device,
        ).reshape(-1, 4)
        ints = torch.tensor(
            [list(row) for row in zip(top_k, seeds, counters, strict=True)], dtype=torch.int64, device=device,
        ).reshape(-1, 3)
        return cls(
            temperature=floats[:, 0], greedy=floats[:, 3] > 0, top_p=floats[:, 1], top_k=ints[:, 0],
            min_p=floats[:, 2], seed_keys=seed_keys(ints[:, 1]), counters=ints[:, 2],
            use_top_k=any(k < vocab_size for k in top_k),
            use_top_p=any(p < 1.0 for p in top_ps),
            use_min_p=any(m > 0.0 for m in min_ps),
            all_greedy=bool(greedy) and all(greedy),
            need_raw=need_raw,
            num_top_logprobs=num_top_logprobs,
            any_greedy=any(greedy),
            unit_temperature=all(g or t == 1.0 for g, t in zip(greedy, temps, strict=True)),
        )


def int_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] on `device`, through a buffer: several times faster than `torch.tensor` of a list."""
    return torch.frombuffer(array("q", values), dtype=torch.int64).to(device)


class SamplingRows:
    """`SamplingBatch.build` for the steps of one engine, keeping the last batch's parameters: a decode batch keeps
    its sequences from step to step (it changes when one joins or ends), and then only the output positions
    (`counters`) are new. At batch 64 that is a tenth of a millisecond a step less on the host."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self._seq_ids: tuple[int, ...] = ()
        self._last: SamplingBatch | None = None

    def build(self, seqs: list[Sequence]) -> SamplingBatch:
        seq_ids = tuple(s.seq_id for s in seqs)  # unique per sequence, whose parameters never change
        if self._last is None or seq_ids != self._seq_ids:
            self._last, self._seq_ids = SamplingBatch.build(seqs, self.vocab_size, self.device), seq_ids
            return self._last
        pen = self._last.penalties
        self._last = replace(self._last, counters=int_tensor([len(s.output_token_ids) for s in seqs], self.device),
                             penalties=None if pen is None else pen.advanced(seqs))
        return self._last


def process_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """float32 logits [N, V] or [N, K, V] (row n's parameters for all K) -> processed logprobs, same shape
    (-inf outside the kept set)."""
    col = lambda t: t[(..., *(None,) * (logits.dim() - 1))]
    scaled = logits if sb.all_greedy or sb.unit_temperature else logits / col(sb.temperature)
    if sb.use_top_k or sb.use_top_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)
        drop = (rank >= col(sb.top_k)).expand(scaled.shape)  # [N, (K,) V] in sorted order
        if sb.use_top_p:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
            mass_before = probs.cumsum(-1) - probs
            drop = drop | (mass_before >= col(sb.top_p))
        unsorted = torch.zeros(scaled.shape, dtype=torch.bool, device=scaled.device).scatter_(-1, order, drop)
        scaled = scaled.masked_fill(unsorted, float("-inf"))
    if sb.use_min_p:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < col(sb.min_p) * probs.amax(-1, keepdim=True), float("-inf"))
    return scaled.log_softmax(-1)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (unnormalised is fine), u [N] in (0, 1) -> token ids [N]."""
    cdf = probs.cumsum(-1)
    target = u[:, None] * cdf[:, -1:]
    return (cdf < target).sum(-1).clamp_(max=probs.shape[-1] - 1)


@dataclass(slots=True)
class SampleResult:
    tokens: torch.Tensor  # [N] long
    logprobs: torch.Tensor  # [N] processed logprob of the token
    raw_logprobs: torch.Tensor | None  # [N]
    top_ids: torch.Tensor | None  # [N, K]
    top_values: torch.Tensor | None  # [N, K]


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleResult:
    """Draw one token per row from float32 logits [N, V]."""
    penalised = sb.penalised(logits)
    logprobs = process_logits(penalised, sb)
    if sb.all_greedy:
        tokens = penalised.argmax(-1)
    else:
        drawn = sample_from(logprobs.exp(), uniforms(sb.seed_keys, sb.counters, STREAM_SAMPLE))
        tokens = torch.where(sb.greedy, penalised.argmax(-1), drawn) if sb.any_greedy else drawn
    return finish_sample(tokens, logprobs, logits, sb)


def finish_sample(
    tokens: torch.Tensor, logprobs: torch.Tensor, logits: torch.Tensor, sb: SamplingBatch
) -> SampleResult:
    """Gather the returned logprobs for chosen tokens [N] from processed logprobs [N, V] (raw ones from the
    unprocessed `logits`: no penalties either)."""
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    raw = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1) if sb.need_raw else None
    top_ids = top_values = None
    if sb.num_top_logprobs:
        top_values, top_ids = logprobs.topk(min(sb.num_top_logprobs, logprobs.shape[-1]), dim=-1)
    return SampleResult(tokens, chosen, raw, top_ids, top_values)


def draw_draft(logits: torch.Tensor, sb: SamplingBatch, j: int,
               drafted: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft position j: draw a token [B] from the processed draft distribution q [B, V] (the draft's own
    random stream), penalised like the target's after the tokens `drafted` before it ([B] each). Greedy rows
    propose the argmax deterministically, so their q is one-hot. (Penalising the draft only raises acceptance:
    verification reads q, whatever it is.)"""
    if sb.penalties is not None:
        logits = sb.penalised(logits, torch.stack(drafted, 1) if drafted else None)
    q = process_logits(logits, replace(sb, counters=sb.counters + j) if j else sb).exp()
    drawn = sample_from(q, uniforms(sb.seed_keys, sb.counters + j, STREAM_DRAFT))
    if not sb.any_greedy:
        return drawn, q
    greedy_tok = logits.argmax(-1)
    tok = torch.where(sb.greedy, greedy_tok, drawn)
    q = torch.where(sb.greedy[:, None], torch.nn.functional.one_hot(greedy_tok, q.shape[-1]).to(q.dtype), q)
    return tok, q
