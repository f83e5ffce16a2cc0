"""Weight-push faults that hold today and must stay so (real server): concurrent pushes, pushes under streaming load."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers import default_checkpoint
from service_utils import ADMIN, checkpoint_tensors, engine_config, perturbed, running, start_server, write_checkpoint

from client import AsyncSpecrollClient, Sample, SpecrollError
from service.app import BackgroundServer
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams

PROBE = [9, 8, 7, 6]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
CLEAN_REFUSALS = {"FAILED_PRECONDITION", "ABORTED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
STREAM_TOKENS = 200
N_STREAMS = 12


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return default_checkpoint(tied=False)


@pytest.fixture(scope="module")
def base(base_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(base_dir)


@pytest.fixture(scope="module")
def server(base_dir: Path) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir))


def greedy_reference(model_dir: Path, tensors: dict[str, torch.Tensor], dst: Path) -> list[int]:
    engine = LLMEngine(engine_config(write_checkpoint(model_dir, tensors, dst)))
    [out] = engine.generate([PROBE], SamplingParams(**GREEDY))
    return list(out.outputs[0].token_ids)


async def _push(c: AsyncSpecrollClient, tensors: dict[str, torch.Tensor], version: str, mode: str) -> str | None:
    """The version when applied; None when refused cleanly (any other error fails the test)."""
    try:
        result = await c.push_weights(tensors, version, mode=mode)
    except SpecrollError as exc:
        assert exc.code in CLEAN_REFUSALS, f"push {version} failed uncleanly: {exc.code} {exc}"
        return None
    assert result.version == version
    return version


@pytest.mark.parametrize("modes", [("keep", "keep"), ("wait", "abort")], ids=["keep-keep", "wait-abort"])
def test_two_concurrent_pushes_leave_one_consistent_version(server, base_dir, base, tmp_path, modes) -> None:
    pushed = {"a": perturbed(base, seed=11), "b": perturbed(base, seed=12)}

    async def scenario() -> tuple[list[str | None], str, list[int]]:
        async with AsyncSpecrollClient(server.grpc_target, admin_token=ADMIN, timeout_s=120) as c:
            streams = [asyncio.create_task(c.generate_one([3, 4, 5 + i], max_tokens=64, ignore_eos=True,
                                                          temperature=1.0, seed=i)) for i in range(4)]
            applied = await asyncio.gather(*(_push(c, t, f"{v}-{'-'.join(modes)}", m)
                                             for (v, t), m in zip(pushed.items(), modes, strict=True)))
            completions = await asyncio.gather(*streams)
            for comp in completions:  # wait / keep let them finish; abort may cut them, never fail them
                assert all(s.finish_reason in ("length", "abort") for s in comp.samples)
            info = await c.server_info()
            probe = await c.generate_one(PROBE, **GREEDY)
            return list(applied), info.policy_version, probe.samples[0].token_ids

    applied, final, probe = asyncio.run(scenario())
    assert any(applied), f"neither concurrent push was applied: {applied}"
    assert final in [v for v in applied if v], (final, applied)
    final_tensors = pushed[final.split("-")[0]]
    assert probe == greedy_reference(base_dir, final_tensors, tmp_path / "ref")  # the swap was whole, not mixed
    assert httpx.get(f"{server.http_url}/health").status_code == 200


def _check_spans(s: Sample, order: list[str], max_tokens: int) -> None:
    assert s.finish_reason == "length" and len(s.token_ids) == max_tokens
    spans = s.version_spans
    assert spans and spans[0].start == 0 and spans[-1].end == max_tokens
    for prev, nxt in itertools.pairwise(spans):
        assert prev.end == nxt.start and prev.start < prev.end
        assert order.index(prev.policy_version) < order.index(nxt.policy_version)  # pushes seen in order


def test_three_pushes_under_streaming_load_keep_every_stream_whole(server, base) -> None:
    versions = ["load-0", "load-1", "load-2", "load-3"]
    weights = [base, *(perturbed(base, seed=20 + i) for i in range(3))]

    async def scenario() -> tuple[list[Sample], list[dict[str, Any]]]:
        async with (AsyncSpecrollClient(server.grpc_target, admin_token=ADMIN, timeout_s=180) as c,
                    httpx.AsyncClient(base_url=server.http_url, timeout=180) as http):
            await c.push_weights(weights[0], versions[0], mode="keep")
            started = [asyncio.Event() for _ in range(N_STREAMS)]

            async def consume(i: int) -> Sample:
                final = None
                async for ev in c.stream([2 + i, 7, 11], max_tokens=STREAM_TOKENS, ignore_eos=True,
                                         temperature=1.0, seed=i):
                    if isinstance(ev, Sample):
                        final = ev
                    else:
                        started[i].set()
                assert final is not None
                return final

            grpc_tasks = [asyncio.create_task(consume(i)) for i in range(N_STREAMS)]
            http_task = asyncio.create_task(http.post("/v1/completions", json={
                "prompt": [5, 6, 7], "n": 4, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 1.0}))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            for v, w, mode in zip(versions[1:], weights[1:], ("keep", "wait", "keep"), strict=True):
                assert (await c.push_weights(w, v, mode=mode)).version == v
            finals = await asyncio.gather(*grpc_tasks)
            r = await http_task
            assert r.status_code == 200, r.text
            return list(finals), r.json()["choices"]

    finals, choices = asyncio.run(scenario())
    for s in finals:
        _check_spans(s, versions, STREAM_TOKENS)
    assert len(choices) == 4
    for ch in choices:
        assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == STREAM_TOKENS
        spans = ch["version_spans"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == STREAM_TOKENS
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans))
    seen = {v.policy_version for s in finals for v in s.version_spans}
    assert len(seen) >= 2, seen  # the pushes really landed mid-stream
    assert httpx.get(f"{server.http_url}/health").status_code == 200
