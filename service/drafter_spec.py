"""The `--drafter` setting as a typed value, parsed once: both backends and the drafter trainer read this.

A setting is "none" or comma-separated items: "auto", "suffix", "ngram", "mtp", "eagle[:DIR]", "eagle3[:DIR]"
or a draft-model folder. Parsing reads the syntax only. Each backend resolves what the items mean for it: what
"auto" stands for, where a relative folder lies, which drafters it can run (the native engine runs several and
picks one per step; vLLM runs one).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

NAMED = ("auto", "suffix", "ngram", "mtp")  # items that are a name, not a folder
HEADS = ("eagle", "eagle3")  # a head on the target: "eagle" alone or "eagle:DIR"
MODEL_FREE = ("suffix", "ngram")  # drafters without weights


@dataclass(frozen=True, slots=True)
class DrafterItem:
    """One drafter: a method and, for a head or a draft model, its folder."""

    method: str  # "none" | auto | suffix | ngram | mtp | eagle | eagle3 | draft_model
    path: str | None = None

    @property
    def has_weights(self) -> bool:
        return self.method not in ("none", "auto", *MODEL_FREE)

    def as_flag(self) -> str:
        """The `--drafter` item that names this drafter."""
        if self.path is None:
            return self.method
        return self.path if self.method == "draft_model" else f"{self.method}:{self.path}"


NO_DRAFTER = DrafterItem("none")


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    """The drafters of a `--drafter` setting, in order, each once; empty for "none"."""

    items: tuple[DrafterItem, ...] = ()

    @classmethod
    def parse(cls, flag: str | None) -> DrafterSpec:
        return cls.of(_item(x) for x in (flag or "none").split(",") if x.strip() and x.strip() != "none")

    @classmethod
    def of(cls, items: Iterable[DrafterItem]) -> DrafterSpec:
        return cls(tuple(dict.fromkeys(i for i in items if i.method != "none")))

    def expand_auto(self, *replacement: DrafterItem) -> DrafterSpec:
        """This setting with "auto" replaced by `replacement` (what a backend's auto stands for)."""
        return DrafterSpec.of(r for i in self.items for r in (replacement if i.method == "auto" else (i,)))

    def __str__(self) -> str:
        return ",".join(i.as_flag() for i in self.items) or "none"


def _item(text: str) -> DrafterItem:
    text = text.strip()
    if text in NAMED or text in HEADS:
        return DrafterItem(text)
    method, sep, path = text.partition(":")
    if sep and method in HEADS:
        return DrafterItem(method, path or None)
    return DrafterItem("draft_model", text)
