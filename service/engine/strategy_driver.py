"""The engine's side of the adaptive strategy, around each decode step.

Before the step (`choose`): what each lookahead drafter (one that drafts on the host, a suffix table:
`Drafter.lookahead`) has for each row, each row's room and how many tokens each drafter would catch up on, so the
strategy values every arm on what it would verify. After it (`feedback`): what the step cost and accepted, and each
lookahead drafter's unverified drafts set against the tokens the rows emitted (speculative/shadow.py); written to
the strategy trace where one is open.

Holding a choice: where the choice costs more than `CHOICE_SHARE` of the step it decides, it decides the next steps
too (at most `MAX_HOLD`), while the batch keeps its rows and each lookahead drafter still has proposals for as many
of them. docs/design-notes.md gives the reasons.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from service.config import ConfigError
from service.engine.cached_model import CachedModel
from service.engine.drafters.base import Drafter
from service.engine.speculative.shadow import shadow_trials
from service.engine.strategy import PLAIN, AdaptiveStrategy, Arm, bucket_of
from service.engine.trace import StepTrace
from service.engine.types import Sequence, StepResult

Shadow = dict[str, list[tuple[int, int]]]  # lookahead drafter -> (num_accepted, num_drafted) per row not verified
CHOICE_SHARE = 0.05  # a choice decides as many steps as keep its host seconds under this share of theirs
MAX_HOLD = 4  # steps one choice decides, at most


@dataclass(slots=True)
class _Held:
    arm: Arm
    key: tuple[tuple[int, ...], tuple[int, ...]]  # the batch's rows (ids), per lookahead drafter its rows with drafts
    left: int  # steps it still decides


def open_trace(path: str | None) -> StepTrace | None:
    if not path:
        return None
    try:
        return StepTrace(path)
    except OSError as exc:
        raise ConfigError(f"cannot open the strategy trace {path!r}: {exc}") from exc


class StrategyDriver:
    def __init__(self, strategy: AdaptiveStrategy, drafters: dict[str, Drafter],
                 trace: StepTrace | None = None) -> None:
        self.strategy = strategy
        self.drafters = drafters
        self.trace = trace
        self._drafts: dict[str, list[list[int]]] = {}  # what each lookahead drafter had for the step's rows
        self._choose_s = 0.0  # the last choice's host seconds (the trace's host_ms)
        self._step_s: dict[int, float] = {}  # per batch bucket, the last decode step's seconds there
        self._held: _Held | None = None  # a choice that decides the next steps too (see the module docstring)
        self._last: Arm | None = None  # the last choice made
        self.held = False  # the last choice was a held one
        self.held_steps = 0  # held choices so far
        self._traced_rows: set[int] = set()  # the sequences of the last traced step (its `joined` count)

    @classmethod
    def configured(cls, spec: str, spec_k: int, seed: int, drafters: dict[str, Drafter],
                   target: CachedModel) -> StrategyDriver:
        """The engine's strategy for `--spec` off / fixed (the first drafter at `spec_k`) / adaptive."""
        fixed = None
        if spec == "off" or not drafters:
            fixed = PLAIN
        elif spec == "fixed":
            fixed = Arm(next(iter(drafters)), spec_k)
        strategy = AdaptiveStrategy(list(drafters), fixed=fixed, seed=seed, rounds_to_ks=target.graphs is not None,
                                    pack_min_saved=target.pack_min_saved,
                                    own_costs={name: d.own_cost for name, d in drafters.items()})
        return cls(strategy, drafters)

    def may_run(self) -> list[Drafter]:
        """The drafters a step may run (those that prefill with the target)."""
        fixed = self.strategy.fixed
        names = set(self.drafters) if fixed is None else {fixed.drafter} if fixed.k else set()
        return [d for name, d in self.drafters.items() if name in names]

    def choose(self, seqs: list[Sequence], room: list[int] | None) -> Arm:
        """The strategy's pick, told beforehand what drafters that propose on the host have for each row, each
        row's room and how many tokens each drafter would catch up on."""
        t0 = time.perf_counter()
        try:
            return self._choose(seqs, room)
        finally:
            self._choose_s = time.perf_counter() - t0

    def _choose(self, seqs: list[Sequence], room: list[int] | None) -> Arm:
        self._drafts, self.held = {}, False
        if self.strategy.fixed is not None or not self.strategy.drafters or self.strategy.probes_plain(len(seqs)):
            self._held = None
            return self.strategy.choose(len(seqs))  # no proposals needed: nothing to ask the drafters
        t0 = time.perf_counter()
        depth = max(self.strategy.depths())
        self._drafts = {name: n for name, d in self.drafters.items() if (n := d.lookahead(seqs, depth)) is not None}
        proposals = {name: [len(row) for row in drafts] for name, drafts in self._drafts.items()}
        key = (tuple(seq.seq_id for seq in seqs), tuple(sum(1 for n in p if n) for p in proposals.values()))
        held = self._held
        if held is not None and held.left and held.key == key:
            held.left -= 1
            self.held = True
            self.held_steps += 1
            return held.arm
        catch_up = {name: n for name, d in self.drafters.items() if (n := d.catch_up(seqs))}
        arm = self.strategy.choose(len(seqs), proposals, room, catch_up)
        decide_s = time.perf_counter() - t0  # lookahead included
        self._held = None
        step_s = self._step_s.get(bucket_of(len(seqs)))  # not the last step's: the tail's are 10x shorter
        repeated, self._last = arm == self._last, arm  # a switch is often a draw exploring: not held
        probe = arm.k > 0 and self.strategy.barely_known(arm.drafter)  # a plain probe returned above
        if repeated and step_s and not probe:
            steps = min(MAX_HOLD, math.ceil(decide_s / (CHOICE_SHARE * step_s)))
            self._held = _Held(arm, key, steps - 1) if steps > 1 else None
        return arm

    def renew(self, drafter: str) -> None:
        """`drafter` serves new weights: the strategy measures it afresh, from the next step on."""
        self._held = None
        self.strategy.renew(drafter)

    def feedback(self, arm: Arm, result: StepResult, seconds: float, cost: float | None,
                 postprocess_s: float = 0.0) -> None:
        """A decode step's measurement for the strategy: `arm`, the arm that ran (plain where the drafter
        proposed nothing), `cost`, its seconds with the work between two steps (None: no measure of its cost,
        e.g. it captured a CUDA graph), `postprocess_s`, the host seconds of appending its tokens (for the trace)."""
        t0 = time.perf_counter()
        self._step_s[bucket_of(len(result.seqs))] = seconds
        shadow = self._shadow(arm, result)
        # What the strategy believed when it chose (per drafter, the posterior mean per draft position)
        believed = ({d: self.strategy.acceptance(d, len(result.seqs)) for d in self.strategy.drafters}
                    if self.trace is not None else {})
        self.strategy.record(arm, len(result.seqs), cost, result.num_accepted or None, result.k,
                             result.num_drafted or None, result.assisted or None, result.caught_up, shadow)
        if self.trace is not None:
            overhead = {"choose": self._choose_s, "postprocess": postprocess_s, "feedback": time.perf_counter() - t0}
            self._trace_step(arm, result, seconds, cost, shadow, believed, overhead)

    def _shadow(self, arm: Arm, result: StepResult) -> Shadow:
        """Per lookahead drafter, its drafts this step did not verify set against the tokens the rows emitted."""
        if not self._drafts:
            return {}
        emitted = [seq.tokens_from(prev) for seq, prev in zip(result.seqs, result.prev_num_tokens, strict=True)]
        out = {}
        for name, drafts in self._drafts.items():
            if len(drafts) != len(emitted) or name == arm.drafter:
                continue  # its drafts ran (or the batch changed since the choice)
            assisted_by = arm.assist is not None and arm.assist[0] == name  # its drafts ran on some rows
            verified = result.assisted if assisted_by and result.assisted else [False] * len(emitted)
            out[name] = shadow_trials(drafts, emitted, verified)
        return out

    def _trace_step(self, arm: Arm, result: StepResult, seconds: float, cost: float | None,
                    shadow: Shadow, believed: dict[str, list[float]], overhead: dict[str, float]) -> None:
        """One line of the strategy trace: the step as the strategy is told of it, the acceptance it believed
        when it chose, and the host seconds of the strategy's and the engine's work around the forwards (`host_ms`:
        the choice with the lookahead drafters' lookahead, appending the tokens, this feedback). `joined`: the rows that
        did not decode in the step before (bench/trace_summary.py finds where a trainer's rollouts begin by them)."""
        rows = {seq.seq_id for seq in result.seqs}
        joined, self._traced_rows = len(rows - self._traced_rows), rows
        self.trace.write({
            "batch": len(result.seqs), "joined": joined, "arm": arm.name, "held": self.held, "ran_k": result.k,
            "seconds": round(seconds, 6),
            "cost_seconds": None if cost is None else round(cost, 6),
            "emitted": result.num_emitted(),
            "accepted": sum(result.num_accepted), "drafted": sum(result.num_drafted),
            "assisted": sum(result.assisted), "caught_up": [result.caught_up[0], round(result.caught_up[1], 6)],
            "proposed": {name: sum(1 for row in drafts if row) for name, drafts in self._drafts.items()},
            "shadow": {name: [sum(m for m, _ in rows), sum(o for _, o in rows)] for name, rows in shadow.items()},
            "acceptance": {d: [round(a, 3) for a in rates] for d, rates in believed.items()},
            "host_ms": {phase: round(s * 1e3, 3) for phase, s in overhead.items()},
        })
        if not self.trace.active:
            self.trace = None
