"""`specroll serve` as a real process: flags and environment, both APIs, graceful shutdown on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
from helpers import make_checkpoint
from service_utils import ADMIN

from client import SpecrollClient
from service.netutil import free_port


def test_serve_subprocess_end_to_end(tmp_path):
    model = make_checkpoint("qwen2", tied=True)
    http_port, grpc_port = free_port(), free_port()
    env = dict(os.environ, SPECROLL_ADMIN_TOKEN=ADMIN, SPECROLL_GRPC_PORT=str(grpc_port))
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--http-port", str(http_port),
           "--max-model-len", "128", "--max-num-seqs", "8", "--served-model-name", "tiny"]
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        with SpecrollClient(f"127.0.0.1:{grpc_port}", admin_token=ADMIN) as c:
            [comp] = c.generate([[1, 2, 3]], max_tokens=5, temperature=0)
            assert comp.samples[0].token_ids == r.json()["choices"][0]["token_ids"]
            assert c.pause("keep") == [] and c.server_info().paused
            c.resume()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
