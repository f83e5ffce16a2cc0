"""GRPO against a specroll server, through the client only: generate -> reward -> update -> push, every step.

The trainer keeps its own copy of the policy (`Policy`), draws prompts of the demo task from a seeded
stream, asks the server for `group_size` samples per prompt, scores them with the task's verifier, takes one
clipped-surrogate step with group-normalised advantages, pushes the new weights (version ``step-N``) and
reports the rewards. Each step's record says how long rollout, update and push took and what the server
did (tokens per verify step, drafter versions).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from client import AsyncSpecrollClient, Sample
from client import weights as wt
from examples.grpo.policy import Policy, Rollout, group_advantages
from service.demo.task import Difficulty, Problem, problems, reward

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GRPOConfig:
    server: str = "127.0.0.1:50051"
    admin_token: str | None = None
    model: str | None = None  # the policy's starting folder (default: the server's model folder)
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    lr: float = 1e-4
    clip: float = 0.2
    temperature: float = 1.0
    max_tokens: int = 640
    min_terms: int = 3
    max_terms: int = 16
    power: float = 1.0
    seed: int = 0
    pool: int = 16  # > 0: cycle through a fixed set of this many prompts (epochs); 0: fresh prompts every step
    push_mode: str = "wait"
    push_delta: bool = False  # after the first push, send only what changed since the last (client.weights.delta)
    push_dtype: str = ""  # cast the weights to this dtype before pushing (the served one), e.g. bfloat16
    micro_tokens: int = 8192
    threads: int | None = None
    server_pid: int | None = None  # a local server's pid: its CPU seconds during each update are recorded

    @property
    def difficulty(self) -> Difficulty:
        return Difficulty(min_terms=self.min_terms, max_terms=self.max_terms, power=self.power)


@dataclass(slots=True)
class StepRecord:
    step: int
    policy_version: str  # the version that generated this step's rollouts
    reward: float
    rewards_by_terms: dict[int, float]
    rollout_s: float
    tail_s: float  # the long-tail phase: from the moment 75% of the samples had finished to the last one
    update_s: float
    push_s: float
    step_s: float
    samples: int
    output_tokens: int
    lengths: list[int]
    tokens_per_step: float  # output tokens per engine step, over the step's samples (1.0 without SD)
    drafter_versions: list[str]
    trained_samples: int
    logprob_max_abs_diff: float
    loss: float
    extra: dict[str, Any] = field(default_factory=dict)


class PromptStream:
    """The step's problems: fresh from a seeded stream, or cycling through a fixed pool."""

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.pool = problems(cfg.pool, cfg.seed, cfg.difficulty) if cfg.pool else None

    def at(self, step: int) -> list[Problem]:
        k = self.cfg.prompts_per_step
        if self.pool is not None:
            return [self.pool[(step * k + i) % len(self.pool)] for i in range(k)]
        return problems(k, self.cfg.seed * 1_000_003 + step, self.cfg.difficulty)


async def rollout(client: AsyncSpecrollClient, prompts: list[list[int]], cfg: GRPOConfig, step: int,
                  final_only: bool = True) -> tuple[list[list[Sample]], list[float]]:
    """`group_size` samples per prompt, concurrently; with each sample's finish time (seconds from start).
    `final_only`: the server sends each sample whole as it finishes (False: its tokens stream in as chunks)."""
    start = time.perf_counter()
    finished: list[float] = []

    async def one(i: int, prompt: list[int]) -> list[Sample]:
        samples: list[Sample] = []
        async for ev in client.stream(prompt, n=cfg.group_size, temperature=cfg.temperature,
                                      max_tokens=cfg.max_tokens, seed=_seed(cfg.seed, step, i),
                                      group_id=f"s{step}-p{i}", final_only=final_only):
            if isinstance(ev, Sample):
                samples.append(ev)
                finished.append(time.perf_counter() - start)
        return sorted(samples, key=lambda s: s.index)

    groups = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return list(groups), finished


def _seed(base: int, step: int, i: int) -> int:
    return (base * 7919 + step * 104_729 + i * 1_299_709) % (2**62)


def tail_seconds(finish_times: list[float], frac: float = 0.75) -> float:
    """Time from the moment `frac` of the samples had finished to the last one finishing."""
    if not finish_times:
        return 0.0
    times = sorted(finish_times)
    return times[-1] - times[max(0, int(len(times) * frac) - 1)]


def process_cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a local process so far (Linux /proc); 0.0 when unknown."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def accepted_length(samples: list[Sample]) -> float:
    """Output tokens per engine step over all samples (tokens_per_step is per sample)."""
    tokens = sum(s.num_output_tokens for s in samples)
    steps = sum(s.num_output_tokens / s.tokens_per_step for s in samples if s.tokens_per_step > 0)
    return tokens / steps if steps else 1.0


async def train(cfg: GRPOConfig, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
    """Run `cfg.steps` GRPO steps against the server; returns one record per step."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    records: list[StepRecord] = []
    async with AsyncSpecrollClient(cfg.server, admin_token=cfg.admin_token, max_message_bytes=64 * 2**20) as client:
        info = await client.wait_until_ready()
        model_dir = cfg.model or info.model_path
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"no policy folder: pass model= (the server's model folder {model_dir!r} is not local)")
        policy = Policy(model_dir, cfg.lr)
        tok = policy.tokenizer
        stream = PromptStream(cfg)
        version = info.policy_version
        pushed = wt.PushedState() if cfg.push_delta else None  # the first push goes in full, then deltas
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            probs = stream.at(step)
            prompt_ids = [tok.encode(p.prompt) for p in probs]
            groups, finish = await rollout(client, prompt_ids, cfg, step)
            t1 = time.perf_counter()
            rollouts, rewards_by_id, flat_rewards = [], {}, []
            by_terms: dict[int, list[float]] = {}
            for prob, ids, group in zip(probs, prompt_ids, groups, strict=True):
                rewards = [reward(prob, tok.decode(s.token_ids)) for s in group]
                for s, r, a in zip(group, rewards, group_advantages(rewards), strict=True):
                    rollouts.append(Rollout(ids, s.token_ids, s.logprobs, a))
                    rewards_by_id[s.rollout_id] = r
                flat_rewards += rewards
                by_terms.setdefault(len(prob.numbers), []).extend(rewards)
            cpu0, server0 = time.process_time(), process_cpu_seconds(cfg.server_pid)
            stats = await asyncio.to_thread(policy.update, rollouts, cfg.temperature, cfg.clip, cfg.micro_tokens)
            t2 = time.perf_counter()
            # Where the update's time goes: this process's CPU seconds (its work), the server's CPU seconds
            # meanwhile (work competing for the machine), and the tokens it trained on (rows with A != 0).
            update_extra = {
                "update_cpu_s": round(time.process_time() - cpu0, 4),
                "server_cpu_during_update_s": round(process_cpu_seconds(cfg.server_pid) - server0, 4),
                "trained_tokens": sum(len(r.output_ids) for r in rollouts if r.advantage != 0.0),
                "forward_tokens": stats.forward_tokens,
            }
            new_version = f"step-{step + 1}"
            weights = policy.hf_weights()
            if pushed is not None and pushed.version is not None:  # what this step changed, in the pushed dtype
                sent = wt.on_cpu(weights, cfg.push_dtype or None)
                update_extra["changed_elements"] = sum(int(wt.changed(pushed.tensors[n], t).numel())
                                                       for n, t in sent.items())
                update_extra["elements"] = sum(t.numel() for t in sent.values())
            pushed_now = await client.push_weights(weights, new_version, mode=cfg.push_mode,
                                                   dtype=cfg.push_dtype or None, delta_from=pushed)
            update_extra["push_bytes"] = pushed_now.bytes  # what travelled; a full push of the dtype sent:
            itemsize = getattr(torch, cfg.push_dtype).itemsize if cfg.push_dtype else 4
            update_extra["full_push_bytes"] = sum(t.numel() * itemsize for t in weights.values())
            await client.report_rewards(rewards_by_id)
            t3 = time.perf_counter()
            samples = [s for g in groups for s in g]
            rec = StepRecord(
                step=step, policy_version=version, reward=sum(flat_rewards) / len(flat_rewards),
                rewards_by_terms={n: sum(v) / len(v) for n, v in sorted(by_terms.items())},
                rollout_s=t1 - t0, tail_s=tail_seconds(finish), update_s=t2 - t1, push_s=t3 - t2, step_s=t3 - t0,
                samples=len(samples), output_tokens=sum(s.num_output_tokens for s in samples),
                lengths=[s.num_output_tokens for s in samples], tokens_per_step=accepted_length(samples),
                drafter_versions=sorted({sp.drafter_version for s in samples for sp in s.version_spans}),
                trained_samples=stats.trained_samples, logprob_max_abs_diff=stats.logprob_max_abs_diff,
                loss=stats.loss, extra=update_extra)
            version = new_version
            records.append(rec)
            logger.info("step %d: reward %.3f  rollout %.2fs (tail %.2fs)  update %.2fs  push %.2fs  "
                        "tokens/step %.2f  max|dlogp| %.1e", step, rec.reward, rec.rollout_s, rec.tail_s,
                        rec.update_s, rec.push_s, rec.tokens_per_step, rec.logprob_max_abs_diff)
            if on_step is not None:
                on_step(rec)
    return records


def run(cfg: GRPOConfig, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
    return asyncio.run(train(cfg, on_step))


def record_dict(rec: StepRecord) -> dict[str, Any]:
    return asdict(rec)
