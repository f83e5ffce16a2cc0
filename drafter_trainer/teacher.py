"""The target model as a teacher, kept at the policy version the server serves.

Where the weights come from (the choice, documented): the sidecar loads the target from a folder on a
shared disk, ``--target-model DIR`` (default: the server's model folder when it is local). When the server's
policy version changes it loads again: from ``DIR`` with ``{version}`` replaced by the new version when the
path holds that placeholder (a trainer that writes each policy to its own folder and calls LoadWeights with
it), else from the same folder (a trainer that overwrites one folder before calling LoadWeights). Rollouts
of a policy version the teacher does not have fall back to the payload (top-k logprobs, else the sampled
tokens). In-process, the teacher is the engine's own serving model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from drafter_trainer.batch import Batch
from service.engine.sampler import process_logits
from service.models.llama import CausalLM, causal_meta
from service.models.loader import load_model
from service.models.rope import Rope

logger = logging.getLogger(__name__)

Resolver = Callable[[str], CausalLM | None]


def folder_resolver(spec: str, device: torch.device) -> Resolver:
    def resolve(version: str) -> CausalLM | None:
        path = Path(spec.replace("{version}", version))
        if not (path / "config.json").is_file():
            logger.warning("no target model for policy version %s at %s; using payload logprobs", version, path)
            return None
        logger.info("loading target policy version %s from %s", version, path)
        return load_model(path, torch.float32, device)

    return resolve


class Teacher:
    def __init__(self, resolve: Resolver | None, device: torch.device, max_positions: int) -> None:
        self.resolve, self.device, self.max_positions = resolve, device, max_positions
        self.model: CausalLM | None = None
        self.version: str | None = None
        self._tried: str | None = None
        self._rope: Rope | None = None

    def sync(self, version: str) -> bool:
        """Serve `version` from now on if it can be had; True when the teacher changed."""
        if self.resolve is None or version in (self.version, self._tried):
            return False
        self._tried = version
        try:
            model = self.resolve(version)
        except Exception:
            logger.exception("could not load the target for policy version %s", version)
            model = None
        if model is None:
            self.model = self.version = None
            return True
        if self._rope is None or self.model is None or model.config != self.model.config:
            self._rope = Rope(model.config, self.max_positions, self.device, next(model.parameters()).dtype)
        self.model, self.version = model, version
        return True

    @torch.no_grad()
    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, L, H] (float32) of the target for right-padded ids [B, L]."""
        assert self.model is not None and self._rope is not None
        B, L = ids.shape
        return self.model(ids, causal_meta(self._rope.cos, self._rope.sin, B, L), None, None).float()

    @torch.no_grad()
    def logprobs(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Processed target logprobs [N, V] for the batch rows (what the server samples from)."""
        assert self.model is not None
        weight = self.model.lm_head.weight
        logits = (hidden[batch.rows, batch.cols].to(weight.dtype) @ weight.T).float()
        return process_logits(logits, batch.sb)
