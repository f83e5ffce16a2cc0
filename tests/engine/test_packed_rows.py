"""Packed forwards (`AttnMeta.packed`): rows of different lengths put only their real tokens through the linear
layers. They compute what the padded forward computes, write only real positions to the cache, and the engine
packs a verify pass where its rows' drafts leave most of the grid empty, with the same tokens and logprobs."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import make_checkpoint, peaked_checkpoint

import service.engine.cached_model as cached_model_module
import service.engine.speculative.passes as passes_module
from service.config import EngineConfig
from service.engine.cached_model import CachedModel
from service.engine.kv_cache import KVCache
from service.engine.llm_engine import LLMEngine
from service.engine.speculative.passes import packs, verify_tokens
from service.models.loader import load_model
from service.params import SamplingParams


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_packed_forward_computes_what_the_padded_one_does(family, device):
    """Eager on a GPU too (`--enforce-eager` packs there; CUDA graphs replay the padded pass)."""
    dev = torch.device(device)
    path = make_checkpoint(family, tied=False, seed=3)
    model = load_model(path, torch.float32, dev)
    gen = torch.Generator().manual_seed(0)
    starts, q_lens = [5, 0, 9, 2], [3, 1, 6, 2]
    B, Q = len(starts), max(q_lens)
    ids = torch.randint(1, 500, (B, Q), generator=gen).to(dev)
    history = torch.randint(1, 500, (B, max(starts)), generator=gen)
    runs = {}
    for pack in (False, True):
        cache = KVCache(model.config, B, 64, torch.float32, dev)
        cm = CachedModel(model, cache, dev)
        assert cm.pack_min_saved > 20  # a tiny model: a packed forward would save less than eager costs
        cm.pack_min_saved = 1
        with torch.inference_mode():
            cm.extend(0, [0] * B, [history[b, : starts[b]].tolist() or [1] for b in range(B)])
            meta, _ = cm.build_meta(0, starts, q_lens, pack=pack)
            assert (meta.packed is not None) == pack and meta.write_slots.numel() == (sum(q_lens) if pack else B * Q)
            runs[pack] = cm.forward(ids, meta), cache
    (dense, dense_cache), (packed, packed_cache) = runs[False], runs[True]
    assert packed.shape == (sum(q_lens), dense.shape[-1])  # the real tokens alone, row after row
    ends = list(itertools.accumulate(q_lens))
    for b, n in enumerate(q_lens):
        torch.testing.assert_close(packed[ends[b] - n : ends[b]], dense[b, :n], atol=1e-5, rtol=1e-5)
        for c in (0, 1):  # the K and V each real token wrote
            k_dense, k_packed = (x.k if c == 0 else x.v for x in (dense_cache, packed_cache))
            torch.testing.assert_close(k_packed[:, b, :, starts[b] : starts[b] + n],
                                       k_dense[:, b, :, starts[b] : starts[b] + n], atol=1e-5, rtol=1e-5)
    scratch = packed_cache.scratch_pos
    assert not packed_cache.k[:, :, :, scratch].any()  # padding wrote nothing (the padded forward writes scratch)


def test_the_packing_rule():
    assert packs(drafted=16, batch=64, k=8, min_saved=100)  # a table with 8 drafts for 2 rows of 64
    assert not packs(drafted=16, batch=64, k=8, min_saved=None)  # CUDA graphs replay the padded pass
    assert not packs(drafted=60, batch=64, k=1, min_saved=1)  # nearly every row has its draft
    assert not packs(drafted=16, batch=64, k=8, min_saved=600)  # saves too little for this model
    assert verify_tokens(16, 64, 8, 100) == 16 and verify_tokens(60, 64, 1, 1) == 64


def test_the_engine_packs_a_verify_pass_with_the_same_tokens_and_logprobs(monkeypatch):
    """A suffix table verifies at the depth of its longest match, for every row: with rows it has nothing
    for, the pass runs packed (every forward with packing recorded), the LM head runs on its real positions
    alone, and it gives what the padded pass gives."""
    target = peaked_checkpoint()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6], [100, 200, 300], [7, 7, 7, 7, 7, 7]]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=11, ignore_eos=True)
    outs, widths = {}, {}
    for pack_at in (0.0, 1.0):  # never packed, packed wherever a row has fewer drafts than the pass
        monkeypatch.setattr(passes_module, "PACK_AT", pack_at)
        monkeypatch.setattr(cached_model_module, "PACK_MIN_MACS", 1.0)  # the tiny model packs wherever it may
        engine = LLMEngine(EngineConfig(model=str(target), max_model_len=256, max_num_seqs=16, drafter="suffix",
                                        spec="fixed", spec_k=8))
        forward, seen = engine.runner.target.forward, []

        logits, heads, pending = engine.runner.model.logits, [], []

        def spy(ids, meta, forward=forward, seen=seen, pending=pending):
            seen.append(meta.packed is not None)
            pending.append(meta.packed.numel() if meta.packed is not None else None)
            return forward(ids, meta)

        def head(hidden, logits=logits, heads=heads, pending=pending):  # the LM head's rows after an eager forward
            if pending:
                heads.append((pending.pop(), hidden.shape[:-1].numel()))
            return logits(hidden)

        monkeypatch.setattr(engine.runner.target, "forward", spy)  # eager forwards (uniform ones: forward_rows)
        monkeypatch.setattr(engine.runner.model, "logits", head)
        outs[pack_at] = engine.generate(prompts, params)
        widths[pack_at] = seen
    # The prefill (prompts of different lengths) is packed either way; verify passes only when allowed.
    assert widths[0.0] == [True] and len(widths[1.0]) >= 5 and all(widths[1.0]), widths
    assert heads[0] == (sum(map(len, prompts)), len(prompts))  # the prefill: each prompt's last token
    assert len(heads) == len(widths[1.0]) and all(n == rows for n, rows in heads[1:]), heads  # verify passes
    for a, b in zip(outs[0.0], outs[1.0], strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert y.token_ids == x.token_ids
            torch.testing.assert_close(y.logprobs, x.logprobs, atol=1e-4, rtol=0)
