"""NCCL weight pushes, where CUDA is: our client over SGLang's protocol and vLLM's trainer-engine payloads over
the weight-transfer endpoints, the server's engine on one GPU and the trainer process on another (NCCL refuses
two ranks of a group on one device). Without two CUDA devices every test skips with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import default_checkpoint
from safetensors.torch import save_file
from service_utils import (
    ADMIN,
    checkpoint_tensors,
    fresh,
    perturbed,
    running,
    served,
    start_server,
    trainer_env,
)

from client import SpecrollClient
from service.app import BackgroundServer

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and torch.distributed.is_nccl_available()),
    reason="NCCL pushes need two CUDA devices (the server's and the trainer's) and NCCL; this machine has "
           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return default_checkpoint(tied=False)


@pytest.fixture(scope="module")
def server(base_dir: Path) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir, engine_kw={"device": "cuda:0"}))


def run(python: Path | str, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = trainer_env(TRANSFER_BACKEND="nccl", CUDA_VISIBLE_DEVICES="1")
    return subprocess.run([str(python), str(HERE / script), *args], env=env, capture_output=True, text=True,
                          timeout=300)


def check_serves(c: SpecrollClient, base_dir: Path, weights: dict[str, torch.Tensor], tmp: Path) -> None:
    got, want = served(c), fresh(base_dir, weights, tmp, device="cuda:0")
    assert got[0] == want[0]
    assert torch.allclose(torch.tensor(got[1]), torch.tensor(want[1]), atol=1e-4, rtol=0)


def test_client_group_push_over_nccl(server, base_dir, tmp_path):
    new = perturbed(checkpoint_tensors(base_dir), seed=61)
    save_file({k: v.contiguous() for k, v in new.items()}, str(tmp_path / "w.safetensors"))
    done = run(sys.executable, "group_trainer.py", "client", server.http_url, str(tmp_path / "w.safetensors"),
               "nccl-v1", "nccl")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["version"] == "nccl-v1"
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        assert c.server_info().policy_version == "nccl-v1"
        check_serves(c, base_dir, new, tmp_path / "ref")


@pytest.mark.skipif(not VENV_PYTHON.exists(), reason="the trainer chunks with vllm's packed_tensor: .venv-vllm")
def test_weight_transfer_push_over_nccl(server, base_dir, tmp_path):
    new = perturbed(checkpoint_tensors(base_dir), seed=62)
    save_file({k: v.contiguous() for k, v in new.items()}, str(tmp_path / "w.safetensors"))
    done = run(VENV_PYTHON, "transfer_trainer.py", "vllm", server.http_url, str(tmp_path / "w.safetensors"),
               "nccl-v2", "wait", "60")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])[-1]["version"] == "nccl-v2"
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        assert c.server_info().policy_version == "nccl-v2"
        check_serves(c, base_dir, new, tmp_path / "ref")
