"""Requests that want whole samples (gRPC `final_only`, the client's generate, HTTP without `stream`): the engine
sends no chunks for them, and each sample arrives whole when it ends, split by the weight versions that made it."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import torch
from service_utils import ADMIN, checkpoint_tensors, perturbed

from client import AsyncSpecrollClient, SpecrollClient
from client.protogen import pb2, pb2_grpc
from service.app import BackgroundServer
from service.backend.events import Chunk, GenRequest, RequestHandle, SampleDone, whole_chunks
from service.params import SamplingParams, VersionSpan

PROMPT = [5, 17, 42, 99, 7]
METADATA = (("authorization", f"Bearer {ADMIN}"),)


def test_whole_chunks_split_a_sample_by_its_version_spans() -> None:
    spans = [VersionSpan("a", "d0", 0, 2), VersionSpan("b", "d0", 2, 5)]
    tops = [{i: -0.1 * i} for i in range(5)]
    done = SampleDone(1, "r:1", "length", 3, 5, spans, 4, "plain", [10, 11, 12, 13, 14], [-1.0, -2.0, -3.0, -4.0, -5.0],
                      raw_logprobs=[-1.5, -2.5, -3.5, -4.5, -5.5], top_logprobs=tops)
    a, b = whole_chunks(done)
    assert (a.index, a.token_ids, a.logprobs, a.raw_logprobs, a.top_logprobs, a.policy_version) == (
        1, [10, 11], [-1.0, -2.0], [-1.5, -2.5], tops[:2], "a")
    assert (b.token_ids, b.logprobs, b.raw_logprobs, b.top_logprobs, b.policy_version, b.drafter_version) == (
        [12, 13, 14], [-3.0, -4.0, -5.0], [-3.5, -4.5, -5.5], tops[2:], "b", "d0")
    empty = SampleDone(0, "r:0", "abort", 3, 0, [], 0, "plain", [], [])
    assert whole_chunks(empty) == []


def _events(srv: BackgroundServer, stream: bool, rid: str) -> list[Any]:
    """Every event the engine hands a request's consumer, read straight off the backend."""
    params = SamplingParams(n=2, max_tokens=24, temperature=0.0, ignore_eos=True, raw_logprobs=True)

    async def run() -> list[Any]:
        handle = RequestHandle(rid, params.n, asyncio.get_running_loop())
        srv.server.backend.submit_all([(GenRequest(PROMPT, params, rid, stream=stream), handle)])
        return [ev async for ev in handle.events()]

    return asyncio.run(run())


def test_the_engine_sends_no_chunks_for_a_request_that_wants_whole_samples(server) -> None:
    streamed = _events(server, True, "streamed")
    whole = _events(server, False, "whole")
    assert any(isinstance(ev, Chunk) for ev in streamed)
    assert all(isinstance(ev, SampleDone) for ev in whole) and len(whole) == 2
    by_index = {ev.index: ev for ev in streamed if isinstance(ev, SampleDone)}
    for ev in whole:
        chunks = [c for c in streamed if isinstance(c, Chunk) and c.index == ev.index]
        assert [t for c in chunks for t in c.token_ids] == by_index[ev.index].token_ids == ev.token_ids
        assert len(ev.token_ids) == 24 and len(ev.raw_logprobs) == 24
        torch.testing.assert_close(ev.logprobs, by_index[ev.index].logprobs, atol=1e-5, rtol=0)
        assert ev.num_steps == by_index[ev.index].num_steps  # steps are still counted without chunks


def _generate(target: str, request: Any) -> list[Any]:
    """The raw messages of one Generate call."""
    with grpc.insecure_channel(target) as channel:
        stub = pb2_grpc.RolloutStub(channel)
        return list(stub.Generate(request, metadata=METADATA, timeout=120))


def _request(final_only: bool, **params: Any) -> Any:
    sp = pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, raw_logprobs=True, top_logprobs=2,
                            **params)
    return pb2.GenerateRequest(prompt_token_ids=PROMPT, params=sp, n=2, final_only=final_only)


def test_grpc_final_only_sends_each_sample_whole_right_before_its_final(server) -> None:
    msgs = _generate(server.grpc_target, _request(True))
    kinds = [(m.WhichOneof("kind"), m.chunk.index if m.HasField("chunk") else m.final.index) for m in msgs]
    # one chunk per sample (one weight version), each followed at once by that sample's final
    assert len(kinds) == 4 and all(a == ("chunk", b[1]) and b[0] == "final"
                                   for a, b in zip(kinds[::2], kinds[1::2], strict=True)), kinds
    assert sorted(i for _, i in kinds[::2]) == [0, 1]
    streamed = _generate(server.grpc_target, _request(False))
    for i in (0, 1):
        mine = [m.chunk for m in msgs if m.HasField("chunk") and m.chunk.index == i]
        theirs = [m.chunk for m in streamed if m.HasField("chunk") and m.chunk.index == i]
        [c] = mine
        assert list(c.token_ids) == [t for x in theirs for t in x.token_ids] and len(c.token_ids) == 24
        torch.testing.assert_close(list(c.raw_logprobs), [x for t in theirs for x in t.raw_logprobs], atol=1e-5,
                                   rtol=0)
        assert [list(t.token_ids) for t in c.top_logprobs] == [list(t.token_ids) for x in theirs
                                                                for t in x.top_logprobs]
        assert c.policy_version == theirs[0].policy_version
    # the client's generate asks for whole samples, and its samples are the streamed ones
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as client:
        [comp] = client.generate([PROMPT], n=2, max_tokens=24, temperature=0.0, ignore_eos=True)
        events = list(client.stream(PROMPT, n=2, max_tokens=24, temperature=0.0, ignore_eos=True, final_only=True))
    assert [s.token_ids for s in comp.samples] == [[t for m in streamed if m.HasField("chunk") and m.chunk.index == i
                                                    for t in m.chunk.token_ids] for i in (0, 1)]
    assert len(events) == 2 and all(hasattr(ev, "rollout_id") for ev in events)  # Samples only, no chunks


def test_a_push_mid_sample_splits_its_whole_chunks_by_version(server, model_dir) -> None:
    base = checkpoint_tensors(model_dir)

    async def scenario() -> tuple[list[Any], Any]:
        async with AsyncSpecrollClient(server.grpc_target, admin_token=ADMIN, timeout_s=120) as c:
            await c.push_weights(base, "whole-old", mode="keep")
            channel = grpc.aio.insecure_channel(server.grpc_target)
            stub = pb2_grpc.RolloutStub(channel)
            sp = pb2.SamplingParams(max_tokens=160, temperature=1.0, seed=3, ignore_eos=True, raw_logprobs=True)
            call = stub.Generate(pb2.GenerateRequest(prompt_token_ids=PROMPT, params=sp, final_only=True),
                                 metadata=METADATA)
            whole = asyncio.ensure_future(_collect(call))
            async for _ in c.stream([3, 4, 5], max_tokens=160, ignore_eos=True, temperature=1.0, seed=4):
                break  # a streamed request started: the whole one, submitted first, is running as well
            result = await c.push_weights(perturbed(base, seed=31), "whole-new", mode="keep")
            msgs = await whole
            await channel.close()
            return msgs, result

    msgs, result = asyncio.run(scenario())
    assert result.version == "whole-new"
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    [final] = [m.final for m in msgs if m.HasField("final")]
    assert msgs[-1].HasField("final") and final.finish_reason == "length" and final.num_output_tokens == 160
    spans = [(s.policy_version, s.start, s.end) for s in final.version_spans]
    assert [s[0] for s in spans] == ["whole-old", "whole-new"], spans  # the push landed mid-sample
    assert [(c.policy_version, len(c.token_ids), len(c.raw_logprobs)) for c in chunks] == [
        (v, b - a, b - a) for v, a, b in spans]


async def _collect(call: Any) -> list[Any]:
    return [m async for m in call]
