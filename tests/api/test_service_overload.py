"""Overload is refused cleanly: a bounded queue of work, 503 + Retry-After / RESOURCE_EXHAUSTED beyond it,
all-or-none admission of multi-prompt requests, and every admitted request still completes."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from probes import metric, wait_for
from service_utils import ADMIN, auth, start_server

from client import Overloaded, SpecrollClient
from service.backend.admission import AdmissionLimits


def test_queue_bound_refuses_cleanly_and_admitted_work_completes(model_dir):
    srv = start_server(model_dir, engine_kw={"max_num_seqs": 4}, admission=AdmissionLimits(max_waiting_seqs=6))
    url = srv.http_url
    admission = srv.server.backend.admission
    try:
        assert admission.slots == 4
        httpx.post(url + "/pause", json={"mode": "keep"}, headers=auth()).raise_for_status()

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                body = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 1.0}
                held = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(10)]
                await asyncio.to_thread(wait_for, lambda: admission.seqs == 10, 60, "10 sequences admitted")
                assert admission.waiting_seqs == 6
                # one more sequence: refused at once with Retry-After, on every API
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
                assert r.json()["error"]["type"] == "overloaded" and "overloaded" in r.json()["error"]["message"]
                r = await http.post("/v1/completions", json={**body, "stream": True})
                assert r.status_code == 503 and r.headers["retry-after"] == "2"
                r = await http.post("/generate", json={"input_ids": [1, 2, 3],
                                                      "sampling_params": {"max_new_tokens": 4}})
                assert r.status_code == 503 and r.headers["retry-after"] == "2"
                with SpecrollClient(srv.grpc_target, admin_token=ADMIN, retries=0) as c:
                    with pytest.raises(Overloaded) as err:
                        c.generate([[1, 2, 3]], max_tokens=4)
                    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED.name and err.value.retry_after_s == 2
                    info = c.server_info()
                    assert (info.max_waiting_seqs, info.num_pending_tokens) == (6, 10 * 9)
                metrics = (await http.get("/metrics")).text
                assert metric(metrics, 'specroll:requests_refused_total{reason="overloaded"}') == 4
                assert metric(metrics, "specroll:admission_max_waiting_seqs") == 6
                assert metric(metrics, "specroll:admission_waiting_seqs") == 6
                # nothing was half-admitted by the refused requests
                assert admission.seqs == 10
                (await http.post("/resume", headers=auth())).raise_for_status()
                results = await asyncio.gather(*held)
                for r in results:
                    assert r.status_code == 200, r.text
                    assert len(r.json()["choices"][0]["token_ids"]) == 6
                await asyncio.to_thread(wait_for, lambda: admission.seqs == 0 and admission.tokens == 0, 60,
                                        "the admission to empty")

        asyncio.run(scenario())
    finally:
        srv.stop()


def test_multi_prompt_request_is_admitted_whole_or_not_at_all(model_dir):
    srv = start_server(model_dir, engine_kw={"max_num_seqs": 2},
                       admission=AdmissionLimits(max_waiting_seqs=0, max_pending_tokens=60))
    url = srv.http_url
    admission = srv.server.backend.admission
    try:
        httpx.post(url + "/pause", json={"mode": "keep"}, headers=auth()).raise_for_status()

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                first = asyncio.create_task(http.post("/v1/completions", json={
                    "prompt": [[1, 2, 3], [4, 5, 6]], "max_tokens": 7, "temperature": 0}))  # 2 x 10 tokens
                await asyncio.to_thread(wait_for, lambda: admission.tokens == 20, 60, "20 tokens admitted")
                # three prompts of 20 tokens each would take 80 > 60: none of them is admitted
                r = await http.post("/v1/completions", json={"prompt": [[1, 2], [3, 4], [5, 6]], "max_tokens": 18})
                assert r.status_code == 503 and admission.tokens == 20 and admission.seqs == 2
                r = await http.post("/generate", json={"input_ids": [[1, 2], [3, 4], [5, 6]],
                                                      "sampling_params": {"max_new_tokens": 18}})
                assert r.status_code == 503 and admission.tokens == 20
                # two of them fit: admitted (and run once resumed)
                second = asyncio.create_task(http.post("/v1/completions", json={
                    "prompt": [[1, 2], [3, 4]], "max_tokens": 18, "temperature": 0}))
                await asyncio.to_thread(wait_for, lambda: admission.tokens == 60, 60, "60 tokens admitted")
                (await http.post("/resume", headers=auth())).raise_for_status()
                for r in await asyncio.gather(first, second):
                    assert r.status_code == 200, r.text
                    assert len(r.json()["choices"]) == 2
                await asyncio.to_thread(wait_for, lambda: admission.tokens == 0, 60, "the admission to empty")

        asyncio.run(scenario())
    finally:
        srv.stop()


def test_flood_beyond_the_bound_gets_answers_not_hangs(model_dir):
    """400 concurrent requests against a queue of 16: each is either served in full or refused with 503."""
    srv = start_server(model_dir, engine_kw={"max_num_seqs": 8}, admission=AdmissionLimits(max_waiting_seqs=16))
    url = srv.http_url
    try:
        async def scenario() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=400)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
                body = {"prompt": [7, 8, 9], "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(400)))

        results = asyncio.run(scenario())
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 503}, sorted(set(codes))
        assert codes.count(200) >= 24 and codes.count(503) > 0
        for r in results:
            if r.status_code == 200:
                assert len(r.json()["choices"][0]["token_ids"]) == 12  # never truncated
            else:
                assert r.headers["retry-after"] == "2"
        admission = srv.server.backend.admission
        wait_for(lambda: admission.seqs == 0, 60, "every admitted request to finish")
        assert admission.refused == codes.count(503)
    finally:
        srv.stop()


def test_non_streaming_clients_that_disconnect_leave_no_work_behind(model_dir):
    """20 non-streaming requests on both HTTP APIs whose clients hang up: their engine requests are aborted."""
    srv = start_server(model_dir)
    url = srv.http_url
    admission = srv.server.backend.admission
    try:
        httpx.post(url + "/pause", json={"mode": "keep"}, headers=auth()).raise_for_status()

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                body = {"prompt": [1, 2, 3], "max_tokens": 200, "temperature": 1.0, "ignore_eos": True}
                sgl = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
                tasks = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(10)]
                tasks += [asyncio.create_task(http.post("/generate", json=sgl)) for _ in range(10)]
                await asyncio.to_thread(wait_for, lambda: admission.seqs == 20, 60, "20 sequences admitted")
                for t in tasks:
                    t.cancel()  # the client hangs up: httpx closes each connection
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(scenario())
        # aborted while still paused: none ran a single step
        wait_for(lambda: admission.seqs == 0, 30, "the aborted requests to leave")
        metrics = httpx.get(url + "/metrics").text
        assert metric(metrics, 'specroll:requests_aborted_total{reason="client"}') == 20
        httpx.post(url + "/resume", headers=auth()).raise_for_status()
        assert metric(httpx.get(url + "/metrics").text, "specroll:generation_tokens_total") == 0
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 200
    finally:
        srv.stop()
