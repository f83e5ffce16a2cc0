"""Acceptance of a host drafter's drafts on the steps that did not verify them. Torch-free.

A drafter that proposes on the host (a suffix table) says what it would draft for every row before each step
(`Drafter.lookahead`), whichever arm runs. After the step, each row's drafts can be set against the tokens the
row emitted: the draft at position j counts as accepted when drafts 1..j-1 matched the row's first j - 1 new
tokens and draft j matches its j-th. That is the acceptance the drafter would have had, in distribution:
- every token a step emits is a sample of the target's distribution p given the row's tokens before it (plain
  decoding, or speculative decoding, which is lossless), so the j-th new token equals draft d with probability
  p(d);
- a drafter that proposes one token (no distribution: `DraftProposal.probs` None) has it accepted with
  probability min(1, p(d) / 1) = p(d), and only once drafts 1..j-1 were, i.e. matched the tokens that followed.
Positions past the tokens a row emitted (a plain step emits one) are not observed: no trial. Which positions are
observed depends on what ran (deep ones on rows whose draft-model drafts were accepted, which may be easier text):
a small bias, the price of a free measurement; steps that ran the drafter count as before.

Why: a suffix table's acceptance swings with what the rows are (repeats of earlier samples at a full batch,
new text in the long tail), and a posterior fed only by the steps that ran the table goes stale whenever
another arm runs. In a GRPO run (bench/e2e.py, suffix table and draft model), a few poor tail steps wrote the
table down to 0.18 and the draft model ran the next ~300 steps, at 8,000 tokens/s at full batch where the
table, re-tried after its counts had decayed, gave 21,000. Fed by every step, the posterior sees the rows come
back within a step, and costs nothing: the drafts were looked up for the choice anyway.
"""

from __future__ import annotations


def shadow_trials(drafts: list[list[int]], emitted: list[list[int]], verified: list[bool]) -> list[tuple[int, int]]:
    """Per row that had drafts and did not verify them (`verified` False): (drafts that match the row's new
    tokens in order, drafts observed: min(drafts, new tokens)), the (num_accepted, num_drafted) of a step that
    had verified them."""
    rows = []
    for row_drafts, new, done in zip(drafts, emitted, verified, strict=True):
        if done or not row_drafts or not new:
            continue
        observed = min(len(row_drafts), len(new))
        matched = 0
        while matched < observed and row_drafts[matched] == new[matched]:
            matched += 1
        rows.append((matched, observed))
    return rows
