"""Drafters: where speculative tokens come from. `build_drafters` turns the --drafter setting into them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from service.config import ConfigError, ModelConfig
from service.engine.drafters.base import Drafter

if TYPE_CHECKING:
    from service.engine.llm_engine import LLMEngine


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


def build_drafters(spec: str, engine: LLMEngine) -> dict[str, Drafter]:
    """"none" | comma-separated items: "auto", "suffix", "eagle[:DIR]" or a draft-model folder. Drafters by name."""
    from service.engine.drafters.draft_model import DraftModelDrafter
    from service.engine.drafters.suffix import SuffixDrafter
    from service.models.loader import load_model

    drafters: dict[str, Drafter] = {}
    for item in expand_auto(spec, engine.model_path).split(","):
        if item == "none":
            continue
        if item == "suffix":
            drafters["suffix"] = SuffixDrafter(engine.device)
            continue
        if item == "eagle" or item.startswith("eagle:"):
            from service.engine.drafters.eagle import build_eagle

            drafters["eagle"] = build_eagle(item, engine.runner.target, engine.scheduler.num_slots, engine.device,
                                            engine.config.seed)
            continue
        path = Path(item)
        if not (path / "config.json").is_file():
            raise ConfigError(f"drafter {item!r} is neither 'none', 'suffix' nor a model folder with config.json")
        draft_cfg = ModelConfig.from_dir(path)
        if abs(draft_cfg.vocab_size - engine.model_config.vocab_size) > 1024:
            raise ConfigError(
                f"draft model vocab {draft_cfg.vocab_size} does not match the target's "
                f"{engine.model_config.vocab_size}: a draft model must share the target's tokenizer"
            )
        model = load_model(path, engine.dtype, engine.device)
        drafters["draft"] = DraftModelDrafter(
            model, engine.model_config.vocab_size, engine.scheduler.num_slots, engine.cache.max_positions,
            engine.device,
        )
    return drafters
