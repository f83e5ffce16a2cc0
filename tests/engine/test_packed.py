"""Linear weights laid out for the CPU (service/models/packed.py) change speed, not results. bf16: packed
layers equal plain ones bit for bit, autograd never sees them, a swapped model is packed anew, and an engine
serving packed weights returns exactly the tokens and logprobs of one that does not (greedy and sampled, with
SD). float32: weights stored transposed or as pushed give the same products within float32 rounding; every float32
exactness test of the engine runs on that layout."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from service.config import EngineConfig
from service.engine.cached_model import CachedModel
from service.engine.kv_cache import KVCache
from service.engine.llm_engine import LLMEngine
from service.models import attention, packed
from service.models.loader import load_model
from service.models.packed import ROW_CLASSES, Linear, pack_linears
from service.params import SamplingParams

needs_bf16 = pytest.mark.skipif(not (packed.onednn_available() and packed.native_bf16()),
                                reason="needs oneDNN with native bf16 (AVX512-BF16 or AMX); nothing is packed here")
CPU = torch.device("cpu")


needs_onednn = pytest.mark.skipif(not packed.onednn_available(), reason="needs oneDNN; nothing is packed here")


def packed_wins(*classes: int):
    """A scripted timer for `pack_linears`: the packed kernel is faster in these row classes only."""
    calls = iter(range(10**6))

    def timer(fn) -> float:
        n = next(calls)  # calibrate times plain, then packed, per class in order
        return 0.5 if fn.__name__ == "packed" and n // 2 in classes else 1.0

    return timer


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(packed, "_chosen", {})  # scripted choices must not reach other tests' models


@needs_bf16
def test_packed_layer_equals_the_plain_one():
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True).to(torch.bfloat16)
    assert pack_linears(layer, packed_wins(0, 1, 2)) == 1 and layer.packed is not None
    for rows in (1, 5, 64, ROW_CLASSES[-1] + 1):  # the last one takes the plain path
        x = torch.randn(rows, 3, 96).to(torch.bfloat16)
        with torch.inference_mode():
            got = layer(x)
        assert torch.equal(got, F.linear(x, layer.weight, layer.bias))
    layer.requires_grad_(True)
    x = torch.randn(4, 96, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()  # gradients enabled: the plain path, differentiable
    assert x.grad is not None and layer.weight.grad is not None


@needs_onednn
def test_each_row_class_runs_the_kernel_calibration_chose():
    torch.manual_seed(0)
    layer = Linear(64, 128)
    pack_linears(layer, packed_wins(1, 3))
    assert layer.packed_for == (False, True, False, True)
    with torch.no_grad():  # a packed copy of twice the weight shows which kernel ran
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(2 * layer.weight.detach().contiguous(), 1)
    with torch.inference_mode():
        for rows in (1, 2, ROW_CLASSES[1], ROW_CLASSES[1] + 1, ROW_CLASSES[2], ROW_CLASSES[2] + 1, 700):
            x = torch.randn(rows, 64)
            plain = F.linear(x, layer.weight, layer.bias)
            scale = 2.0 if packed.row_class(rows) in (1, 3) else 1.0
            torch.testing.assert_close(layer(x), scale * plain - (scale - 1) * layer.bias, rtol=1e-4, atol=1e-5)
    packed._chosen.clear()  # a choice is kept per layout for the process: forget it to script another
    assert pack_linears(Linear(64, 128), packed_wins()) == 0  # packed never faster: no copy kept


@needs_onednn
def test_the_choice_is_made_once_per_layout():
    calls = []

    def timer(fn) -> float:
        calls.append(fn.__name__)
        return 1.0

    pack_linears(Linear(32, 48), timer)
    assert len(calls) == 2 * len(packed.CLASS_ROWS)
    pack_linears(Linear(32, 48), timer)  # same layout: no new timing
    assert len(calls) == 2 * len(packed.CLASS_ROWS)
    pack_linears(Linear(32, 40), timer)
    assert len(calls) == 4 * len(packed.CLASS_ROWS)


def _ran_opaque_op(fn, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(x)
    return out, any(e.name == "specroll::linear" for e in prof.events())


@needs_onednn
@pytest.mark.parametrize("packed_classes", [(3,), (1,), (0, 2)])
def test_compiled_one_row_forwards_call_the_plain_kernel_directly(packed_classes):
    """Compiled, one sequence's decode or verify (batch 1, up to `ROW_CLASSES[1]` positions) traces `F.linear`
    where its row class runs it, not the opaque op (~10 us of Python dispatch a call: a third of a one-row decode
    forward of the demo model); every other forward, and one row in a class that runs the packed copy, goes
    through the op, which picks the kernel when it runs. A packed copy of twice the weight shows which kernel
    ran."""
    torch.manual_seed(0)
    layer = Linear(64, 128)
    pack_linears(layer, packed_wins(*packed_classes))
    with torch.no_grad():
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(2 * layer.weight.detach().contiguous(), 1)
    fn = torch.compile(lambda x: layer(x), dynamic=True, fullgraph=True)
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=64):
        for shape in ((1, 1), (1, 5), (1, ROW_CLASSES[1]), (1, 1), (4, 1), (3, 7), (1, 300), (2, 200)):
            x = torch.randn(*shape, 64)
            rows = shape[0] * shape[1]
            cls = packed.row_class(rows)
            got, opaque = _ran_opaque_op(fn, x)
            scale = 2.0 if cls in packed_classes else 1.0
            plain = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(got, scale * plain - (scale - 1) * layer.bias, rtol=1e-4, atol=1e-5)
            direct = shape[0] == 1 and rows <= ROW_CLASSES[1] and cls not in packed_classes
            assert opaque != direct, (shape, packed_classes)


def test_float32_weights_are_stored_for_their_kernels_and_give_the_same_products():
    """Transposed where F.linear serves small products (its kernels' fast layout), as pushed where the packed copy
    serves every class but the largest; the layout follows the choice each time it is made again."""
    torch.manual_seed(0)
    layer = Linear(64, 128)
    xs = [torch.randn(rows, 64) for rows in (1, 2, 5, 48, 49, 300)]
    want = [layer(x).detach() for x in xs]

    def same_products() -> None:
        with torch.inference_mode():
            for x, w in zip(xs, want, strict=True):
                torch.testing.assert_close(layer(x), w, rtol=1e-5, atol=1e-6)

    pack_linears(layer)  # the real calibration, whatever it chooses on this machine
    chosen = layer.packed_for if layer.packed is not None else None
    assert layer.weight.shape == (128, 64)
    assert layer.weight.t().is_contiguous() == packed.stored_transposed(chosen)
    same_products()
    for wins, transposed in (((0, 1, 2), False), ((3,), True), ((0, 1, 2, 3), False)):
        packed._chosen.clear()
        pack_linears(layer, packed_wins(*wins))  # the layout follows the new choice, the pack is rebuilt
        transposed = transposed or not packed.onednn_available()  # nothing packed: F.linear serves every class
        assert layer.weight.t().is_contiguous() == transposed and layer.weight.is_contiguous() != transposed, wins
        assert (layer.packed is not None) == packed.onednn_available()
        same_products()


@needs_bf16
def test_a_stale_pack_is_dropped():
    layer = Linear(64, 128).to(torch.bfloat16)
    assert pack_linears(layer, packed_wins(0)) == 1 and layer.packed is not None
    assert pack_linears(layer.half()) == 0 and layer.packed is None  # float16: no packing, old pack gone


@needs_bf16
def test_a_swapped_model_is_packed_with_its_own_weights(tiny_qwen2, monkeypatch):
    monkeypatch.setattr(packed, "median_seconds", packed_wins(0, 1, 2, 3))
    a = load_model(tiny_qwen2, torch.bfloat16, CPU)
    b = load_model(tiny_qwen2, torch.bfloat16, CPU)
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(1.5)
    cached = CachedModel(a, KVCache(a.config, 2, 16, torch.bfloat16, CPU), CPU)
    assert a.layers[0].mlp.down_proj.packed is not None
    cached.model = b
    layer = b.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_a_packed_layer_can_be_copied_and_the_copy_is_packed_anew():
    """Weight pushes of a head and the drafter trainer deep-copy served modules: the opaque packed copy has no
    storage, so copies leave it behind and stay plain until installed."""
    torch.manual_seed(0)
    layer = Linear(64, 128)
    pack_linears(layer, packed_wins(0, 1, 2, 3))
    twin = copy.deepcopy(layer)
    assert twin.packed is None and torch.equal(twin.weight, layer.weight)
    assert twin.weight.data_ptr() != layer.weight.data_ptr()
    assert layer.packed is not None or not packed.onednn_available()  # the original keeps its pack
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(twin(x), layer(x), rtol=1e-5, atol=1e-6)
        assert pack_linears(twin, packed_wins(1)) == int(packed.onednn_available())
        torch.testing.assert_close(twin(x), layer(x), rtol=1e-5, atol=1e-6)


PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [300], list(range(40, 70))]


def _serve(model, monkeypatch, pack: bool):
    with monkeypatch.context() as mp:
        # Library attention kernels, the same for both engines. With the opaque `cpp` kernel for batched
        # verify steps the two engines' logprobs differed by ~1e-5 (tokens equal) wherever this machine's timing
        # chose it: the linears feeding it are traced in one engine's compiled graph and opaque ops in the other's,
        # so inductor rounds around them differently (not pinned down further).
        mp.setattr(attention, "choose", lambda *args, **kwargs: ("bmm", "sdpa") * 4)
        if pack:
            mp.setattr(packed, "median_seconds", packed_wins(0, 1, 2, 3))  # every row class packed
        else:
            mp.setattr(packed, "native_bf16", lambda: False)
        engine = LLMEngine(EngineConfig(model=str(model), dtype="bfloat16", max_model_len=128, drafter="suffix",
                                        spec="fixed", spec_k=3))
        assert (engine.runner.model.layers[0].self_attn.qkv_proj.packed is not None) == pack
        greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        sampled = engine.generate(PROMPTS, SamplingParams(max_tokens=24, seed=3, ignore_eos=True, temperature=0.8,
                                                          top_p=0.9, raw_logprobs=True))
        assert engine.stats.spec_drafts > 0
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].raw_logprobs) for o in greedy + sampled]


@needs_bf16
def test_engine_serves_the_same_tokens_and_logprobs_packed(tiny_qwen2, monkeypatch):
    assert _serve(tiny_qwen2, monkeypatch, pack=True) == _serve(tiny_qwen2, monkeypatch, pack=False)
