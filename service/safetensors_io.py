"""Reading a folder of safetensors files (single or sharded): which files, their tensors, their shapes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
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


IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.masked_bias)$")  # buffers, not weights


def shape_problems(expected: Mapping[str, tuple[int, ...]], tolerated: Mapping[str, tuple[int, ...]],
                   shapes: Mapping[str, tuple[int, ...]], partial: bool = False) -> list[str]:
    """Unknown, missing (unless `partial`) and misshaped tensors of `shapes` against a checkpoint layout;
    `tolerated` names may be present (a tied checkpoint's lm_head) and are checked when they are."""
    def want(name: str) -> tuple[int, ...] | None:
        return expected.get(name) or tolerated.get(name)

    unknown = sorted(n for n in shapes if want(n) is None and not IGNORED.search(n))
    missing = [] if partial else sorted(n for n in expected if n not in shapes)
    wrong = sorted(f"{n}: got {list(s)}, expected {list(want(n) or ())}" for n, s in shapes.items()
                   if want(n) is not None and tuple(s) != want(n))
    problems = []
    if unknown:
        problems.append(f"unknown tensors {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    if missing:
        problems.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if wrong:
        problems.append(f"wrong shapes {wrong[:8]}")
    return problems
