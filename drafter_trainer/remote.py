"""The trainer's view of the server: its state (versions, running batch) and how a drafter reaches it.

Over gRPC for the sidecar (GetServerInfo, PushWeights role=drafter); directly on the engine loop when the
trainer runs inside the server process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from drafter_trainer.students import Student

if TYPE_CHECKING:
    from client import SpecrollClient
    from service.engine.loop import EngineLoop

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
    """The server cannot take this drafter (e.g. no push path for EAGLE heads over gRPC)."""


class GrpcServer:
    def __init__(self, client: SpecrollClient) -> None:
        self.client = client

    def state(self) -> ServerState:
        i = self.client.server_info()
        return ServerState(i.policy_version, i.drafter_version, i.num_running, i.num_waiting, i.paused,
                           i.model_path, i.drafter)

    def push(self, student: Student, module: nn.Module, version: str) -> None:
        if student.kind == "eagle":
            raise PushRefused("the server's drafter push (role=drafter) takes draft models only; an EAGLE head "
                              "is checkpointed for --drafter eagle:DIR instead")
        self.client.push_weights(student.push_tensors(module), version, role="drafter")


class LocalServer:
    """The engine of the server this trainer runs in. Reads are racy but harmless (ints and strings)."""

    def __init__(self, loop: EngineLoop, timeout_s: float = 60.0) -> None:
        self.loop, self.timeout_s = loop, timeout_s

    def state(self) -> ServerState:
        e = self.loop.engine
        return ServerState(str(e.policy_version), str(e.drafter_version), e.num_running, e.num_waiting,
                           bool(e.paused), str(e.model_path), str(e.config.drafter))

    def push(self, student: Student, module: nn.Module, version: str) -> None:
        engine = self.loop.engine
        copy = student.frozen_copy(module).to(device=engine.device, dtype=engine.dtype)

        def swap(e: Any) -> None:
            if student.kind == "eagle":
                e.drafters["eagle"].swap_head(copy, version)
            else:
                e.swap_drafter(_draft_name(e), copy, version)

        self.loop.call(swap).result(self.timeout_s)


def _draft_name(engine: Any) -> str:
    from service.engine.drafters.draft_model import DraftModelDrafter

    for name, d in engine.drafters.items():
        if isinstance(d, DraftModelDrafter):
            return str(name)
    raise PushRefused("the engine has no draft-model drafter")
