"""Smoke test of bench/load.py: a small mixed HTTP + gRPC load on a real server, every sample complete."""

from __future__ import annotations

import asyncio

from helpers import default_checkpoint
from service_utils import start_server

from bench.load import KINDS, run_load

REQUESTS = 20
MAX_TOKENS = 8


def test_load_bench_small_run_has_no_errors_and_no_truncation() -> None:
    server = start_server(default_checkpoint())
    try:
        result = asyncio.run(run_load(server.http_url, server.grpc_target, concurrency=REQUESTS, requests=REQUESTS,
                                      max_tokens=MAX_TOKENS, timeout_s=120.0))
    finally:
        server.stop()
    assert result["requests"] == REQUESTS and result["ok"] == REQUESTS, result
    assert result["errors"] == 0 and result["errors_by_kind"] == {}, result
    assert result["refusals"] == 0 and result["truncated_samples"] == 0, result
    assert set(result["requests_by_kind"]) == set(KINDS)
    # n is 1 or 2 per request; every sample carries exactly max_tokens tokens
    assert REQUESTS * MAX_TOKENS <= result["output_tokens"] <= 2 * REQUESTS * MAX_TOKENS
    assert result["output_tokens"] % MAX_TOKENS == 0
    assert result["p50_latency_s"] is not None and len(result["loadavg"]) == 3
