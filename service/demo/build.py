"""Build the demo models: tokenizer, target, draft model and EAGLE head, as Hugging Face folders.

Layout of a built folder (the target is the folder itself):

    config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json  demo.json
    draft/       a 2-layer Qwen2 draft model with the same tokenizer  (--drafter DIR/draft)
    eagle/       model.safetensors of an EAGLE-style head               (--drafter eagle:DIR/eagle)

Sizes: ``full`` (what ``specroll serve`` serves by default; a few minutes on a 2-core CPU) and ``tiny``
(seconds, for tests), chosen with ``$SPECROLL_DEMO_SIZE``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from service.config import ModelConfig
from service.demo.export import qwen2_config, save_head, write_json, write_model_folder
from service.demo.pretrain import TrainLog, TrainPlan, deterministic, grow, new_model, train_eagle, train_lm
from service.demo.task import Difficulty, problems, reward
from service.demo.vocab import make_tokenizer

logger = logging.getLogger(__name__)

SIZE_ENV = "SPECROLL_DEMO_SIZE"
VOCAB_SIZE = 512  # at most: 256 bytes, 3 special tokens, 234 labelled digits (a1..z9), a few words
CORPUS_SEED = 1234
TOKENIZER_CORPUS = 6000
MAX_POSITIONS = 2048
TRAIN_POSITIONS = 1024
DRAFT_DIR, EAGLE_DIR = "draft", "eagle"


@dataclass(frozen=True, slots=True)
class DemoSize:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    draft_layers: int
    plan: TrainPlan
    eval_per_size: int  # greedy evaluation problems per number of terms (0: none)

    def arch(self, layers: int) -> dict[str, Any]:
        return {"hidden_size": self.hidden, "intermediate_size": self.intermediate, "num_hidden_layers": layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "head_dim": self.hidden // self.heads}


TASK = Difficulty(max_terms=16, power=0.0)
SIZES: dict[str, DemoSize] = {
    "full": DemoSize("full", 128, 4, 4, 4, 352, 2,
                     TrainPlan(draft_steps=1200, steps=800, token_budget=2048, lr=1e-3, draft_lr=2e-3,
                               eagle_steps=300, eagle_lr=2e-3, init_std=0.05, difficulty=TASK), eval_per_size=16),
    "tiny": DemoSize("tiny", 32, 2, 2, 1, 64, 1,
                     TrainPlan(draft_steps=8, steps=6, token_budget=256, lr=3e-3, draft_lr=3e-3, eagle_steps=4,
                               eagle_lr=2e-3, difficulty=Difficulty(max_terms=6)), eval_per_size=0),
}


def demo_size(name: str | None = None) -> DemoSize:
    """The size named (default ``$SPECROLL_DEMO_SIZE``, else ``full``)."""
    name = name or os.environ.get(SIZE_ENV) or "full"
    if name not in SIZES:
        raise ValueError(f"{SIZE_ENV} must be one of {sorted(SIZES)}, got {name!r}")
    return SIZES[name]


def tokenizer_corpus() -> list[str]:
    return [p.text for p in problems(TOKENIZER_CORPUS, CORPUS_SEED, Difficulty(max_terms=26))]


@torch.no_grad()
def greedy_accuracy(model_dir: Path, per_size: int, seed: int = 99) -> dict[str, float]:
    """Greedy accuracy by number of terms, served by our own engine from the written folder."""
    from service.config import EngineConfig
    from service.engine.llm_engine import LLMEngine
    from service.params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=1024, max_num_seqs=64))
    assert engine.tokenizer is not None
    out: dict[str, float] = {}
    for n in (2, 3, 4, 6, 8, 12):
        probs = problems(per_size, seed + n, Difficulty(min_terms=n, max_terms=n))
        params = SamplingParams(temperature=0.0, max_tokens=min(900, 40 + 12 * n + 2 * n * n))
        results = engine.generate([engine.tokenizer.encode(p.prompt) for p in probs], params)
        texts = [engine.tokenizer.decode(r.outputs[0].token_ids) for r in results]
        out[str(n)] = sum(reward(p, t) for p, t in zip(probs, texts, strict=True)) / len(probs)
    return out


def build_demo(out_dir: Path, size: DemoSize | None = None) -> dict[str, Any]:
    """Write the target, draft and EAGLE folders for `size` into `out_dir`; returns the build summary."""
    size = size or demo_size()
    plan = size.plan
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    log = TrainLog()
    total = plan.draft_steps + plan.steps + plan.eagle_steps + 2
    with tqdm(total=total, desc=f"building demo model ({size.name})", unit="step") as bar:

        def progress(n: int, stats: dict[str, float]) -> None:
            bar.update(n)
            bar.set_postfix({k: f"{v:.3f}" for k, v in stats.items()}, refresh=False)

        bar.set_postfix_str("tokenizer")
        tok = make_tokenizer(tokenizer_corpus(), VOCAB_SIZE, out_dir)
        eos, bos = tok.eos_token_id, tok.bos_token_id
        assert eos is not None
        config = qwen2_config(size.arch(size.layers), tok.vocab_size, eos, bos, MAX_POSITIONS)
        draft_config = qwen2_config(size.arch(size.draft_layers), tok.vocab_size, eos, bos, MAX_POSITIONS)
        bar.update(1)
        with deterministic(plan.seed):
            gen = torch.Generator().manual_seed(plan.seed)
            draft = new_model(ModelConfig.from_dict(draft_config), gen, plan.init_std)
            log.tokens += train_lm(draft, tok, plan.draft_steps, plan.draft_lr, plan, plan.seed, TRAIN_POSITIONS,
                                   log.draft_loss, progress, "draft")
            draft.eval().requires_grad_(False)
            target = grow(draft, ModelConfig.from_dict(config), gen, plan.init_std)
            log.tokens += train_lm(target, tok, plan.steps, plan.lr, plan, plan.seed + 3, TRAIN_POSITIONS, log.loss,
                                   progress, "loss")
            target.eval().requires_grad_(False)
            head = train_eagle(target, tok, plan, TRAIN_POSITIONS, log, progress)
        bar.set_postfix_str("writing")
        write_model_folder(out_dir, target, config, None)
        write_model_folder(out_dir / DRAFT_DIR, draft.eval(), draft_config, out_dir)
        save_head(out_dir / EAGLE_DIR, head)
        bar.update(1)
    summary: dict[str, Any] = {
        "size": size.name, "task": asdict(plan.difficulty), "draft_steps": plan.draft_steps, "steps": plan.steps,
        "eagle_steps": plan.eagle_steps,
        "train_tokens": log.tokens, "final_loss": _tail_mean(log.loss), "final_draft_loss": _tail_mean(log.draft_loss),
        "final_eagle_loss": _tail_mean(log.eagle_loss),
        "params": sum(p.numel() for p in target.parameters()),
    }
    if size.eval_per_size:
        summary["greedy_accuracy"] = greedy_accuracy(out_dir, size.eval_per_size)
    write_json(out_dir / "demo.json", summary)
    logger.info("demo model (%s) built in %.0f s: %s", size.name, time.perf_counter() - start, summary)
    return summary


def _tail_mean(values: list[float], n: int = 50) -> float | None:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 4) if tail else None
