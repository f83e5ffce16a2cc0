"""Model-free suffix drafter: continue the sequence the way matching text continued before.

The index for a group (the samples of one prompt, or a trainer-given group id) holds the prompt and output
of every sample, plus recent finished rollouts of the same prompt from earlier steps. Each n-gram
(1 <= n <= max_ngram) maps to where its latest occurrence was followed by another token; a proposal takes
the longest n-gram ending the sequence that occurred before and copies what followed it. Plain dicts on the
host: cheap enough for every step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from service.engine.batch_tensors import DraftProposal, SamplingBatch, proposal_of
from service.engine.drafters.base import Drafter
from service.engine.types import Sequence


@dataclass(slots=True)
class _Group:
    docs: dict[int, list[int]] = field(default_factory=dict)  # doc id -> tokens
    indexed: dict[int, int] = field(default_factory=dict)  # doc id -> positions indexed so far
    table: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)  # n-gram -> (doc, next pos)
    live: int = 0  # running sequences in the group

    def index(self, doc_id: int, max_ngram: int) -> None:
        doc, start = self.docs[doc_id], self.indexed.get(doc_id, 0)
        # n-grams ending at position i (the suffixes of the longest), pointing at the token i + 1 that followed.
        table = self.table
        for i in range(max(start, 0), len(doc) - 1):
            gram, hit = tuple(doc[max(0, i + 1 - max_ngram) : i + 1]), (doc_id, i + 1)
            for j in range(len(gram)):
                table[gram[j:]] = hit
        self.indexed[doc_id] = max(len(doc) - 1, start)

    def lookup(self, tokens: list[int], k: int, max_ngram: int) -> list[int]:
        for n in range(min(max_ngram, len(tokens)), 0, -1):
            hit = self.table.get(tuple(tokens[-n:]))
            if hit is not None:
                doc_id, pos = hit
                return self.docs[doc_id][pos : pos + k]
        return []

    def continuation(self, tokens: list[int], k: int, max_ngram: int) -> list[int]:
        """Up to k tokens; a match that runs into the end of its document is extended by matching again."""
        out: list[int] = []
        while len(out) < k:
            piece = self.lookup((tokens[-max_ngram:] + out)[-max_ngram:], k - len(out), max_ngram)
            if not piece:
                break
            out += piece
        return out


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, device: torch.device, max_ngram: int = 6, history_prompts: int = 4096,
                 history_per_prompt: int = 16) -> None:
        self.device = device
        self.max_ngram = max_ngram
        self.groups: dict[str, _Group] = {}
        self.seq_group: dict[int, str] = {}
        self.history: OrderedDict[tuple[int, ...], deque[list[int]]] = OrderedDict()
        self.history_prompts, self.history_per_prompt = history_prompts, history_per_prompt
        self._next_doc = -1  # history docs get negative ids
        # The continuations found by the last `lookahead`, for (seq id, length) per row, at a depth.
        self._ahead: tuple[list[tuple[int, int]], int, list[list[int]]] | None = None

    def _group_of(self, seq: Sequence) -> _Group:
        key = seq.group_id or seq.request_id
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = _Group()
            for past in self.history.get(tuple(seq.prompt_token_ids), ()):
                doc_id, self._next_doc = self._next_doc, self._next_doc - 1
                group.docs[doc_id] = past
                group.index(doc_id, self.max_ngram)
        if seq.seq_id not in self.seq_group:
            self.seq_group[seq.seq_id] = key
            group.docs[seq.seq_id] = list(seq.prompt_token_ids)
            group.live += 1
        return group

    def observe(self, seq: Sequence) -> None:
        self._ahead = None  # the table changes: continuations found before may not hold
        group = self._group_of(seq)
        doc = group.docs[seq.seq_id]
        missing = seq.num_tokens - len(doc)
        if missing > 0:
            doc += seq.output_token_ids[-missing:]
            group.index(seq.seq_id, self.max_ngram)
        if seq.is_finished:
            self._retire(seq, group)

    def _retire(self, seq: Sequence, group: _Group) -> None:
        key = self.seq_group.pop(seq.seq_id)
        prompt = tuple(seq.prompt_token_ids)
        if seq.output_token_ids:
            past = self.history.setdefault(prompt, deque(maxlen=self.history_per_prompt))
            past.append(list(seq.prompt_token_ids) + list(seq.output_token_ids))
            self.history.move_to_end(prompt)
            while len(self.history) > self.history_prompts:
                self.history.popitem(last=False)
        group.live -= 1
        if group.live <= 0:
            del self.groups[key]

    def _continuations(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        key = [(s.seq_id, s.num_tokens) for s in seqs]
        if self._ahead is not None and self._ahead[0] == key and self._ahead[1] >= k:
            return [c[:k] for c in self._ahead[2]]  # a continuation's first k tokens are its k-continuation
        conts = []
        for seq in seqs:
            group = self._group_of(seq)
            conts.append(group.continuation(group.docs[seq.seq_id], k, self.max_ngram))
        self._ahead = (key, k, conts)
        return conts

    def lookahead(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        return self._continuations(seqs, k)

    def propose(self, seqs: list[Sequence], k: int, sb: SamplingBatch) -> DraftProposal:
        return proposal_of(self._continuations(seqs, k), k, self.device)

    def reset(self) -> None:
        self.history.clear()
