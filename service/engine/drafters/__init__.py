"""Drafters: where speculative tokens come from. `build_drafters` turns the --drafter setting into them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from service.config import ConfigError, ModelConfig
from service.drafter_spec import DrafterItem, DrafterSpec
from service.engine.drafters.base import Drafter

if TYPE_CHECKING:
    from service.engine.cached_model import CachedModel


def expand_auto(spec: DrafterSpec, model_dir: Path) -> DrafterSpec:
    """The native engine's "auto": the suffix drafter, plus the model folder's own ``draft/`` model when it ships
    one (the embedded demo model does)."""
    draft = model_dir / "draft"
    shipped = [DrafterItem("draft_model", str(draft))] if (draft / "config.json").is_file() else []
    return spec.expand_auto(DrafterItem("suffix"), *shipped)


def build_drafters(spec: DrafterSpec, target: CachedModel, num_slots: int, seed: int) -> dict[str, Drafter]:
    """The drafters of a resolved setting (no "auto": `expand_auto`), by name: "suffix", "eagle" (a fresh head
    or one from its folder) and "draft" (a draft-model folder). `target` is the served model with its cache:
    drafters share its slots, positions, device and dtype."""
    from service.engine.drafters.draft_model import DraftModelDrafter
    from service.engine.drafters.suffix import SuffixDrafter
    from service.models.loader import load_model

    drafters: dict[str, Drafter] = {}
    vocab = target.cfg.vocab_size
    for item in spec.items:
        if item.method == "suffix":
            drafters["suffix"] = SuffixDrafter(target.device)
            continue
        if item.method == "eagle":
            from service.engine.drafters.eagle import build_eagle

            drafters["eagle"] = build_eagle(item.path, target, num_slots, target.device, seed)
            continue
        path = Path(item.path or item.method)
        if item.method != "draft_model" or not (path / "config.json").is_file():
            raise ConfigError(f"drafter {item.as_flag()!r} is neither 'none', 'suffix' nor a model folder with "
                              "config.json")
        draft_cfg = ModelConfig.from_dir(path)
        if abs(draft_cfg.vocab_size - vocab) > 1024:
            raise ConfigError(f"draft model vocab {draft_cfg.vocab_size} does not match the target's {vocab}: a "
                              "draft model must share the target's tokenizer")
        model = load_model(path, target.dtype, target.device)
        drafters["draft"] = DraftModelDrafter(model, target.cfg, num_slots, target.cache.max_positions, target.device,
                                              compiled=target.graphs is not None or target.compiled is not None)
    return drafters
