"""Drafter distillation: keeps the server's drafter aligned with the policy it serves.

Runs as a sidecar (`specroll drafter-trainer --server ADDR --redis-url URL`) reading the rollout stream
through a Redis consumer group, or inside the server process when it has no Redis (`specroll serve`).
"""

from drafter_trainer.config import TrainerConfig

__all__ = ["TrainerConfig"]
