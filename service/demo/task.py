"""The demo task: running sums with worked steps, a verifiable reward and long-tailed response lengths.

A problem is 2..26 small numbers labelled a, b, c, ...; the worked solution adds them one per line, keeping the
running total and carrying the numbers still to add, then answers (`Add: a7 b1` ... `Answer: 8`). Each line needs
only the one above it, and a labelled number is one token with the demo tokenizer, so a small decoder learns the
task in minutes. A problem with n numbers takes about n^2 / 2 + 8 n tokens and n follows a power law, so a batch
of responses has a long tail. The reward is 1 when the last line is `Answer: <the sum>`, else 0. Problems come
from a seed: the same on every machine.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

PROMPT_PREFIX = "Add: "
ANSWER_PREFIX = "Answer: "
LABELS = "abcdefghijklmnopqrstuvwxyz"
_ANSWER = re.compile(r"(?:^|\n)Answer: (-?\d+)$")
_PAIR = re.compile(r"([a-z])(\d+)")


@dataclass(frozen=True, slots=True)
class Difficulty:
    """How problems are drawn: n terms with P(n) ~ n^-power on [min_terms, max_terms], terms in [1, max_value]."""

    min_terms: int = 2
    max_terms: int = 20
    power: float = 1.6
    max_value: int = 9

    def __post_init__(self) -> None:
        if not 2 <= self.min_terms <= self.max_terms <= len(LABELS):
            raise ValueError(f"need 2 <= min_terms <= max_terms <= 26, got {self.min_terms}, {self.max_terms}")
        if self.max_value < 1:
            raise ValueError(f"max_value must be >= 1, got {self.max_value}")

    def weights(self) -> list[float]:
        return [n ** -self.power for n in range(self.min_terms, self.max_terms + 1)]


@dataclass(frozen=True, slots=True)
class Problem:
    numbers: tuple[int, ...]  # the values of a, b, c, ... (added in this order)

    def __post_init__(self) -> None:
        if not 2 <= len(self.numbers) <= len(LABELS) or min(self.numbers) < 0:
            raise ValueError(f"a problem has 2..26 non-negative numbers, got {self.numbers}")

    @property
    def answer(self) -> int:
        return sum(self.numbers)

    @property
    def labels(self) -> str:
        return LABELS[: len(self.numbers)]

    @property
    def pairs(self) -> list[str]:
        return [f"{c}{x}" for c, x in zip(self.labels, self.numbers, strict=True)]

    @property
    def prompt(self) -> str:
        return PROMPT_PREFIX + " ".join(self.pairs) + "\n"

    @property
    def solution(self) -> str:
        """The worked solution (what the model should write after the prompt), without end-of-text."""
        pairs, total, lines = self.pairs, self.numbers[0], []
        for i, x in enumerate(self.numbers[1:], start=1):
            todo = f" | {' '.join(pairs[i + 1 :])}" if i + 1 < len(pairs) else ""
            lines.append(f"{total}+{pairs[i]}={total + x}{todo}")
            total += x
        lines.append(f"{ANSWER_PREFIX}{total}")
        return "\n".join(lines)

    @property
    def text(self) -> str:
        return self.prompt + self.solution


def sample_problem(rng: random.Random, difficulty: Difficulty = Difficulty()) -> Problem:
    ns = range(difficulty.min_terms, difficulty.max_terms + 1)
    n = rng.choices(ns, weights=difficulty.weights())[0]
    return Problem(tuple(rng.randint(1, difficulty.max_value) for _ in range(n)))


def problems(count: int, seed: int, difficulty: Difficulty = Difficulty()) -> list[Problem]:
    """`count` problems drawn with `seed`: the same list on every machine (Python's Mersenne Twister)."""
    rng = random.Random(seed)
    return [sample_problem(rng, difficulty) for _ in range(count)]


def parse_prompt(prompt: str) -> Problem | None:
    """The problem a prompt asks (None when it is not one of ours)."""
    if not prompt.startswith(PROMPT_PREFIX):
        return None
    pairs = prompt[len(PROMPT_PREFIX) :].strip().split(" ")
    found = [_PAIR.fullmatch(p) for p in pairs]
    if len(pairs) < 2 or any(m is None for m in found):
        return None
    if "".join(m.group(1) for m in found if m) != LABELS[: len(pairs)]:
        return None
    return Problem(tuple(int(m.group(2)) for m in found if m))


def parse_answer(completion: str) -> int | None:
    """The number on the completion's final ``Answer:`` line, or None."""
    m = _ANSWER.search(completion.strip())
    return int(m.group(1)) if m else None


def reward(problem: Problem, completion: str) -> float:
    """1.0 when the completion ends with the correct ``Answer: <sum>`` line, else 0.0."""
    return 1.0 if parse_answer(completion) == problem.answer else 0.0


def step_accuracy(problem: Problem, completion: str) -> float:
    """Fraction of the reference solution's lines the completion reproduced exactly, in order (diagnostic)."""
    ref = problem.solution.split("\n")
    got = completion.strip().split("\n")
    good = sum(1 for a, b in zip(ref, got, strict=False) if a == b)
    return good / len(ref)
