"""Every tensor a step builds from host lists: token ids, positions, cache slots, the rows a forward's output is
read at, each row's sampling parameters (`SamplingBatch`) and penalties, and a drafter's proposal (`DraftProposal`).

Each is built for the whole batch at once: one host->device copy per tensor (through a buffer, `int_tensor`),
no per-row device operation, and nothing here reads a device tensor back, so the step's one device->host
transfer stays the runner's (`to_host`). The model, the runner, the sampler and the drafters all call it.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, replace

import torch

from service.engine.penalties import Penalties
from service.engine.randomness import seed_keys
from service.engine.types import Sequence


def int_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] on `device`, through a buffer: several times faster than `torch.tensor` of a list."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(array("q", values), dtype=torch.int64).to(device)


def padded_ids(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Token ids [B, Q] of rows of different lengths, each padded with 0 to the longest (Q)."""
    Q = max(map(len, rows))
    return int_tensor([t for r in rows for t in itertools.chain(r, itertools.repeat(0, Q - len(r)))],
                      device).view(len(rows), Q)


def last_tokens(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """Each sequence's newest token [B, 1]: what a decode or verify pass feeds first."""
    return int_tensor([s.last_token for s in seqs], device)[:, None]


def positions(starts: list[int], q_lens: list[int], width: int, scratch: int, device: torch.device) -> torch.Tensor:
    """Positions [B, width]: row b's tokens at starts[b], starts[b] + 1, ...; its padding past q_lens[b] at the
    scratch position (written, never read)."""
    B, j = len(starts), torch.arange(width, device=device)
    if all(n == width for n in q_lens):  # decode and verify steps: no padding
        return int_tensor(starts, device)[:, None] + j
    host = int_tensor(starts + q_lens, device).view(2, B, 1)
    return torch.where(j < host[1], host[0] + j, scratch)


def write_slots(slot_lo: int, rows: int, width: int, device: torch.device) -> torch.Tensor:
    """The cache slot of each new token [rows * width]: row b writes slot slot_lo + b."""
    return torch.arange(slot_lo, slot_lo + rows, device=device).repeat_interleave(width)


def packed_rows(q_lens: list[int], width: int, device: torch.device) -> torch.Tensor:
    """The real tokens' indices on the padded [B * width] grid (a packed forward computes only these), in order."""
    real = torch.arange(width) < torch.tensor(q_lens)[:, None]  # on the host: no device read-back
    return real.view(-1).nonzero().squeeze(1).to(device)


def last_rows(q_lens: list[int], packed: bool, device: torch.device) -> torch.Tensor:
    """The row of each sequence's last new token among a forward's hidden states seen as rows: [B * Q, hidden]
    on the padded grid, [N, hidden] packed (each sequence's tokens in turn)."""
    Q = max(q_lens)
    ends = itertools.accumulate(q_lens) if packed else (b * Q + n for b, n in enumerate(q_lens))
    return int_tensor([e - 1 for e in ends], device)


def graph_positions(starts: list[int], width: int, rows: int, scratch: int) -> torch.Tensor:
    """Host positions [rows * width] for a CUDA graph's static buffer: the real rows' positions, then padded rows
    at the scratch position."""
    real = int_tensor(starts, torch.device("cpu"))[:, None] + torch.arange(width)
    return torch.cat([real.view(-1), torch.full(((rows - len(starts)) * width,), scratch, dtype=torch.int64)])


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
        sb.penalties = penalties_of(seqs, vocab_size, device)
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
                             penalties=None if pen is None else advanced(pen, seqs))
        return self._last


def penalties_of(seqs: list[Sequence], vocab_size: int, device: torch.device) -> Penalties | None:
    """The penalties of these sequences (None where no row has one), counting their output so far."""
    params = [s.params for s in seqs]
    if not any(p.penalised for p in params):
        return None
    values = torch.tensor([[p.frequency_penalty, p.presence_penalty, p.repetition_penalty] for p in params],
                          dtype=torch.float32, device=device)
    in_prompt = None
    if any(p.repetition_penalty != 1 for p in params):
        in_prompt = torch.zeros(len(seqs), vocab_size, dtype=torch.bool, device=device)
        rows, ids = _flat([s.prompt_token_ids if s.params.repetition_penalty != 1 else [] for s in seqs], device)
        in_prompt[rows, ids] = True
    counts = torch.zeros(len(seqs), vocab_size, dtype=torch.float32, device=device)
    pen = Penalties(values[:, 0], values[:, 1], values[:, 2], counts, in_prompt, [0] * len(seqs))
    return advanced(pen, seqs)

def advanced(pen: Penalties, seqs: list[Sequence]) -> Penalties:
    """These penalties for the same rows after they gained tokens: only the new tokens are counted (a new
    counts tensor; this one is left as it was)."""
    if any(len(s.output_token_ids) < c for s, c in zip(seqs, pen.counted, strict=True)):
        return penalties_of(seqs, pen.counts.shape[1], pen.counts.device)  # type: ignore[return-value]
    new = [s.output_token_ids[c:] if s.params.penalised else [] for s, c in zip(seqs, pen.counted, strict=True)]
    counted = [len(s.output_token_ids) for s in seqs]
    if not any(new):
        return Penalties(pen.frequency, pen.presence, pen.repetition, pen.counts, pen.in_prompt, counted)
    rows, ids = _flat(new, pen.counts.device)
    counts = pen.counts.index_put((rows, ids), torch.ones(len(ids), device=pen.counts.device), accumulate=True)
    return Penalties(pen.frequency, pen.presence, pen.repetition, counts, pen.in_prompt, counted)


def _flat(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) int64 tensors of every token in `rows`."""
    index = [i for i, toks in enumerate(rows) for _ in toks]
    ids = [t for toks in rows for t in toks]
    return (torch.tensor(index, dtype=torch.int64, device=device), torch.tensor(ids, dtype=torch.int64, device=device))


@dataclass(slots=True)
class DraftProposal:
    """A drafter's proposal for a verify pass: per row, up to k draft tokens and the distribution each was drawn
    from."""

    tokens: torch.Tensor  # [B, k] long
    lengths: torch.Tensor  # [B] long, valid drafts per row (<= k)
    probs: torch.Tensor | None  # [B, k, V] processed draft distribution; None = deterministic (one-hot)
    row_lengths: list[int] | None = None  # `lengths` on the host, where the drafter knows them there (no sync)
    one_hot_rows: torch.Tensor | None = None  # [B] bool: rows drafted deterministically though probs is given
    caught_up: tuple[int, float] = (0, 0.0)  # tokens fed to catch up before drafting (`Drafter.catch_up`), seconds

    @property
    def longest(self) -> int | None:
        """The most drafts any row has, where known on the host."""
        return None if self.row_lengths is None else max(self.row_lengths, default=0)

    def cut(self, k: int) -> DraftProposal:
        """The first k draft positions: what a verify pass needs when no row proposed more."""
        probs = None if self.probs is None else self.probs[:, :k]
        rows = None if self.row_lengths is None else [min(n, k) for n in self.row_lengths]
        return DraftProposal(self.tokens[:, :k], self.lengths.clamp(max=k), probs, rows, self.one_hot_rows,
                             self.caught_up)

    def limit(self, room: list[int]) -> DraftProposal:
        """Each row's drafts cut to its `room`: the tokens it may still emit, less one (the bonus or correction
        token). A row ends at its token budget, so a draft past its room would never be emitted, only verified.
        Lossless: the room is known before the step, and a position past a row's drafts is a rejection with
        q = 0 (the row samples from p there), so the tokens it emits are distributed as before."""
        k = self.tokens.shape[1]
        if min(room, default=k) >= k:
            return self
        cap = torch.tensor(room, dtype=self.lengths.dtype, device=self.lengths.device)
        rows = None if self.row_lengths is None else [min(n, r) for n, r in zip(self.row_lengths, room, strict=True)]
        return DraftProposal(self.tokens, torch.minimum(self.lengths, cap), self.probs, rows, self.one_hot_rows,
                             self.caught_up)

    def take_rows(self, assistant: DraftProposal, min_drafts: int) -> tuple[DraftProposal, torch.Tensor]:
        """Rows the deterministic drafter `assistant` (same k, probs None) has at least `min_drafts` drafts for take
        its drafts; the others keep these. Returns the joint proposal and those rows ([B] bool). Lossless:
        each row's drafts come from one proposal, chosen before the step."""
        if assistant.probs is not None or assistant.tokens.shape != self.tokens.shape:
            raise ValueError("a lookahead drafter's proposal must be deterministic and as deep as the one it joins")
        use = assistant.lengths >= min_drafts  # [B]
        rows = None
        if assistant.row_lengths is not None and self.row_lengths is not None:
            rows = [h if h >= min_drafts else n for h, n in zip(assistant.row_lengths, self.row_lengths, strict=True)]
        one_hot = use if self.one_hot_rows is None else use | self.one_hot_rows
        joint = DraftProposal(torch.where(use[:, None], assistant.tokens, self.tokens),
                              torch.where(use, assistant.lengths, self.lengths), self.probs, rows, one_hot,
                              self.caught_up)
        return joint, use


def proposal_of(rows: list[list[int]], k: int, device: torch.device) -> DraftProposal:
    """A deterministic drafter's proposal from host lists: row b drafts rows[b] (at most k tokens)."""
    lengths = [len(r) for r in rows]
    return DraftProposal(int_tensor([t for r in rows for t in r + [0] * (k - len(r))], device).view(len(rows), k),
                         int_tensor(lengths, device), None, lengths)
