"""Same-host pushes through a sealed memfd, on a real server that loads folders from one root only: the client's
memfd loads into the spare and serves like a fresh server (gRPC and SGLang's /update_weights_from_disk), no fd
or file is left behind, and a memfd not sealed, a /proc fd that is not a memfd, and wrong tensors are refused
with nothing changed."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers import make_checkpoint
from service_utils import ADMIN, assert_same, checkpoint_tensors, fresh, perturbed, running, served, start_server

from client import SpecrollClient
from client import weights as wt
from client.errors import InvalidArgument
from service.app import BackgroundServer

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux only")
EAGER = {"enforce_eager": True, "drafter": "none", "weight_spare": "start", "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return make_checkpoint("qwen2", tied=False, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def server(base_dir, tmp_path_factory) -> Iterator[BackgroundServer]:
    """Folders load from one root of its own (not /dev/shm, not the test's folders): a memfd needs no root."""
    yield from running(start_server(base_dir, engine_kw=EAGER,
                                    load_root=(str(tmp_path_factory.mktemp("checkpoints")),)))


def _memfds_open() -> int:
    """The memfds of pushes this process (client and in-process server) holds open."""
    def target(fd: str) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""
    names = ("/memfd:specroll-push", "/memfd:test-push")
    return sum(target(fd).startswith(names) for fd in os.listdir("/proc/self/fd"))


def _memfd(tensors: dict[str, torch.Tensor], seals: int) -> int:
    """A memfd holding `tensors` as safetensors, with `seals` added (0: none)."""
    fd = os.memfd_create("test-push", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    wt._write_safetensors(fd, wt.from_state_dict(tensors))
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_a_memfd_push_loads_into_the_spare_and_leaves_nothing_behind(server, base_dir, tmp_path):
    new = perturbed(checkpoint_tensors(base_dir), seed=71)
    spare = server.server.backend.stager.spare("target")
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        r = c.push_weights_memfd(new, "memfd-1", mode="keep")
        assert r.version == "memfd-1" and c.server_info().policy_version == "memfd-1"
        assert server.server.backend.loop.engine.runner.model is spare
        assert_same(served(c), fresh(base_dir, new, tmp_path / "ref", **EAGER))
        with pytest.raises(InvalidArgument, match="served target is bfloat16"):
            c.push_weights_memfd(new, "memfd-2", dtype=torch.float32)
        assert c.server_info().policy_version == "memfd-1"
        assert _memfds_open() == 0  # the client's memfds and the server's opens of them are closed


def test_sglangs_update_from_disk_takes_a_memfd_path(server, base_dir, tmp_path):
    """AReaL's payload for SGLang's route (inclusionAI/AReaL 4aef98d8d818af55b43621aaadba047ae10f4e77,
    areal/engine/sglang_remote.py: model_path, abort_all_requests, as tests/api/test_dropin_sglang.py sends it)
    naming a memfd instead of a folder; `weight_version` names the version to check."""
    new = perturbed(checkpoint_tensors(base_dir), seed=72)
    fd = _memfd(new, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    try:
        r = httpx.post(f"{server.http_url}/update_weights_from_disk", headers={"authorization": f"Bearer {ADMIN}"},
                       json={"model_path": wt.memfd_path(fd), "abort_all_requests": True,
                             "weight_version": "memfd-http"}, timeout=120)
    finally:
        os.close(fd)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        assert c.server_info().policy_version == "memfd-http"
        assert_same(served(c), fresh(base_dir, new, tmp_path / "ref", **EAGER))


@pytest.mark.parametrize("seals", [0, fcntl.F_SEAL_WRITE, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW],
                         ids=["none", "write-only", "size-only"])
def test_a_memfd_not_sealed_against_change_is_refused(server, base_dir, seals):
    new = perturbed(checkpoint_tensors(base_dir), seed=73)
    fd = _memfd(new, seals)
    try:
        with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
            before = c.server_info().policy_version
            with pytest.raises(InvalidArgument, match="is not sealed"):
                c.load_weights(wt.memfd_path(fd), "unsealed")
            assert c.server_info().policy_version == before
    finally:
        os.close(fd)


def test_a_proc_fd_that_is_not_a_memfd_is_refused(server, base_dir):
    """A checkpoint file opened by the client is reached through /proc too, but files are governed by
    --load-root: refused though its tensors are valid. So is an fd that does not exist."""
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        before = c.server_info().policy_version
        fd = os.open(base_dir / "model.safetensors", os.O_RDONLY)
        try:
            with pytest.raises(InvalidArgument, match="is not a memfd"):
                c.load_weights(wt.memfd_path(fd), "a-file")
        finally:
            os.close(fd)
        with pytest.raises(InvalidArgument, match="cannot be opened by the server"):
            c.load_weights(wt.memfd_path(fd), "closed")
        assert c.server_info().policy_version == before


def test_a_sealed_memfd_with_wrong_tensors_is_refused_with_nothing_changed(server, base_dir):
    tensors = checkpoint_tensors(base_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    wrong = {**tensors, name: tensors[name][:, :-1].contiguous()}
    fd = _memfd(wrong, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    try:
        with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
            before, probe = c.server_info().policy_version, served(c)
            with pytest.raises(InvalidArgument, match=r"memfd .*wrong shapes"):
                c.load_weights(wt.memfd_path(fd), "wrong")
            assert c.server_info().policy_version == before
            assert served(c) == probe
    finally:
        os.close(fd)
