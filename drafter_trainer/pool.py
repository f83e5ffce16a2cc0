"""The rollouts the trainer works from: a recency window to train on and a held-out set to measure on.

One rollout in `holdout_every` (by a hash of its id, so a redelivered entry lands on the same side) is held
out. Training samples take the rollouts that arrived since the last round first, then random ones from the
window. Weights: 1 for the server's current policy version, `stale_weight` for the previous versions kept
by `recency_versions`, 0 beyond; times 1 + reward_alpha * (z-scored reward) when rewards are known.
"""

from __future__ import annotations

import random
import zlib
from collections import deque

from drafter_trainer.config import TrainerConfig
from service.buffer.codec import BufferedRollout

MIN_REWARD_WEIGHT, MAX_REWARD_WEIGHT = 0.1, 3.0


class RolloutPool:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.window: deque[BufferedRollout] = deque(maxlen=cfg.window_rollouts)
        self.heldout: deque[BufferedRollout] = deque(maxlen=cfg.heldout_max)
        self.fresh: list[BufferedRollout] = []
        self.versions: list[str] = []  # policy versions in the order the server served them

    @property
    def current(self) -> str | None:
        return self.versions[-1] if self.versions else None

    def note_version(self, version: str) -> bool:
        if version in self.versions:
            return False
        self.versions.append(version)
        return True

    def role(self, rollout_id: str) -> str:
        return "eval" if zlib.crc32(rollout_id.encode()) % self.cfg.holdout_every == 0 else "train"

    def add(self, r: BufferedRollout, role: str) -> None:
        if role == "eval":
            self.heldout.append(r)
        elif role == "train":
            self.window.append(r)
            self.fresh.append(r)

    def recency_weight(self, r: BufferedRollout) -> float:
        recent = self.versions[-self.cfg.recency_versions :]
        if r.policy_version == self.current and all(v == self.current for v in r.policy_versions):
            return 1.0
        if r.policy_version in recent or (r.policy_version not in self.versions
                                          and len(self.versions) < self.cfg.recency_versions):
            return self.cfg.stale_weight  # older, or from before this trainer started
        return 0.0

    def sample(self, n: int, rng: random.Random) -> list[BufferedRollout]:
        """Fresh rollouts first (each trained on at least once), then random ones from the window, more
        likely the more recent their policy version."""
        out, self.fresh = self.fresh[:n], self.fresh[n:]
        taken = {id(r) for r in out}
        candidates = [(r, w) for r in self.window if id(r) not in taken and (w := self.recency_weight(r)) > 0]
        want = min(n - len(out), len(candidates))
        if want > 0:  # without replacement, in proportion to recency weight (Efraimidis-Spirakis keys)
            keyed = sorted(candidates, key=lambda rw: rng.random() ** (1.0 / rw[1]), reverse=True)
            out += [r for r, _ in keyed[:want]]
        return [r for r in out if self.recency_weight(r) > 0]

    def heldout_recent(self) -> list[tuple[str, list[BufferedRollout]]]:
        """Held-out rollouts to measure on, by policy version, newest first: the current version's, then older
        ones (up to `measure_versions` in all) until `min_heldout` are in hand. A trainer that pushes every
        policy step (GRPO) holds out about a fifth of one step's rollouts per version, often fewer than
        `min_heldout`, and none at all of a version just pushed; a round of training can outlast a step, so
        the round that began on one version is measured after one or two more. Rollouts that span versions
        are left out."""
        groups: list[tuple[str, list[BufferedRollout]]] = []
        count = 0
        for version in reversed(self.versions[-self.cfg.measure_versions :]):
            if count >= self.cfg.min_heldout:
                break
            held = [r for r in self.heldout if r.policy_version == version
                    and all(v == version for v in r.policy_versions)]
            if held:
                groups.append((version, held))
                count += len(held)
        return groups

    def weights(self, rollouts: list[BufferedRollout]) -> list[float]:
        base = [self.recency_weight(r) for r in rollouts]
        alpha = self.cfg.reward_alpha
        known = [r.reward for r in rollouts if r.reward is not None]
        if alpha <= 0 or len(known) < 2:
            return base
        mean = sum(known) / len(known)
        std = (sum((x - mean) ** 2 for x in known) / len(known)) ** 0.5
        if std == 0:
            return base
        out = []
        for w, r in zip(base, rollouts, strict=True):
            if r.reward is not None:
                z = (r.reward - mean) / std
                w *= min(max(1 + alpha * z, MIN_REWARD_WEIGHT), MAX_REWARD_WEIGHT)
            out.append(w)
        return out
