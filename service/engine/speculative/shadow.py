"""Acceptance of a lookahead drafter's drafts on the steps that did not verify them. Torch-free.

A lookahead drafter (a suffix table, drafting on the host) says what it would draft for every row before each step,
whichever arm runs. After the step, draft j counts as accepted when drafts 1..j-1 matched the row's first j - 1 new
tokens and draft j matches its j-th. Every emitted token is a sample of the target's distribution (decoding is
lossless), so that is the acceptance the drafter would have had, in distribution. Positions past the tokens a row
emitted are not observed. So the table's posterior never goes stale while another arm runs. docs/design-notes.md
has more.
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
