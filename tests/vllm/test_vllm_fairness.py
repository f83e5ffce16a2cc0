"""The share rule on the vLLM backend: one request never has every slot's worth of samples in vLLM, so a
1-token request sent while a full-slot request decodes ends before it, and the hog's greedy samples are those it
produces alone."""

from __future__ import annotations

import asyncio

from service_utils import ADMIN
from vllm_utils import start_vllm

from client import AsyncSpecrollClient
from service.backend.admission import request_share

SLOTS = 8
LEN = 128
HOG = {"n": SLOTS, "temperature": 0.0, "max_tokens": LEN - 8, "ignore_eos": True}


def test_a_small_request_passes_a_full_slot_hog(vllm_model):
    srv = start_vllm(vllm_model, max_num_seqs=SLOTS, max_len=LEN)
    try:
        assert srv.server.backend.wait_loaded(600), "vLLM did not load"  # a loaded machine can take minutes
        async def run() -> tuple[list[list[int]], list[list[int]], list[int], bool]:
            async with AsyncSpecrollClient(srv.grpc_target, admin_token=ADMIN, retries=0) as c:
                alone = await c.generate_one([1, 2, 3], **HOG)
                hog = asyncio.ensure_future(c.generate_one([1, 2, 3], **HOG))
                while (await c.server_info()).num_running < request_share(SLOTS):
                    await asyncio.sleep(0.01)
                small = await c.generate_one([4, 5], temperature=0.0, max_tokens=1)
                hog_pending = not hog.done()  # the hog has most of its tokens still to make
                together = await hog
                return ([s.token_ids for s in alone.samples], [s.token_ids for s in together.samples],
                        small.samples[0].token_ids, hog_pending)

        alone, together, small, hog_pending = asyncio.run(run())
        assert hog_pending, "the small request waited for the hog's samples to end"
        assert len(small) == 1
        assert together == alone and all(len(t) == HOG["max_tokens"] for t in together)
    finally:
        srv.stop()
