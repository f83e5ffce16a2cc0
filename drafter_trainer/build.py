"""Assemble a trainer: which drafter the server runs, the student that trains it, the teacher."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drafter_trainer.students import DraftStudent, EagleStudent, Student
from service.config import ModelConfig
from service.drafter_spec import DrafterSpec
from service.engine.drafters.eagle import init_head, load_head
from service.models.loader import load_model

if TYPE_CHECKING:
    from service.backend.base import DrafterCopy

logger = logging.getLogger(__name__)


class NothingToTrain(ValueError):
    """The server runs no drafter with weights (none, or only the suffix drafter)."""


def trainable(spec: DrafterSpec) -> tuple[str, str | None]:
    """("draft", DIR) or ("eagle", DIR | None): the first drafter of a server's setting that has weights to train
    (a draft-model folder this process can read, or an EAGLE head)."""
    for item in spec.items:
        if item.method == "eagle":
            return "eagle", item.path
        if item.method == "draft_model" and item.path and (Path(item.path) / "config.json").is_file():
            return "draft", item.path
    raise NothingToTrain(f"drafter {str(spec)!r} has no weights to train (give a draft-model folder or eagle[:DIR])")


def build_student(spec: DrafterSpec | str, target_cfg: ModelConfig | None, vocab: int, max_positions: int,
                  device: torch.device, seed: int = 0) -> Student:
    """A student initialised the way the server initialised its drafter from the same --drafter value (the
    server's, from GetServerInfo, or the trainer's own --drafter)."""
    kind, path = trainable(DrafterSpec.parse(spec) if isinstance(spec, str) else spec)
    if kind == "draft":
        assert path is not None
        return DraftStudent(load_model(path, torch.float32, device), Path(path), vocab, max_positions, device)
    if target_cfg is None:
        raise ValueError("training an EAGLE head needs the target model (--target-model DIR)")
    head = load_head(Path(path), target_cfg) if path else init_head(target_cfg, seed)
    return EagleStudent(head, vocab, max_positions, device, fresh=path is None)


def student_from_copy(found: DrafterCopy, spec: str, vocab: int, max_positions: int) -> Student:
    """A student from a copy of the drafter a server is serving right now (in-process trainer); `spec` is the
    server's --drafter value (whether an EAGLE head was initialised rather than loaded, where a draft model's
    folder is)."""
    device = next(found.module.parameters()).device
    spec_kind, path = trainable(DrafterSpec.parse(spec))
    if found.kind == "eagle":  # `--drafter eagle` without a folder: the engine initialised the head
        return EagleStudent(found.module, vocab, max_positions, device, fresh=path is None)
    source = Path(path) if spec_kind == "draft" and path else None
    model: Any = found.module
    return DraftStudent(model, source, vocab, max_positions, device)


def target_config(spec: str | None, version: str, fallback: str | None) -> ModelConfig | None:
    for path in (spec.replace("{version}", version) if spec else None, fallback):
        if path and (Path(path) / "config.json").is_file():
            return ModelConfig.from_dir(path)
    return None
