"""Continuous-batching scheduler over plain request objects. No torch here.

Cache slots: every running sequence owns one slot of the static KV cache, and running sequences always
occupy slots 0..B-1 (slot == batch row). When a sequence leaves, the sequence in the last slot moves into
the hole, so a decode batch is always a contiguous view of the cache, even deep in the long tail.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from service.engine.sequence import Request, Sequence, SequenceStatus
from service.params import FinishReason


class SampledToken(Protocol):
    """One token a step sampled for a sequence (the runner's TokenResult)."""

    token: int
    logprob: float
    raw_logprob: float | None
    top: dict[int, float] | None


@dataclass(slots=True)
class SlotCopy:
    """Copy K/V positions [0, length) of cache slot `src` into slot `dst`."""

    src: int
    dst: int
    length: int


@dataclass(slots=True)
class SchedulerOutput:
    kind: str  # "prefill" | "decode" | "idle"
    # Prefill: the admitted requests; one row per distinct prompt, rows occupy slots [slot_lo, slot_lo +
    # len(prompts)); seqs are every admitted sample in slot order from slot_lo, row_of[i] the row of seqs[i].
    requests: list[Request] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    row_of: list[int] = field(default_factory=list)
    # Decode: running sequences in slot order, slots [0, len(seqs)).
    seqs: list[Sequence] = field(default_factory=list)
    # Compaction moves to apply, in order, before the forward pass.
    moves: list[SlotCopy] = field(default_factory=list)
    # After a prefill: copy each row's prompt K/V into the slots of the other samples with that prompt.
    forks: list[SlotCopy] = field(default_factory=list)
    slot_lo: int = 0


@dataclass(slots=True)
class PauseState:
    """Whether generation is paused (no batch is scheduled; aborted sequences still finish) and whether admission
    is held (running sequences go on, no waiting request starts: a wait-mode pause or push drains the batch).
    The engine thread's holds (service/engine/holds.py) set it; the scheduler follows it."""

    paused: bool = False
    held: bool = False


class Scheduler:
    def __init__(self, num_slots: int, max_num_batched_tokens: int) -> None:
        if num_slots < 1:
            raise ValueError("the KV cache must hold at least one sequence")
        self.num_slots = num_slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []  # running[i].slot == i
        # (src, dst, sequence): the copy length is read at schedule time, after the step that moved the
        # sequence has finished updating its cached length.
        self._pending_moves: list[tuple[int, int, Sequence]] = []
        self.pause = PauseState()
        self.aborted: list[Sequence] = []  # finished by `abort` since the engine last took them (`take_aborted`)

    # -- queue management -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.params.n > self.num_slots:
            raise ValueError(f"n={request.params.n} exceeds the {self.num_slots} sequences the KV cache holds")
        self.waiting.append(request)

    @property
    def num_waiting_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.waiting)

    def has_work(self) -> bool:
        """Sequences wait or run, or aborted ones still have their final output to hand out."""
        return bool(self.waiting or self.running or self.aborted)

    def schedule(self) -> SchedulerOutput:
        if self.pause.paused:  # compaction waits too: the moves' lengths are read when a batch runs again
            return SchedulerOutput("idle")
        moves = [SlotCopy(src, dst, seq.num_cached) for src, dst, seq in self._pending_moves]
        self._pending_moves = []
        admitted = [] if self.pause.held else self._admit()
        if admitted:
            return self._prefill(admitted, moves)
        if self.running:
            return SchedulerOutput("decode", seqs=list(self.running), moves=moves)
        return SchedulerOutput("idle", moves=moves)

    def _prefill(self, admitted: list[Request], moves: list[SlotCopy]) -> SchedulerOutput:
        """One prefill row per distinct prompt: the samples of a request (n > 1) and requests that repeat a
        prompt (a trainer sending a GRPO group as separate requests) get the row's prompt K/V copied."""
        row: dict[tuple[int, ...], int] = {}
        leaders: list[tuple[Sequence, int]] = []  # (sample, its row): row r's leader goes to slot_lo + r
        followers: list[tuple[Sequence, int]] = []
        for r in admitted:
            for s in r.seqs:
                if r.prompt_key in row:
                    followers.append((s, row[r.prompt_key]))
                else:
                    row[r.prompt_key] = len(row)
                    leaders.append((s, row[r.prompt_key]))
        slot_lo = len(self.running)
        for s, _ in leaders + followers:
            s.slot = len(self.running)
            s.status = SequenceStatus.RUNNING
            self.running.append(s)
        forks = [SlotCopy(slot_lo + r, s.slot, len(s.prompt_token_ids)) for s, r in followers]
        return SchedulerOutput("prefill", requests=admitted, prompts=[list(p) for p in row],
                               seqs=[s for s, _ in leaders + followers],
                               row_of=[r for _, r in leaders + followers], moves=moves, forks=forks, slot_lo=slot_lo)

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        free = self.num_slots - len(self.running)
        longest = 0
        prompts: set[tuple[int, ...]] = set()  # prefill rows so far: a repeated prompt adds none
        while self.waiting:
            req = self.waiting[0]
            need = len(req.seqs)
            key = req.prompt_key
            longest_next = max(longest, len(key))
            over_budget = longest_next * (len(prompts) + (key not in prompts)) > self.max_num_batched_tokens
            if need > free or (admitted and over_budget):
                break
            self.waiting.popleft()
            admitted.append(req)
            prompts.add(key)
            free -= need
            longest = longest_next
        return admitted

    # -- leaving the batch ------------------------------------------------------------------------
    def update_from_output(self, seq: Sequence, tokens: Iterable[SampledToken], eos_token_ids: tuple[int, ...],
                           max_model_len: int) -> bool:
        """Append one sequence's tokens of a step in order, stopping exactly where plain decoding would; a
        sequence that finished leaves the batch (its slot is freed). Returns whether it finished."""
        finished = False
        for t in tokens:
            finished = seq.append_token(t.token, t.logprob, t.raw_logprob, t.top, eos_token_ids, max_model_len)
            if finished:
                break
        seq.num_cached = seq.num_tokens - 1  # every token but the newest has its K/V in the cache
        if finished:
            self.release(seq)
        return finished

    def take_aborted(self) -> list[Sequence]:
        aborted, self.aborted = self.aborted, []
        return aborted

    def release(self, seq: Sequence) -> None:
        """Free a finished sequence's slot, moving the last running sequence into the hole."""
        slot = seq.slot
        if slot < 0 or slot >= len(self.running) or self.running[slot] is not seq:
            return
        last = len(self.running) - 1
        if slot != last:
            mover = self.running[last]
            self.running[slot] = mover
            mover.slot = slot
            self._pending_moves.append((last, slot, mover))
        self.running.pop()
        seq.slot = -1

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request with reason abort; returns the sequences it touched (kept for
        `take_aborted` too)."""
        touched: list[Sequence] = []
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                for s in req.seqs:
                    s.finish(FinishReason.ABORT)
                touched += req.seqs
        for seq in [s for s in self.running if s.request_id == request_id]:
            seq.finish(FinishReason.ABORT)
            self.release(seq)
            touched.append(seq)
        self.aborted += touched
        return touched
