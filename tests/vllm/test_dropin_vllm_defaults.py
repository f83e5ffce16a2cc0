"""--backend vllm without --max-model-len on a checkpoint whose context is 512: it starts, serves the
checkpoint's context (vLLM's auto-fit under the KV cache), and /v1/completions and /server_info report it."""

from __future__ import annotations

import httpx
import pytest
from service_utils import start_server

from service.api.generation import Limits
from service.vllm.config import VllmConfig

pytestmark = pytest.mark.vllm


def test_context_from_the_checkpoint(vllm_model):
    srv = start_server(vllm_model, engine_kw={"max_model_len": None, "max_num_seqs": 8, "kv_cache_memory_gb": 0.125},
                       backend="vllm", vllm=VllmConfig(gpu_memory_utilization=0.3), control_auth="none",
                       limits=Limits())  # the max_tokens limit follows the context
    try:
        assert srv.server.backend.wait_loaded(600) and srv.server.backend.load_error is None
        assert srv.server.backend.info().max_model_len == 512
        with httpx.Client(base_url=srv.http_url, timeout=120) as c:
            assert c.get("/server_info").json()["vllm_config"]["model_config"]["max_model_len"] == 512
            r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0.0,
                                                "ignore_eos": True})
            assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 400, r.text
            assert c.post("/reset_prefix_cache").json() == {"success": True}
            assert c.get("/flush_cache").status_code == 200
    finally:
        srv.stop()
