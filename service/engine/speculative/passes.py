"""The shape of a verify pass, one rule each for the runner that runs it and the strategy that values it (so
the step valued is the step run): the depth a pass runs at when no row has k drafts (`cut_depth`), whether it
runs packed (`packs`), and the draft positions it computes (`verify_tokens`). Torch-free.
"""

from __future__ import annotations

PACK_AT = 0.75  # a verify pass runs packed where at most this fraction of its [B, k + 1] grid is real tokens


def packs(drafted: int, batch: int, k: int, min_saved: int | None) -> bool:
    """Whether a verify pass k drafts wide over `batch` rows with `drafted` drafts in all runs packed (each row
    computes its last token and its own drafts only): where at most `PACK_AT` of the grid is real and at least
    `min_saved` positions are saved (packed forwards run eagerly: on a small model the saving must outweigh
    what compiled code saves), never where `min_saved` is None (the target replays CUDA graphs). The runner
    packs with it and the strategy values arms with it."""
    if min_saved is None:
        return False
    return drafted + batch <= PACK_AT * batch * (k + 1) and batch * k - drafted >= min_saved


def verify_tokens(drafted: int, batch: int, k: int, min_saved: int | None) -> int:
    """The draft positions a verify pass computes: `drafted` where it runs packed, batch * k where not."""
    return drafted if packs(drafted, batch, k, min_saved) else batch * k


def cut_depth(longest: int, k: int, depths: tuple[int, ...] | list[int] | None) -> int:
    """The depth a verify pass of k drafts runs at when no row has more than `longest` (<= k): `longest`, or
    with captured `depths` (CUDA graphs) the smallest of them that holds it, k if none does. The runner cuts
    with it and the strategy values arms with it, so the step valued is the step run."""
    if depths is None:
        return longest
    return min((d for d in depths if longest <= d <= k), default=k)
