"""Continuous-batching scheduler over plain request objects. No torch here.

Cache slots: every running sequence owns one slot of the static KV cache, and running sequences always
occupy slots 0..B-1 (slot == batch row). When a sequence leaves, the sequence in the last slot moves into
the hole, so a decode batch is always a contiguous view of the cache, even deep in the long tail.

Fairness: requests start in arrival order, all samples of a request at once, except that one request never
runs more than `share` samples (the slots less a reserve of num_slots // 8, at least one). A request with more
samples starts them in parts, each as one of its own ends, and while it is at its share it holds back nobody
behind it. So one request can never take every slot: a request of up to `reserve` samples arriving behind it
starts at the next step (docs/api.md, "Fairness").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from service.backend.admission import request_share
from service.engine.types import Request, SchedulerOutput, Sequence, SequenceStatus, SlotCopy, TokenResult
from service.params import FinishReason


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
        self.share = request_share(num_slots)  # the most samples of one request running at once
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
        assert len(request.seqs) <= self.num_slots, "validate_request bounds n by the slots"
        self.waiting.append(request)

    @property
    def num_waiting_seqs(self) -> int:
        return sum(1 for r in self.waiting for s in r.seqs if s.status is SequenceStatus.WAITING)

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

    def _prefill(self, admitted: list[tuple[Request, list[Sequence]]], moves: list[SlotCopy]) -> SchedulerOutput:
        """One prefill row per distinct prompt: the samples of a request (n > 1) and requests that repeat a
        prompt (a trainer sending a GRPO group as separate requests) get the row's prompt K/V copied."""
        row: dict[tuple[int, ...], int] = {}
        leaders: list[tuple[Sequence, int]] = []  # (sample, its row): row r's leader goes to slot_lo + r
        followers: list[tuple[Sequence, int]] = []
        for r, seqs in admitted:
            for s in seqs:
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
        return SchedulerOutput("prefill", requests=[r for r, _ in admitted], prompts=[list(p) for p in row],
                               seqs=[s for s, _ in leaders + followers],
                               row_of=[r for _, r in leaders + followers], moves=moves, forks=forks, slot_lo=slot_lo)

    def _admit(self) -> list[tuple[Request, list[Sequence]]]:
        """The samples that start this step, by request, in arrival order (see the module's fairness rule)."""
        admitted: list[tuple[Request, list[Sequence]]] = []
        free = self.num_slots - len(self.running)
        longest = 0
        prompts: set[tuple[int, ...]] = set()  # prefill rows so far: a repeated prompt adds none
        for req in list(self.waiting):
            pending = [s for s in req.seqs if s.status is SequenceStatus.WAITING]
            left = len(pending)
            if len(req.seqs) <= self.share:
                if left > free:  # a request within its share starts whole; those behind it wait
                    break
            else:
                room = self.share - sum(1 for s in req.seqs if s.status is SequenceStatus.RUNNING)
                if room <= 0:  # at its share: it cannot start more now, so it holds back nobody
                    continue
                if free == 0:
                    break
                pending = pending[:min(room, free)]
            key = req.prompt_key
            longest_next = max(longest, len(key))
            if admitted and longest_next * (len(prompts) + (key not in prompts)) > self.max_num_batched_tokens:
                break
            admitted.append((req, pending))
            if len(pending) == left:  # every sample has started
                self.waiting.remove(req)
            prompts.add(key)
            free -= len(pending)
            longest = longest_next
        return admitted

    # -- leaving the batch ------------------------------------------------------------------------
    def update_from_output(self, seq: Sequence, tokens: Iterable[TokenResult], eos_token_ids: tuple[int, ...],
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
                pending = [s for s in req.seqs if s.status is SequenceStatus.WAITING]  # the rest run: below
                for s in pending:
                    s.finish(FinishReason.ABORT)
                touched += pending
        for seq in [s for s in self.running if s.request_id == request_id]:
            seq.finish(FinishReason.ABORT)
            self.release(seq)
            touched.append(seq)
        self.aborted += touched
        return touched
