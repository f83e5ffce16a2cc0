"""The demo task: seeded generation, worked solutions that check out line by line, the reward verifier."""

from __future__ import annotations

import re

import pytest

from service.demo.task import (
    ANSWER_PREFIX,
    Difficulty,
    Problem,
    parse_answer,
    parse_prompt,
    problems,
    reward,
    step_accuracy,
)

LINE = re.compile(r"(\d+)\+([a-z])(\d+)=(\d+)(?: \| ([a-z]\d+(?: [a-z]\d+)*))?")


def test_generation_is_seeded() -> None:
    assert problems(50, 7) == problems(50, 7)
    assert problems(50, 7) != problems(50, 8)
    hard = Difficulty(min_terms=5, max_terms=9, max_value=40)
    ps = problems(200, 1, hard)
    assert all(5 <= len(p.numbers) <= 9 and min(p.numbers) >= 1 and max(p.numbers) <= 40 for p in ps)
    assert {len(p.numbers) for p in ps} == set(range(5, 10))


def test_worked_solution_checks_out_line_by_line() -> None:
    for p in problems(300, 3, Difficulty(max_value=99)):
        *steps, last = p.solution.split("\n")
        labels = p.labels
        assert p.prompt.split()[1:] == [f"{c}{x}" for c, x in zip(labels, p.numbers, strict=True)]
        assert len(steps) == len(p.numbers) - 1
        total = p.numbers[0]
        for i, line in enumerate(steps, start=1):
            m = LINE.fullmatch(line)
            assert m is not None, line
            before, label, value, after, todo = m.groups()
            assert (int(before), label, int(value)) == (total, labels[i], p.numbers[i])
            total += p.numbers[i]
            assert int(after) == total
            assert (todo or "") == " ".join(p.pairs[i + 1 :])
        assert last == f"{ANSWER_PREFIX}{p.answer}"
        assert reward(p, p.solution) == 1.0 and step_accuracy(p, p.solution) == 1.0


def test_reward_verifier() -> None:
    p = Problem((7, 1, 5, 9))
    assert p.prompt == "Add: a7 b1 c5 d9\n"
    assert p.solution == "7+b1=8 | c5 d9\n8+c5=13 | d9\n13+d9=22\nAnswer: 22"
    assert Problem((7, 1)).solution == "7+b1=8\nAnswer: 8"
    assert reward(p, p.solution) == 1.0
    assert reward(p, p.solution + "\n\n") == 1.0
    assert reward(p, "Answer: 22") == 1.0  # only the answer is verified
    assert reward(p, p.solution.replace("Answer: 22", "Answer: 23")) == 0.0
    assert reward(p, p.solution + "\n7+b1=8") == 0.0  # the answer must be the last line
    assert reward(p, p.solution.replace("Answer: ", "xAnswer: ")) == 0.0
    assert reward(p, "") == 0.0 and parse_answer("Answer: -4") == -4 and parse_answer("Answer:") is None
    assert step_accuracy(p, "7+b1=8 | c5 d9\n8+c5=14 | d9") == pytest.approx(1 / 4)


def test_prompt_round_trip_and_rejects() -> None:
    for p in problems(50, 11, Difficulty(max_terms=26, max_value=120)):
        assert parse_prompt(p.prompt) == p
    for bad in ("Add: a1\n", "Add: a1 c2\n", "Add: b1 a2\n", "Sum: a1 b2\n", "Add: a1 b\n", "Add: a1  b2\n"):
        assert parse_prompt(bad) is None, bad
    with pytest.raises(ValueError):
        Difficulty(min_terms=1)
    with pytest.raises(ValueError):
        Difficulty(max_terms=27)
    with pytest.raises(ValueError):
        Problem((3,))


def test_lengths_are_long_tailed() -> None:
    lengths = sorted(len(p.solution) for p in problems(4000, 0))
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert p99 > 5 * median
    # longer problems take longer worked solutions
    by_n = {n: len(problems(1, n, Difficulty(min_terms=n, max_terms=n))[0].solution) for n in (2, 5, 10, 20)}
    assert by_n[2] < by_n[5] < by_n[10] < by_n[20]
