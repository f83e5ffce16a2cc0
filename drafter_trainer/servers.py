"""The trainer's view of the server: its state (versions, running batch) and how a drafter reaches it.

Over gRPC for the sidecar (GetServerInfo, PushWeights role=drafter); directly on the engine loop when the
trainer runs inside the server process (the same stage-and-commit path as a push).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from drafter_trainer.students import Student
from service.backend.base import PushUnsupported

if TYPE_CHECKING:
    from client import SpecrollClient
    from service.backend.base import RolloutBackend

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerState:
    policy_version: str
    drafter_version: str
    num_running: int
    num_waiting: int
    paused: bool
    model_path: str = ""
    drafter: str = ""


class PushRefused(RuntimeError):
    """The server cannot take this drafter (its drafter has no weights)."""


class GrpcServer:
    def __init__(self, client: SpecrollClient) -> None:
        self.client = client

    def state(self) -> ServerState:
        i = self.client.server_info()
        return ServerState(i.policy_version, i.drafter_version, i.num_running, i.num_waiting, i.paused,
                           i.model_path, i.drafter)

    def push(self, student: Student, module: nn.Module, version: str) -> None:
        """A draft model (Hugging Face names) or an EAGLE head (its state dict): the server's drafter role
        takes whichever drafter it serves."""
        from client.errors import FailedPrecondition

        try:
            # The student trains in float32: the server casts to its drafter's dtype, asked for explicitly.
            self.client.push_weights(student.push_tensors(module), version, role="drafter", cast=True)
        except FailedPrecondition as exc:  # the server's drafter has no weights (e.g. suffix only)
            raise PushRefused(str(exc)) from exc


class LocalServer:
    """The backend of the server this trainer runs in: its stats snapshot, and the same drafter push path
    (stage, then commit) a trainer's push over the network takes."""

    def __init__(self, backend: RolloutBackend, timeout_s: float = 60.0) -> None:
        self.backend, self.timeout_s = backend, timeout_s

    def state(self) -> ServerState:
        s, info = self.backend.stats(), self.backend.info()
        return ServerState(s.policy_version, s.drafter_version, s.num_running, s.num_waiting, s.paused,
                           str(info.model_path), info.drafter)

    def push(self, student: Student, module: nn.Module, version: str) -> None:
        try:
            staged = self.backend.stage_weights("drafter", student.push_tensors(module).items(), cast=True)
        except PushUnsupported as exc:
            raise PushRefused(str(exc)) from exc
        self.backend.commit_weights(staged, version, "keep").result(self.timeout_s)
