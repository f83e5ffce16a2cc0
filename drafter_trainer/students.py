"""The drafters the trainer can train, as the server serves them.

`DraftStudent`: a draft model (our CausalLM); pushed with Hugging Face tensor names (role=drafter) and
saved as a Hugging Face folder the server can load with ``--drafter DIR``. `EagleStudent`: an EAGLE-style
head over the target's features; its weights are the head's state_dict (fc.weight, layer.*, norm.weight),
saved as ``DIR/model.safetensors`` for ``--drafter eagle:DIR``. Both give drafter logits for the rows of a
Batch; training is a cache-free causal forward (`causal_meta`).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from drafter_trainer.batch import Batch
from service.config import ModelConfig
from service.engine.drafters.eagle import EagleHead
from service.models.llama import CausalLM, causal_meta
from service.models.loader import hf_state_dict
from service.models.rope import Rope


def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Drafter logits over the target's vocabulary, like the server's draft-model drafter."""
    if logits.shape[-1] >= vocab:
        return logits[..., :vocab]
    return F.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))


class Student:
    kind = "student"
    min_col = 0  # first prefix position the drafter can predict from
    needs_target = False

    def __init__(self, module: nn.Module, rope_cfg: ModelConfig, vocab: int, max_positions: int,
                 device: torch.device) -> None:
        self.module = module.to(device=device, dtype=torch.float32).train().requires_grad_(True)
        self.vocab, self.device = vocab, device
        self.fresh = False  # initialised here, not loaded: far from any target (the default rate is higher)
        self.rope = Rope(rope_cfg, max_positions, device, torch.float32)

    def frozen_copy(self, module: nn.Module | None = None) -> nn.Module:
        return copy.deepcopy(module or self.module).eval().requires_grad_(False)

    def logits(self, module: nn.Module, batch: Batch, hidden: torch.Tensor | None,
               target: CausalLM | None) -> torch.Tensor:
        raise NotImplementedError

    def push_tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def save_folder(self, module: nn.Module, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.push_tensors(module), str(path / "model.safetensors"), metadata={"format": "pt"})

    def load_weights(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        module.load_state_dict({k: v.to(self.device) for k, v in tensors.items()})


class DraftStudent(Student):
    kind = "draft"

    def __init__(self, model: CausalLM, source_dir: Path | None, vocab: int, max_positions: int,
                 device: torch.device) -> None:
        super().__init__(model, model.config, vocab, max_positions, device)
        self.source_dir = source_dir

    def logits(self, module: nn.Module, batch: Batch, hidden: torch.Tensor | None,
               target: CausalLM | None) -> torch.Tensor:
        B, L = batch.ids.shape
        h = module(batch.ids, causal_meta(self.rope.cos, self.rope.sin, B, L), None, None)
        return _fit_vocab(module.logits(h[batch.rows, batch.cols]), self.vocab)

    def push_tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        assert isinstance(module, CausalLM)
        return hf_state_dict(module)

    def save_folder(self, module: nn.Module, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        if self.source_dir is not None:  # config, tokenizer, generation config
            for f in Path(self.source_dir).iterdir():
                if f.is_file() and not f.name.endswith((".safetensors", ".index.json")):
                    shutil.copy(f, path / f.name)
        super().save_folder(module, path)


class EagleStudent(Student):
    kind = "eagle"
    min_col = 1
    needs_target = True

    def __init__(self, head: EagleHead, vocab: int, max_positions: int, device: torch.device,
                 fresh: bool = False) -> None:
        super().__init__(head, head.config, vocab, max_positions, device)
        self.fresh = fresh

    def logits(self, module: nn.Module, batch: Batch, hidden: torch.Tensor | None,
               target: CausalLM | None) -> torch.Tensor:
        """Head position t reads (f_t, x_{t+1}) and predicts f_{t+1}, which drafts x_{t+2}: the row predicting
        from prefix position c uses head position c - 1."""
        if hidden is None or target is None:
            raise ValueError("an EAGLE head trains on the target's features; no target model is loaded")
        B, L = batch.ids.shape
        with torch.no_grad():
            emb = target.embed_tokens(batch.ids[:, 1:]).float()
        out = module(emb, hidden[:, :-1], causal_meta(self.rope.cos, self.rope.sin, B, L - 1))
        sel = out[batch.rows, batch.cols - 1]
        return _fit_vocab(F.linear(sel, target.lm_head.weight.float()), self.vocab)

    def push_tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in module.state_dict().items()}
