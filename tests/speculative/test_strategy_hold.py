"""A choice that costs much of a short step decides the next steps too (engine/strategy_driver.py), with a real
suffix table and sequences; the step seconds and the share are set, so nothing here is timed."""

from __future__ import annotations

import pytest
import torch

from service.engine import strategy_driver
from service.engine.drafters.suffix import SuffixDrafter
from service.engine.strategy import AdaptiveStrategy, Arm
from service.engine.strategy_driver import StrategyDriver
from service.engine.types import Sequence
from service.params import SamplingParams

MATCHES = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # the table proposes 3, 4, 1, ... for it
MISSES = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # nothing to continue


def seq(prompt: list[int]) -> Sequence:
    return Sequence("r", 0, prompt, SamplingParams(max_tokens=100), 0)


def rows_of(d: StrategyDriver, *prompts: list[int]) -> list[Sequence]:
    """Sequences of these tokens (the last one emitted), indexed by the driver's suffix table (as after a prefill)."""
    out = [seq(p[:-1]) for p in prompts]
    for s, p in zip(out, prompts, strict=True):
        s.output_token_ids.append(p[-1])  # its first token: the table indexes what a row emitted
        d.drafters["suffix"].observe(s)
    return out


def driver(monkeypatch, share: float) -> StrategyDriver:
    """A driver past its probes (two buckets' plain steps, the table well known), steps of 1 or 2 rows 1 s long."""
    monkeypatch.setattr(strategy_driver, "CHOICE_SHARE", share)
    strategy = AdaptiveStrategy(["suffix"], seed=0)
    strategy._plain_buckets.update({1, 2})
    table = strategy.accept["suffix"]
    table.hits, table.trials = [1e3] * len(table.hits), [1e3] * len(table.trials)  # its drafts are right
    out = StrategyDriver(strategy, {"suffix": SuffixDrafter(torch.device("cpu"))})
    out._step_s = {1: 1.0, 2: 1.0}
    return out


def choose(d: StrategyDriver, seqs: list[Sequence]) -> tuple[Arm, bool]:
    return d.choose(seqs, [50] * len(seqs)), d.held


def test_a_choice_decides_at_most_max_hold_steps(monkeypatch):
    d = driver(monkeypatch, 1e-12)  # any choice costs more than this share of a 1 s step
    rows = rows_of(d, MATCHES)
    first, held = choose(d, rows)
    assert first.drafter == "suffix" and not held
    assert choose(d, rows) == (first, False)  # the same arm again: it decides the next steps
    for _ in range(strategy_driver.MAX_HOLD - 1):
        assert choose(d, rows) == (first, True)
    assert choose(d, rows)[1] is False  # a new choice
    assert choose(d, rows)[1] is True
    d._held, d._last = None, Arm("suffix", 1)  # the choice before was another arm: a switch
    assert choose(d, rows) == (first, False) and choose(d, rows) == (first, False)
    assert choose(d, rows)[1] is True


def test_no_hold_where_the_choice_is_a_small_share_of_the_step(monkeypatch):
    d = driver(monkeypatch, 1e9)
    rows = rows_of(d, MATCHES)
    assert not any(choose(d, rows)[1] for _ in range(10))


def test_a_step_is_priced_by_its_own_batch_buckets_steps(monkeypatch):
    """A batch of 3 (bucket 4) whose bucket never ran a step is not held on the 1 s of the one-row steps; once one
    of its steps lasted 1 s, it is."""
    d = driver(monkeypatch, 1e-12)
    rows = rows_of(d, MATCHES, MISSES, MISSES)
    assert not any(choose(d, rows)[1] for _ in range(6))
    d._step_s[4] = 1.0
    choose(d, rows)
    choose(d, rows)
    assert choose(d, rows)[1] is True


@pytest.mark.parametrize("change", ["batch", "proposals", "push", "compiled"])
def test_a_hold_ends_where_what_it_was_chosen_for_changes(monkeypatch, change):
    d = driver(monkeypatch, 1e-12)
    rows = rows_of(d, MATCHES, MISSES)
    choose(d, rows)
    choose(d, rows)
    assert choose(d, rows)[1] is True
    if change == "batch":
        rows = rows[:1]  # a row finished
    elif change == "proposals":
        rows = rows_of(d, MATCHES, MATCHES)  # the table matches another row now
    elif change == "push":
        d.renew("suffix")
    else:
        d.strategy.forget_costs()  # compiled forwards took over: plain steps are probed again
    assert choose(d, rows)[1] is False


def test_a_probe_is_never_held(monkeypatch):
    d = driver(monkeypatch, 1e-12)
    rows = rows_of(d, MATCHES)
    d.renew("suffix")  # barely known again: a draw that picks it probes it at the smallest k
    picks = [choose(d, rows) for _ in range(30)]
    probes = [i for i, (s, held) in enumerate(picks) if s.drafter == "suffix" and not held]
    assert probes and all(picks[i][0].k == d.strategy.ks[0] for i in probes)
    assert all(not picks[i + 1][1] for i in probes if i + 1 < len(picks))  # the next step chose again
    d.strategy._plain_buckets.clear()  # a new bucket's plain probe
    assert choose(d, rows)[1] is False and choose(d, rows)[1] is False
