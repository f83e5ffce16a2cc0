"""Chunks that queued up while a slow consumer was busy are merged per sample, without reordering a sample."""

from __future__ import annotations

from service.backend.events import Chunk, Failed, SampleDone, coalesce


def chunk(index: int, tokens: list[int], policy: str = "0") -> Chunk:
    return Chunk(index, tokens, [-0.5 * t for t in tokens], None, None, policy, "none")


def done(index: int) -> SampleDone:
    return SampleDone(index, f"r{index}", "stop", 3, 4, [], 2, "plain", [], [])


def test_consecutive_chunks_of_a_sample_merge() -> None:
    out = coalesce([chunk(0, [1]), chunk(1, [7]), chunk(0, [2, 3]), chunk(1, [8]), done(1), chunk(0, [4])])
    assert [(type(e).__name__, e.index) for e in out] == [("Chunk", 0), ("Chunk", 1), ("SampleDone", 1)]
    assert out[0].token_ids == [1, 2, 3, 4] and out[0].logprobs == [-0.5, -1.0, -1.5, -2.0]
    assert out[1].token_ids == [7, 8]


def test_a_weight_push_or_a_finish_keeps_chunks_apart() -> None:
    out = coalesce([chunk(0, [1]), chunk(0, [2], policy="1"), chunk(0, [3], policy="1"), done(0)])
    assert [(e.token_ids, e.policy_version) for e in out[:2]] == [([1], "0"), ([2, 3], "1")]
    assert isinstance(out[2], SampleDone)
    failed = coalesce([chunk(0, [1]), Failed("boom"), chunk(0, [2])])
    assert [type(e).__name__ for e in failed] == ["Chunk", "Failed", "Chunk"]


def test_stream_interval_holds_chunks_until_enough_tokens_or_the_end() -> None:
    import asyncio

    from service.backend.events import RequestHandle

    async def consume() -> list[tuple[str, int, int]]:
        handle = RequestHandle("r", n=2, aloop=asyncio.get_running_loop())
        got: list[tuple[str, int, int]] = []

        async def reader() -> None:
            async for ev in handle.events(stream_interval=4):
                got.append((type(ev).__name__, ev.index, len(getattr(ev, "token_ids", []))))

        task = asyncio.create_task(reader())
        for step in range(5):  # one token per sample per step, as the engine would deliver them
            handle.put_many([chunk(0, [step]), chunk(1, [step])])
            await asyncio.sleep(0)  # let the reader run: nothing queues up, holding back is the interval's doing
        handle.put_many([done(0), chunk(1, [9]), done(1)])
        await asyncio.wait_for(task, 5)
        return got

    got = asyncio.run(consume())
    assert got[:2] == [("Chunk", 0, 4), ("Chunk", 1, 4)]  # four steps' tokens in one message per sample
    # the rest goes out with the finishes: each sample's last tokens, then its SampleDone
    assert [e for e in got[2:] if e[1] == 0] == [("Chunk", 0, 1), ("SampleDone", 0, 0)]
    assert [e for e in got[2:] if e[1] == 1] == [("Chunk", 1, 2), ("SampleDone", 1, 0)]
