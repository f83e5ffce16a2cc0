"""The client installs and runs without the server: a fresh virtualenv (no system site-packages) gets only
`pip install ./client`, then talks to a real server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import default_checkpoint
from service_utils import start_server

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import importlib.util, sys
    from client import SpecrollClient
    assert importlib.util.find_spec("service") is None, "the server package is importable"
    assert importlib.util.find_spec("torch") is None, "torch came with the client"
    with SpecrollClient(sys.argv[1]) as c:
        info = c.server_info()
        done = c.generate_one([1, 2, 3], max_tokens=5, temperature=0.0, ignore_eos=True)
    print(info.backend, info.vocab_size, len(done.samples[0].token_ids))
""")


def test_checked_in_grpc_code_matches_the_proto(tmp_path):
    """client/_gen is generated from proto/: a changed .proto without regenerating fails here."""
    from client import protogen

    assert (protogen.GEN_DIR / protogen.STAMP).read_text().strip() == protogen._stamp()
    protogen._run_protoc(tmp_path)
    protogen._flatten(tmp_path, tmp_path)
    for name in ("rollout_pb2.py", "rollout_pb2_grpc.py"):
        assert (tmp_path / name).read_text() == (protogen.GEN_DIR / name).read_text(), name


def test_client_installs_and_talks_to_a_server_without_the_server_package(tmp_path, checkpoint_dir):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    src = tmp_path / "client-src"  # built from a copy: the checkout stays clean
    shutil.copytree(ROOT / "client", src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", str(src)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        if "Could not find a version" in pip.stderr or "connection" in pip.stderr.lower():
            if os.environ.get("CI"):
                pytest.fail(f"pip could not fetch the client's dependencies in CI:\n{pip.stderr[-2000:]}")
            pytest.skip(f"no package index reachable for grpcio/protobuf: {pip.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"pip install ./client failed:\n{pip.stderr[-3000:]}")
    srv = start_server(default_checkpoint())
    try:
        out = subprocess.run([str(py), "-c", SCRIPT, srv.grpc_target], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
    finally:
        srv.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    backend, vocab, n_tokens = out.stdout.split()
    assert backend == "native" and int(vocab) > 0 and int(n_tokens) == 5
