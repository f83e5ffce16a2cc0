"""Held choices at one row: the adaptive strategy deciding every step against a choice that decides several short
steps (service/engine/strategy_driver.py, `MAX_HOLD`), in one engine, rounds alternating between the two.

Each round generates the same greedy one-row responses on the demo model with the default drafters (suffix table
and draft model), the suffix table's history cleared first, so both settings emit the same tokens and differ only
in how often the strategy chooses. Rounds alternate in one process because this 2-core machine's speed drifts by
10-20% between runs a minute apart.

    python3 -m bench.strategy_hold [--rounds 16] [--max-tokens 600] [--threads 1] [--enforce-eager]

Prints one JSON line: steps, seconds, held steps and tokens a second per setting, `speedup` (held over every step
chosen) and `same_tokens` (each round's responses equal those of the round before it with the other setting).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
from tqdm import tqdm

from service.config import EngineConfig
from service.demo.default_model import ensure_default_model
from service.engine import strategy_driver
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams

logger = logging.getLogger("bench.strategy_hold")
PROMPTS = [[9, 10, 11, 12], [20, 21, 22]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16, help="rounds, alternating between the settings")
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hold", type=int, default=strategy_driver.MAX_HOLD, help="MAX_HOLD of the held setting")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile (a quick run)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=str(ensure_default_model()), num_threads=args.threads, drafter="auto",
                                    enforce_eager=args.enforce_eager))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.generate([[5, 6, 7, 8]], params)  # first forwards of every arm
    loadavg = os.getloadavg()[0]
    settings = {1: "every_step", args.hold: "held"}
    totals = {name: {"steps": 0, "seconds": 0.0, "held_steps": 0, "tokens": 0} for name in settings.values()}
    responses: list[list[list[int]]] = []  # per round, each response's tokens
    for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        hold = 1 if r % 2 == 0 else args.hold
        strategy_driver.MAX_HOLD = hold
        out = totals[settings[hold]]
        responses.append([])
        for i, prompt in enumerate(PROMPTS):
            engine.drafters["suffix"].reset()  # no history of this prompt's response from an earlier round
            engine.add_request([*prompt, r // 2 + i], params)
            tokens: list[int] = []
            held_before = engine.driver.held_steps
            start = time.perf_counter()
            while engine.has_unfinished():
                tokens += [t for step in engine.step() for t in step.new_token_ids]
                out["steps"] += 1
            out["seconds"] += time.perf_counter() - start
            out["held_steps"] += engine.driver.held_steps - held_before
            out["tokens"] += len(tokens)
            responses[-1].append(tokens)
    for out in totals.values():
        out["seconds"] = round(out["seconds"], 3)
        out["tokens_per_s"] = round(out["tokens"] / out["seconds"], 1)
    result = {"bench": "strategy_hold", "threads": args.threads, "rounds": args.rounds, "max_hold": args.hold,
              "loadavg": [round(loadavg, 2), round(os.getloadavg()[0], 2)], **totals,
              "speedup": round(totals["held"]["tokens_per_s"] / totals["every_step"]["tokens_per_s"], 3),
              "same_tokens": all(responses[r] == responses[r - 1] for r in range(1, len(responses), 2))}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
