"""Reading a folder of safetensors files (single or sharded): which files, their tensors, their shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from service.config import ConfigError


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in model folder {str(path)!r}")
    for f in files:
        if not f.is_file():
            raise ConfigError(f"checkpoint index names {f.name!r} but the file is missing")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, sf.get_tensor(name)


def read_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes
