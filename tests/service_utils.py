"""Helpers for the service tests: real servers on free loopback ports, perturbed weights, checkpoint copies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

from service.api.generation import Limits
from service.app import BackgroundServer, ServerConfig
from service.config import EngineConfig
from service.netutil import free_port

T = TypeVar("T")

ADMIN = "test-admin-token"
GROUP_TRAINER = Path(__file__).parent / "api" / "group_trainer.py"
ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 40


def engine_config(model: Path | str, **kw: Any) -> EngineConfig:
    return EngineConfig(model=str(model), **{"max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS, **kw})


def start_server(model: Path | str, *, limits: Limits | None = None, engine_kw: dict[str, Any] | None = None,
                 **kw: Any) -> BackgroundServer:
    config = ServerConfig(http_port=free_port(), grpc_port=free_port(), admin_token=ADMIN,
                          limits=limits or Limits(max_tokens=MAX_MODEL_LEN), **kw)
    return BackgroundServer(engine_config(model, **(engine_kw or {})), config).start()


def running(srv: BackgroundServer) -> Iterator[BackgroundServer]:
    """Yield `srv`, then stop it: a server fixture is one line, ``yield from running(start_server(...))``."""
    try:
        yield srv
    finally:
        srv.stop()


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def perturbed(tensors: dict[str, torch.Tensor], seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A copy with every tensor moved by `scale` times its own std (enough to change sampled tokens)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        std = float(t.float().std()) if t.numel() > 1 else 0.1
        out[name] = (t.float() + scale * max(std, 1e-3) * noise).to(t.dtype)
    return out


def write_checkpoint(src_dir: Path, tensors: dict[str, torch.Tensor], dst_dir: Path) -> Path:
    """`src_dir`'s config and tokenizer with other weights: a model folder for a reference engine."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"):
            shutil.copy(f, dst_dir / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return dst_dir


def auth(token: str = ADMIN) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


# What a pushed server is compared by: greedy tokens and logprobs of one probe prompt.
PROBE = [9, 8, 7, 6]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
Outputs = tuple[list[int], list[float]]


def served(c: Any) -> Outputs:
    """The probe through a running server (a `SpecrollClient`)."""
    s = c.generate_one(PROBE, **GREEDY).samples[0]
    return s.token_ids, s.logprobs


def fresh(base_dir: Path, weights: dict[str, torch.Tensor], tmp: Path, **engine_kw: Any) -> Outputs:
    """The probe on an engine started afresh on `weights` (what a server that took them must serve)."""
    from service.engine.llm_engine import LLMEngine
    from service.params import SamplingParams

    engine = LLMEngine(engine_config(write_checkpoint(base_dir, weights, tmp), **engine_kw))
    [out] = engine.generate([PROBE], SamplingParams(**GREEDY))
    return list(out.outputs[0].token_ids), list(out.outputs[0].logprobs)


def assert_same(got: Outputs, want: Outputs) -> None:
    assert got[0] == want[0]
    assert torch.allclose(torch.tensor(got[1]), torch.tensor(want[1]), atol=1e-5, rtol=0), (got[1], want[1])


def across(srv: BackgroundServer, act: Callable[[], T], max_tokens: int = 240) -> tuple[T, Any]:
    """`act()` while a sampled stream generates (its first token has come before `act` starts); returns what
    `act` returned and the stream's final Sample (None if it ended without one)."""
    from client import Sample, SpecrollClient

    final: list[Any] = []
    started = threading.Event()

    def consume() -> None:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            for ev in c.stream([5, 6, 7], temperature=1.0, seed=7, max_tokens=max_tokens, ignore_eos=True):
                started.set()
                if isinstance(ev, Sample):
                    final.append(ev)

    stream = threading.Thread(target=consume, daemon=True)
    stream.start()
    if not started.wait(60):
        raise AssertionError("the stream produced no token in 60 s")
    try:
        result = act()
    finally:
        stream.join(120)
    return result, (final[-1] if final else None)


def trainer_env(**extra: str) -> dict[str, str]:
    """The environment of a trainer process the tests start: the admin token, this checkout importable first
    (any PYTHONPATH already set kept after it)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "SPECROLL_ADMIN_TOKEN": ADMIN, "PYTHONPATH": path, **extra}


def group_trainer(how: str, srv: BackgroundServer, weights: dict[str, torch.Tensor], version: str, tmp: Path,
                  group: str = "wug") -> subprocess.CompletedProcess[str]:
    """Push `weights` over a gloo process group from a trainer process (tests/api/group_trainer.py: `how` is
    slime, client, die, ...); returns the finished process, its replies as JSON lines on stdout."""
    path = tmp / f"{version}.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
    return subprocess.run([sys.executable, str(GROUP_TRAINER), how, srv.http_url, str(path), version, group],
                          env=trainer_env(), capture_output=True, text=True, timeout=300)
