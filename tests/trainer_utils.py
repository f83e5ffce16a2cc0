"""Helpers for the drafter-trainer tests: the server's own tokens per step, and driving a trainer by hand."""

from __future__ import annotations

from client import SpecrollClient


def server_tokens_per_step(c: SpecrollClient, seed: int, n_prompts: int = 40) -> float:
    """Generate fresh rollouts; the server's tokens per decode step (prefill step excluded), token-weighted."""
    comps = c.generate([[7 + i, 11 + (i * 5) % 97, 13] for i in range(n_prompts)], max_tokens=48, temperature=1.0,
                       seed=seed, ignore_eos=True)
    tokens = steps = 0.0
    for comp in comps:
        for s in comp.samples:
            n_steps = round(s.num_output_tokens / s.tokens_per_step)
            tokens += s.num_output_tokens - 1
            steps += n_steps - 1
    return tokens / steps


def pump(trainer, rounds: int = 1) -> None:
    """Let the trainer read everything in the stream and run at least `rounds` rounds."""
    start = trainer.round
    for _ in range(200):
        trainer.tick()
        if trainer.source.lag()[0] == 0 and not trainer.pool.fresh and trainer.round - start >= rounds:
            return
    raise AssertionError("the trainer did not catch up with the stream")
