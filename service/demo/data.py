"""Training batches of worked solutions: tokenized, bucketed by length, with a loss mask on the solution.

Batches are built from pools of generated problems: a pool is sorted by length and cut into batches of
about `token_budget` tokens (padding included), so short and long problems are trained at similar cost per
step; the batches of a pool are shuffled. Everything is drawn from one seeded generator: the same seed gives
the same batches on every machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from service.demo.task import Difficulty, Problem, sample_problem
from service.tokenizer import Tokenizer

POOL = 512


@dataclass(slots=True)
class Batch:
    ids: torch.Tensor  # [B, T] token ids, right-padded with eos
    mask: torch.Tensor  # [B, T - 1] float: 1 where ids[:, 1:] is a solution token (or the final eos)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())


def encode(tok: Tokenizer, problem: Problem, eos: int) -> tuple[list[int], int]:
    """Prompt + solution + eos as ids, and the number of prompt tokens."""
    prompt = tok.encode(problem.prompt)
    return prompt + tok.encode(problem.solution) + [eos], len(prompt)


def collate(rows: list[tuple[list[int], int]], pad: int) -> Batch:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros(len(rows), width - 1)
    for i, (seq, n_prompt) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, n_prompt - 1 : len(seq) - 1] = 1.0
    return Batch(ids, mask)


def batches(tok: Tokenizer, seed: int, difficulty: Difficulty, token_budget: int) -> Iterator[Batch]:
    """An endless, deterministic stream of length-bucketed batches."""
    eos = tok.eos_token_id
    if eos is None:
        raise ValueError("the demo tokenizer needs an eos token")
    rng = random.Random(seed)
    while True:
        pool = sorted((encode(tok, sample_problem(rng, difficulty), eos) for _ in range(POOL)),
                      key=lambda r: len(r[0]))
        chunks: list[list[tuple[list[int], int]]] = []
        current: list[tuple[list[int], int]] = []
        for row in pool:
            if current and (len(current) + 1) * len(row[0]) > token_budget:
                chunks.append(current)
                current = []
            current.append(row)
        if current:
            chunks.append(current)
        rng.shuffle(chunks)
        for chunk in chunks:
            yield collate(chunk, eos)
