"""Drafters: where speculative tokens come from. `build_drafters` turns the --drafter setting into them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from service.config import ConfigError, ModelConfig
from service.engine.drafters.base import Drafter

if TYPE_CHECKING:
    from service.engine.cached_model import CachedModel


def expand_auto(spec: str, model_dir: Path) -> str:
    """Resolve "auto" in a --drafter setting: the suffix drafter, plus the model folder's own ``draft/`` model
    when it ships one (the embedded demo model does)."""
    items = []
    for item in [x.strip() for x in (spec or "none").split(",") if x.strip()]:
        if item == "auto":
            items.append("suffix")
            if (model_dir / "draft" / "config.json").is_file():
                items.append(str(model_dir / "draft"))
        else:
            items.append(item)
    return ",".join(dict.fromkeys(items)) or "none"


def build_drafters(spec: str, model_dir: Path, target: CachedModel, num_slots: int, seed: int) -> dict[str, Drafter]:
    """"none" | comma-separated items: "auto", "suffix", "eagle[:DIR]" or a draft-model folder. Drafters by name.
    `target` is the served model with its cache: drafters share its slots, positions, device and dtype."""
    from service.engine.drafters.draft_model import DraftModelDrafter
    from service.engine.drafters.suffix import SuffixDrafter
    from service.models.loader import load_model

    drafters: dict[str, Drafter] = {}
    vocab = target.cfg.vocab_size
    for item in expand_auto(spec, model_dir).split(","):
        if item == "none":
            continue
        if item == "suffix":
            drafters["suffix"] = SuffixDrafter(target.device)
            continue
        if item == "eagle" or item.startswith("eagle:"):
            from service.engine.drafters.eagle import build_eagle

            drafters["eagle"] = build_eagle(item, target, num_slots, target.device, seed)
            continue
        path = Path(item)
        if not (path / "config.json").is_file():
            raise ConfigError(f"drafter {item!r} is neither 'none', 'suffix' nor a model folder with config.json")
        draft_cfg = ModelConfig.from_dir(path)
        if abs(draft_cfg.vocab_size - vocab) > 1024:
            raise ConfigError(f"draft model vocab {draft_cfg.vocab_size} does not match the target's {vocab}: a "
                              "draft model must share the target's tokenizer")
        model = load_model(path, target.dtype, target.device)
        drafters["draft"] = DraftModelDrafter(model, target.cfg, num_slots, target.cache.max_positions, target.device,
                                              compiled=target.graphs is not None or target.compiled is not None)
    return drafters
