"""Drafter weight pushes: a served draft model is replaced between steps while requests stream."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers import make_checkpoint
from service_utils import ADMIN, checkpoint_tensors, perturbed, start_server

from client import AsyncSpecrollClient, FailedPrecondition, InvalidArgument, Sample, SpecrollClient


@pytest.fixture(scope="module")
def draft_dir():
    return make_checkpoint("qwen2", tied=True, num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           seed=11)


def test_drafter_push_swaps_between_steps(model_dir, draft_dir):
    srv = start_server(model_dir, engine_kw={"drafter": str(draft_dir), "spec": "fixed", "spec_k": 3})
    draft = checkpoint_tensors(draft_dir)
    try:
        async def run() -> tuple[list[Sample], object]:
            async with AsyncSpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
                started = asyncio.Event()

                async def consume(i: int) -> Sample:
                    async for ev in c.stream([3, 4, 5 + i], max_tokens=120, temperature=1.0, seed=i,
                                             ignore_eos=True):
                        started.set()
                        if isinstance(ev, Sample):
                            return ev
                    raise AssertionError("no final")

                tasks = [asyncio.create_task(consume(i)) for i in range(4)]
                await started.wait()
                result = await c.push_weights(perturbed(draft, seed=2), "d1", role="drafter")
                return list(await asyncio.gather(*tasks)), result

        finals, result = asyncio.run(run())
        assert result.role == "drafter" and result.version == "d1"
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            info = c.server_info()
            assert "d1" in info.drafter_version and info.policy_version == "0"
            assert all(s.finish_reason == "length" and s.num_output_tokens == 120 for s in finals)
            assert any(len({v.drafter_version for v in s.version_spans}) == 2 for s in finals)
            with pytest.raises(InvalidArgument, match="drafter push"):
                c.push_weights({k: v for k, v in list(draft.items())[1:]}, "d2", role="drafter")
            assert "d1" in c.server_info().drafter_version
            res = c.load_weights(str(draft_dir), "d3", role="drafter")
            assert res.version == "d3" and "d3" in c.server_info().drafter_version
            assert c.server_info().drafter == str(draft_dir)  # the admin (a co-located sidecar) sees the path
        with SpecrollClient(srv.grpc_target) as c:  # anyone else, the folder's name only
            assert c.server_info().drafter == draft_dir.name
        assert httpx.get(srv.http_url + "/server_info").json()["drafter"] == draft_dir.name
    finally:
        srv.stop()


def test_drafter_push_without_draft_model_is_refused(model_dir):
    srv = start_server(model_dir, engine_kw={"drafter": "suffix"})
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c, \
                pytest.raises(FailedPrecondition, match="no draft model"):
            c.push_weights(checkpoint_tensors(model_dir), "d1", role="drafter")
    finally:
        srv.stop()


def test_drafter_paired_with_the_next_target_push_publishes_atomically(model_dir, draft_dir):
    """mode with_target parks a drafter; the next target push serves both from the same step on."""
    srv = start_server(model_dir, engine_kw={"drafter": str(draft_dir), "spec": "fixed", "spec_k": 3})
    target, draft = checkpoint_tensors(model_dir), checkpoint_tensors(draft_dir)
    try:
        with SpecrollClient(srv.grpc_target, admin_token=ADMIN) as c:
            before = c.server_info().drafter_version
            with pytest.raises(InvalidArgument, match="mode"):
                c.push_weights(target, "t0", mode="with_target")
            c.push_weights(perturbed(draft, seed=3), "old-pair", role="drafter", mode="with_target")
            c.push_weights(perturbed(draft, seed=4), "p1", role="drafter", mode="with_target")
            info = c.server_info()
            assert info.drafter_version == before and info.policy_version == "0"  # parked, not serving
            assert c.generate_one([3, 4], max_tokens=4, temperature=0.0).samples[0].version_spans[-1].policy_version \
                == "0"
            c.push_weights(perturbed(target, seed=5), "p1")
            info = c.server_info()
            assert info.policy_version == "p1" and "@p1" in info.drafter_version  # the newer parked one
            spans = c.generate_one([3, 4], max_tokens=6, temperature=0.0).samples[0].version_spans
            assert [(v.policy_version, "@p1" in v.drafter_version) for v in spans] == [("p1", True)]
            c.push_weights(target, "t2")  # nothing parked: the drafter stays
            info = c.server_info()
            assert info.policy_version == "t2" and "@p1" in info.drafter_version
    finally:
        srv.stop()
