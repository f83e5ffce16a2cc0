"""Expected tokens a speculative step emits per row, from per-position acceptance rates. Torch-free.

A row with k drafts emits 1 + sum_{j<=k} alpha_1 * ... * alpha_j tokens on average, where alpha_j is the rate
at which draft j is accepted once drafts 1..j-1 were. A lookahead drafter (a suffix table, drafting on the host)
knows before the step how many drafts it has for each row; `rows` counts the rows per proposal length.
"""

from __future__ import annotations

from collections import Counter


def by_drafts(alpha: float | list[float], k: int) -> list[float]:
    """Expected tokens a row emits with 0, 1, ..., k drafts, from one rate for every position (geometric) or one
    per position (past the positions given, the deepest one's rate)."""
    out = [1.0]
    reach = 1.0
    for j in range(k):
        reach *= min(max(alpha if isinstance(alpha, float) else alpha[min(j, len(alpha) - 1)], 0.0), 1.0)
        out.append(out[-1] + reach)
    return out


def mean_from(table: list[float], k: int, rows: Counter[int] | None) -> float:
    """Expected tokens per row with k drafts, from the drafter's `by_drafts` table (k or longer); `rows`: how many
    rows have each proposal length (a row gets at most its proposal's drafts), or None when every row gets k."""
    if not k:
        return 1.0
    if rows is None:
        return table[k]
    return sum(c * table[min(k, n)] for n, c in rows.items()) / sum(rows.values())


def assisted_from(own: list[float], k: int, assistant: list[float],
                  assistant_rows: Counter[tuple[int, int]]) -> tuple[float, int | None]:
    """A drafter that drafts k for every row, assisted by a lookahead drafter: a row takes the assistant's drafts
    where they are worth more than the drafter's k, which holds for proposals of at least `n` drafts (expected
    tokens grow with the proposal's length). `own`, `assistant`: the two drafters' `by_drafts` tables (k or
    longer); `assistant_rows` counts the rows per (assistant proposal length, room), the room being the most drafts
    a row can still emit. Returns the expected tokens per row and that `n` (None: no row gains)."""
    n = next((n for n in range(1, k + 1) if assistant[n] > own[k]), None)
    if n is None:
        return own[k], None
    total = sum(c * (assistant[min(k, m, r)] if m >= n else own[min(k, r)]) for (m, r), c in assistant_rows.items())
    return total / sum(assistant_rows.values()), n
