"""An OpenRLHF-style PPO/GRPO loop whose rollout engine is a specroll server, through specroll's client.

OpenRLHF drives vLLM engines as Ray actors in its own processes (`LLMRayActor`: generate, then a weight
broadcast over NCCL), not over HTTP. What stands in for those actors here is `SpecrollRolloutEngine`: the same
three calls a trainer makes of its engines (generate token ids with n samples, push the new weights, drop the
prefix cache), on a server anywhere on the network. Replacing OpenRLHF's `create_vllm_engines` with a list of
these (one per server) is the change in OpenRLHF itself; nothing here imports it.

    python -m examples.openrlhf.loop --server 127.0.0.1:50051 --model MODEL_DIR --steps 2
runs on CPU against `specroll serve --model MODEL_DIR --admin-token-file ...` (the demo model by default).
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from client import Completion, SpecrollClient
from examples.grpo.policy import Policy, Rollout, group_advantages
from service.demo.task import problems, reward

logger = logging.getLogger(__name__)


class SpecrollRolloutEngine:
    """What OpenRLHF's trainer asks of a vLLM engine actor, on a specroll server."""

    def __init__(self, server: str, admin_token: str | None) -> None:
        self.client = SpecrollClient(server, admin_token=admin_token)
        self.client.wait_until_ready(300)

    def generate(self, prompt_token_ids: list[list[int]], *, n: int, temperature: float, max_tokens: int,
                 seed: int | None = None) -> list[Completion]:
        """n samples per prompt, with the logprobs they were drawn with (OpenRLHF's old-policy logprobs)."""
        return self.client.generate(prompt_token_ids, n=n, temperature=temperature, max_tokens=max_tokens,
                                    seed=seed)

    def update_weights(self, state_dict: dict, version: str) -> None:
        """OpenRLHF's broadcast of the actor's weights after a step: one atomic push, tagged with its version."""
        self.client.push_weights(state_dict, version)

    def reset_prefix_cache(self) -> None:
        """Nothing to do: a push resets whatever the server cached under the old weights."""

    def close(self) -> None:
        self.client.close()


@dataclass(slots=True)
class LoopConfig:
    server: str = "127.0.0.1:50051"
    admin_token: str | None = None
    model: str = ""
    steps: int = 2
    prompts_per_step: int = 2
    n: int = 4
    max_tokens: int = 24
    temperature: float = 1.0
    lr: float = 1e-5
    seed: int = 0


def run(cfg: LoopConfig) -> list[float]:
    """The loop; returns the mean reward of each step."""
    engine = SpecrollRolloutEngine(cfg.server, cfg.admin_token)
    policy = Policy(cfg.model, lr=cfg.lr)
    means = []
    try:
        for step in range(cfg.steps):
            batch = problems(cfg.prompts_per_step, seed=cfg.seed + step)
            prompts = [policy.tokenizer.encode(p.prompt) for p in batch]
            completions = engine.generate(prompts, n=cfg.n, temperature=cfg.temperature,
                                          max_tokens=cfg.max_tokens, seed=cfg.seed + step)
            rollouts, rewards = [], []
            for problem, prompt, comp in zip(batch, prompts, completions, strict=True):
                scores = [reward(problem, policy.tokenizer.decode(s.token_ids)) for s in comp.samples]
                rewards.extend(scores)
                for s, adv in zip(comp.samples, group_advantages(scores), strict=True):
                    rollouts.append(Rollout(prompt, s.token_ids, s.logprobs, adv))
            stats = policy.update(rollouts, cfg.temperature, clip=0.2, micro_tokens=4096)
            engine.update_weights(policy.hf_weights(), f"step-{step + 1}")
            means.append(sum(rewards) / len(rewards))
            logger.info("step %d: mean reward %.3f, loss %.4f, trainer-vs-server logprob gap %.2e", step + 1,
                        means[-1], stats.loss, stats.logprob_max_abs_diff)
    finally:
        engine.close()
    return means


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--model", required=True, help="the policy's starting folder (the server's model)")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = os.environ.get("SPECROLL_ADMIN_TOKEN")
    run(LoopConfig(server=args.server, admin_token=token, model=str(Path(args.model)), steps=args.steps))


if __name__ == "__main__":
    main()
