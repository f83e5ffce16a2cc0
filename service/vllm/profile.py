"""A start-up profile that sets vLLM's per-batch-size speculation table for this model, drafter and machine.

vLLM picks k from the live batch size through a table fixed when its engine is built. So `--spec adaptive` on the
vLLM backend first runs one short-lived engine whose table gives each (batch bucket, k) pair its own batch size,
and reads vLLM's own draft counters. From it: t(b, k), seconds per step, from one least-squares fit
t = a + c*b + k*(u + v*b) over all points; and r_j, the probability that draft position j is accepted. For every
batch size the table takes the k with the most tokens per second, E(k) / t(b, k). The table is the one control
vLLM supports, so specroll relies on no unstable internals. docs/design-notes.md has the details.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config import EngineConfig, default_cache_root
from service.drafter_spec import DrafterItem
from service.vllm.config import VllmConfig
from service.vllm.engine import build_engine
from service.vllm.online import CostModel, OnlineDepth, best_depths, rows_of, tokens_per_step
from service.vllm.stats import vllm_counters

logger = logging.getLogger(__name__)

PROFILE_TOKENS = 32  # greedy tokens per sequence and measurement


@dataclass(frozen=True, slots=True)
class Profile:
    """Measured step seconds per (batch size, k), and acceptance per draft position (at the deepest k)."""

    step_seconds: dict[tuple[int, int], float]
    acceptance: tuple[float, ...]

    def tokens_per_step(self, k: int) -> float:
        return tokens_per_step(self.acceptance, k)

    def cost_model(self) -> CostModel:
        """Least squares on relative error (each point weighted by 1 / its time), minimum-norm where the points
        cannot tell the terms apart (one batch size only). Costs that fall with the batch size are noise: a
        negative per-sequence term (c or v) is dropped and the rest refitted, so a draft never gets cheaper as
        the batch grows (a tilted fit made drafts look free at full batch and the table deeper there)."""
        import torch

        points = sorted(self.step_seconds.items())
        x = torch.tensor([[1.0, b, k, k * b] for (b, k), _ in points], dtype=torch.float64)  # [N, 4]
        t = torch.tensor([sec for _, sec in points], dtype=torch.float64)  # [N]
        w = 1.0 / t
        keep = [0, 1, 2, 3]
        while True:
            sol = torch.linalg.lstsq(x[:, keep] * w[:, None], (t * w)[:, None], driver="gelsd").solution[:, 0]
            coef = dict(zip(keep, sol.tolist(), strict=True))
            negative = [i for i in (1, 3) if coef.get(i, 0.0) < 0]
            if not negative:
                break
            keep = [i for i in keep if i not in negative]
        return CostModel(coef.get(0, 0.0), coef.get(1, 0.0), coef.get(2, 0.0), coef.get(3, 0.0), float(t.min()))

    def to_json(self) -> dict[str, Any]:
        return {"step_seconds": [[b, k, t] for (b, k), t in sorted(self.step_seconds.items())],
                "acceptance": list(self.acceptance)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        return cls({(int(b), int(k)): float(t) for b, k, t in data["step_seconds"]},
                   tuple(float(a) for a in data["acceptance"]))


def candidate_ks(max_k: int) -> list[int]:
    return sorted(k for k in {0, 1, 2, max_k // 2, max_k} if k <= max_k)


def bucket_sizes(max_num_seqs: int, width: int) -> list[int]:
    """First batch size of each bucket: 1, then powers of two from 8, the last one ending at max_num_seqs."""
    starts = [1] + [b for b in (2**i for i in range(3, 16)) if b + width - 1 <= max_num_seqs]
    if max_num_seqs - width + 1 > starts[-1] + width - 1:
        starts.append(max_num_seqs - width + 1)
    return starts


def striped_table(starts: list[int], ks: list[int], max_num_seqs: int) -> tuple[list[tuple[int, int, int]],
                                                                                   list[tuple[int, int]]]:
    """A table giving each (bucket, k) its own batch size, and those (batch size, k) points. Sizes between
    stripes carry k = 0."""
    rows: list[tuple[int, int, int]] = []
    points: list[tuple[int, int]] = []
    nxt = 1
    for start in starts:
        if start > nxt:
            rows.append((nxt, start - 1, 0))
        for i, k in enumerate(ks):
            rows.append((start + i, start + i, k))
            points.append((start + i, k))
        nxt = start + len(ks)
    if nxt <= max_num_seqs:
        rows.append((nxt, max_num_seqs, 0))
    rows = [(lo, min(hi, max_num_seqs), k) for lo, hi, k in rows if lo <= max_num_seqs]
    return rows, [(b, k) for b, k in points if b <= max_num_seqs]


def table_from(profile: Profile, ks: list[int], max_num_seqs: int) -> list[tuple[int, int, int]]:
    """vLLM's table: for every batch size the k of most tokens per second, consecutive equal k's merged."""
    return rows_of(best_depths(profile.cost_model(), profile.acceptance, ks, max_num_seqs))


def online_depth(profile: Profile, ks: list[int], max_num_seqs: int) -> OnlineDepth:
    """What the serving engine's scheduler starts from: the profile's costs, its acceptance as the prior."""
    return OnlineDepth(profile.cost_model(), ks, max_num_seqs, profile.acceptance)


def cache_path(config: EngineConfig, vcfg: VllmConfig, drafter: DrafterItem, vllm_version: str) -> Path:
    key = {"model": _fingerprint(Path(str(config.model))), "drafter": [drafter.method, drafter.path and
           _fingerprint(Path(drafter.path))], "k": vcfg.num_speculative_tokens, "max_num_seqs": config.max_num_seqs,
           "dtype": str(config.dtype), "device": str(config.device), "vllm": vllm_version,
           "tp": vcfg.tensor_parallel_size, "pp": vcfg.pipeline_parallel_size, "cpus": os.cpu_count()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_root() / "vllm-profiles" / f"{digest}.json"


def _fingerprint(folder: Path) -> str:
    """The folder and its files' sizes and times: a checkpoint rewritten in place gets a new profile."""
    files = sorted(p for p in folder.glob("*") if p.is_file())
    return f"{folder.resolve()}:" + ",".join(f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}" for p in files)


async def measure(engine: Any, vllm: Any, points: list[tuple[int, int]], vocab_size: int, max_k: int) -> Profile:
    """Run a greedy batch of each size through an engine built with the striped table."""
    params = vllm.SamplingParams(max_tokens=PROFILE_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)

    async def batch(size: int, tag: str) -> float:
        """Seconds from the moment every sequence has its first token (the batch's prefill is done) to the end."""
        firsts: dict[int, float] = {}

        async def one(i: int) -> None:
            prompt = [(7 * i + 3 * j + 1) % vocab_size for j in range(6)]
            rid = f"specroll-profile-{tag}-{i}"
            async for _ in engine.generate({"prompt_token_ids": prompt}, params, request_id=rid):
                firsts.setdefault(i, time.perf_counter())

        await asyncio.gather(*(one(i) for i in range(size)))
        return time.perf_counter() - max(firsts.values())

    await batch(points[0][0], "warm-up")
    step_seconds: dict[tuple[int, int], float] = {}
    accepted = [0.0] * max_k
    drafts = 0
    for size, k in points:
        before = vllm_counters()
        elapsed = await batch(size, f"{size}")
        after = vllm_counters()
        n_drafts = after.get("spec_drafts", 0) - before.get("spec_drafts", 0)
        steps = n_drafts / size if k else PROFILE_TOKENS - 1  # decode or verify steps after the prefill
        step_seconds[(size, k)] = elapsed / steps
        if k == max_k:
            per_pos_0, per_pos_1 = before.get("accepted_per_position", ()), after.get("accepted_per_position", ())
            for j in range(min(max_k, len(per_pos_1))):
                accepted[j] += per_pos_1[j] - (per_pos_0[j] if j < len(per_pos_0) else 0)
            drafts += n_drafts
    acceptance = tuple(a / drafts for a in accepted) if drafts else (0.0,) * max_k
    return Profile(step_seconds, acceptance)


def load_cached(path: Path) -> Profile | None:
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(path: Path, profile: Profile) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile.to_json()))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not cache the speculation profile at %s: %s", path, exc)


async def profiled_table(config: EngineConfig, vcfg: VllmConfig, drafter: DrafterItem,
                         vocab_size: int) -> tuple[list[tuple[int, int, int]], OnlineDepth]:
    """The serving engine's first table and its online depth, from the cached profile, else from one measured
    now."""
    import vllm

    path = cache_path(config, vcfg, drafter, vllm.__version__)
    ks = candidate_ks(vcfg.num_speculative_tokens)
    profile = load_cached(path)
    if profile is None:
        rows, points = striped_table(bucket_sizes(config.max_num_seqs, len(ks)), ks, config.max_num_seqs)
        logger.info("profiling speculation depth for %d (batch size, k) points before serving", len(points))
        t0 = time.perf_counter()
        _, engine = build_engine(config, vcfg, drafter, rows)
        try:
            profile = await measure(engine, vllm, points, vocab_size, vcfg.num_speculative_tokens)
        finally:
            engine.shutdown()
        logger.info("speculation profile took %.1f s; acceptance per position %s", time.perf_counter() - t0,
                    [round(a, 3) for a in profile.acceptance])
        save(path, profile)
    else:
        logger.info("speculation profile from %s", path)
    return table_from(profile, ks, config.max_num_seqs), online_depth(profile, ks, config.max_num_seqs)
