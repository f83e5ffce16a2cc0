"""verl's agent loop on a specroll server, over the vLLM-style HTTP API verl's rollout servers speak.

verl starts its rollout engines itself, as Ray actors (vLLM or SGLang replicas), and its agent loops reach them
through a server manager whose call is `generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput`
(token ids and their logprobs). `SpecrollServerManager` offers that call on specroll's
/inference/v1/generate (token ids in, token ids and logprobs out: no retokenization), and `single_turn` is an
agent loop in verl's shape (prompt_ids, response_ids, response_mask, response_logprobs). Using it in verl means
handing verl's agent-loop worker this manager in place of the one it builds over its own replicas; weight
updates then go to specroll (/update_weights_from_disk, or the client's push) instead of verl's in-process sync.
Multi-turn agents that speak chat use /v1/chat/completions (docs/api.md).

    python -m examples.verl.server_manager --url http://127.0.0.1:8000
runs on CPU against any specroll server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenOutput:
    """What verl's server manager returns for one request."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str | None = None
    weight_version: str = ""


@dataclass(slots=True)
class AgentLoopOutput:
    """One trajectory as verl's trainer takes it: the mask marks model tokens (1) against tool/env tokens (0)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    metrics: dict[str, Any] = field(default_factory=dict)


class SpecrollServerManager:
    """verl's `generate(request_id, *, prompt_ids, sampling_params)` on a specroll server (or a router)."""

    def __init__(self, url: str, timeout: float = 600.0, api_token: str | None = None) -> None:
        headers = {"authorization": f"Bearer {api_token}"} if api_token else None
        self.http = httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers)

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None) -> TokenOutput:
        if image_data is not None:
            raise ValueError("specroll serves text models: image_data must be None")
        sp = {"logprobs": 0, **sampling_params}
        r = await self.http.post("/inference/v1/generate", json={"token_ids": prompt_ids, "sampling_params": sp,
                                                                 "request_id": request_id})
        r.raise_for_status()
        [choice] = r.json()["choices"]
        return TokenOutput(choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]],
                           choice["finish_reason"], choice.get("weight_version", ""))

    async def close(self) -> None:
        await self.http.aclose()


async def single_turn(manager: SpecrollServerManager, prompt_ids: list[int],
                      sampling_params: dict[str, Any]) -> AgentLoopOutput:
    """verl's single-turn agent loop: one generation, every response token the model's own."""
    out = await manager.generate(uuid.uuid4().hex, prompt_ids=prompt_ids, sampling_params=sampling_params)
    return AgentLoopOutput(prompt_ids, out.token_ids, [1] * len(out.token_ids), out.log_probs,
                           {"weight_version": out.weight_version, "finish_reason": out.finish_reason})


async def rollout_batch(url: str, prompts: list[list[int]], sampling_params: dict[str, Any]) -> list[AgentLoopOutput]:
    """A batch of trajectories, concurrently (as verl's agent-loop workers run them)."""
    manager = SpecrollServerManager(url)
    try:
        return list(await asyncio.gather(*(single_turn(manager, p, sampling_params) for p in prompts)))
    finally:
        await manager.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    outs = asyncio.run(rollout_batch(args.url, [[5, 17, 42], [3, 8, 13]],
                                     {"temperature": 1.0, "max_tokens": 16, "seed": 0}))
    for o in outs:
        logger.info("%d prompt -> %d response tokens, version %s", len(o.prompt_ids), len(o.response_ids),
                    o.metrics["weight_version"])


if __name__ == "__main__":
    main()
