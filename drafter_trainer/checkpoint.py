"""Atomic checkpoints of the trainer: weights and optimizer state in safetensors, the rest in JSON.

Layout under the checkpoint folder::

    ckpt-<round>/candidate.safetensors   the drafter being trained
    ckpt-<round>/served.safetensors      the drafter the server was last given
    ckpt-<round>/optim.safetensors       AdamW moments and steps (param_groups in state.json)
    ckpt-<round>/state.json              ledger of rollout ids taken in, counters, versions
    LATEST                               name of the newest complete checkpoint (replaced atomically)
    served/                              the served drafter as a folder the server can load

A checkpoint is written to a temporary folder, fsynced and renamed, then LATEST is replaced: a crash at any
point leaves the previous checkpoint intact. Entries are acked only after the checkpoint that took them in.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

KEEP = 2


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_tensors(optim: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    sd = optim.state_dict()
    tensors = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            tensors[f"{idx}.{key}"] = t.detach().cpu().contiguous().clone()
    return tensors, sd["param_groups"]


def load_optimizer(optim: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                   groups: list[dict[str, Any]]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        idx, _, key = name.partition(".")
        state.setdefault(int(idx), {})[key] = t
    optim.load_state_dict({"state": state, "param_groups": groups})


def _cloned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies that share no storage (tied weights appear twice in a state_dict)."""
    return {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}


class CheckpointStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def latest(self) -> Path | None:
        pointer = self.root / "LATEST"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "state.json").is_file() else None

    def save(self, round_no: int, candidate: dict[str, torch.Tensor], served: dict[str, torch.Tensor],
             optim: torch.optim.Optimizer, state: dict[str, Any]) -> Path:
        name = f"ckpt-{round_no:08d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.root))
        opt_tensors, groups = optimizer_tensors(optim)
        save_file(_cloned(candidate), str(tmp / "candidate.safetensors"))
        save_file(_cloned(served), str(tmp / "served.safetensors"))
        save_file(opt_tensors, str(tmp / "optim.safetensors"))
        (tmp / "state.json").write_text(json.dumps({**state, "param_groups": groups}))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        final = self.root / name
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer = self.root / "LATEST.tmp"
        pointer.write_text(name)
        os.replace(pointer, self.root / "LATEST")
        _fsync_dir(self.root)
        for old in sorted(self.root.glob("ckpt-*"))[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".ckpt-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return final

    def load(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor],
                            dict[str, Any]] | None:
        path = self.latest()
        if path is None:
            return None
        state = json.loads((path / "state.json").read_text())
        logger.info("resuming from checkpoint %s (round %s)", path, state.get("round"))
        return (load_file(str(path / "candidate.safetensors")), load_file(str(path / "served.safetensors")),
                load_file(str(path / "optim.safetensors")), state)

    def served_dir(self) -> Path:
        return self.root / "served"
