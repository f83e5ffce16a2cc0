"""Linear layers laid out while a push lands (service/models/packed.py `LayoutPipeline`): each layer is laid out
for the pushed bytes, never the spare's old ones, a fused weight only once all of its checkpoint tensors have
landed, and the result is the layout `pack_linears` gives the same weights (same packs, same products), whether a
float32 layer is packed from a row-major copy of its tensors or from its transposed layout. A push
that fails stops the worker before the spare is kept. A float32 weight packed from its transposed layout gives
the pack of its row-major copy. Layers off the CPU (a GPU's) keep their storage."""

from __future__ import annotations

import copy

import pytest
import torch

from service.models import packed
from service.models.loader import hf_state_dict, linear_parts, load_model, load_tensors
from service.models.packed import LayoutPipeline, Linear, forget_layout, pack_linears, prepared

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not packed.onednn_available(), reason="needs oneDNN; nothing is packed here")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not packed.native_bf16(), reason="bf16 is packed only on CPUs with native bf16"))]


def _every_class_packed(fn) -> float:
    return 0.5 if fn.__name__ == "packed" else 1.0


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(packed, "_chosen", {})  # scripted choices must not reach other tests' models


def _served_and_spare(path, dtype):
    served = load_model(path, dtype, CPU)
    pack_linears(served, _every_class_packed)  # the layout's choice is known, as for any served model
    spare = copy.deepcopy(served)
    pack_linears(spare)  # a spare laid out for its old weights: the push must not keep those packs
    return served, spare


def _pushed(served) -> dict[str, torch.Tensor]:
    dtype = next(served.parameters()).dtype
    return {n: (t * -1.25 + 0.01).to(dtype).contiguous() for n, t in hf_state_dict(served).items()}


def _layers(model) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def _same_products(got, want) -> None:
    with torch.inference_mode():
        for a, b in zip(_layers(got), _layers(want), strict=True):
            assert a.packed_for == b.packed_for and (a.packed is None) == (b.packed is None)
            assert a.weight.stride() == b.weight.stride()
            for rows in (1, 7):
                x = torch.randn(rows, a.in_features).to(a.weight.dtype)
                assert torch.equal(a(x), b(x))


@needs_onednn
@pytest.mark.parametrize("rows_bytes", [packed.ROWS_BYTES, 0], ids=["row-major-copies", "from-the-layout"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("workers", [1, 3])  # 3: an in-place push lays out on the cores generation left idle
def test_layers_laid_out_during_a_push_are_laid_out_for_the_pushed_bytes(tiny_qwen2, dtype, rows_bytes, workers,
                                                                         monkeypatch):
    monkeypatch.setattr(packed, "ROWS_BYTES", rows_bytes)  # float32: packed from row-major copies, or without
    served, spare = _served_and_spare(tiny_qwen2, dtype)
    weights = _pushed(served)
    forget_layout(spare)  # what staging does before the transport writes into the spare
    layouts = LayoutPipeline(spare, linear_parts(spare), workers)
    load_tensors(spare, weights.items(), layouts.landed)
    layouts.finish()
    assert prepared(spare) and not packed.ensure_packed(spare)  # nothing left for the end of staging
    assert all(m.packed is not None for m in _layers(spare))
    want = load_model(tiny_qwen2, dtype, CPU)
    load_tensors(want, weights.items())
    pack_linears(want)
    _same_products(spare, want)


@needs_onednn
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fused_weight_waits_for_all_of_its_tensors(tiny_qwen2, dtype):
    served, spare = _served_and_spare(tiny_qwen2, dtype)
    weights = _pushed(served)
    forget_layout(spare)
    layouts = LayoutPipeline(spare, linear_parts(spare))
    held = {n: t for n, t in weights.items() if n.endswith("self_attn.v_proj.weight") or n.endswith("up_proj.weight")}
    load_tensors(spare, ((n, t) for n, t in weights.items() if n not in held), layouts.landed)
    layouts.finish()
    fused = [m for layer in spare.layers for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]
    assert not any(packed._laid_out(m) for m in fused)  # q and k landed, v not: not laid out yet
    assert all(packed._laid_out(layer.self_attn.o_proj) for layer in spare.layers)
    load_tensors(spare, held.items())
    assert packed.ensure_packed(spare)  # the rest is laid out at the end, for the bytes now there
    want = load_model(tiny_qwen2, dtype, CPU)
    load_tensors(want, weights.items())
    pack_linears(want)
    _same_products(spare, want)


@needs_onednn
def test_a_failed_push_stops_the_workers_before_the_spare_is_kept(tiny_qwen2):
    served, spare = _served_and_spare(tiny_qwen2, torch.float32)
    forget_layout(spare)
    layouts = LayoutPipeline(spare, linear_parts(spare), workers=2)

    def broken():
        yield from list(_pushed(served).items())[:5]
        raise ValueError("the trainer went away")

    with pytest.raises(ValueError):
        load_tensors(spare, broken(), layouts.landed)
    layouts.cancel()
    assert not any(worker.is_alive() for worker in layouts._workers)
    assert not prepared(spare)  # the next push lays it out again


@needs_onednn
def test_a_float32_weight_packed_from_its_transposed_layout_is_the_row_major_pack():
    torch.manual_seed(0)
    row_major = Linear(192, 320, bias=True)
    transposed = copy.deepcopy(row_major)
    with torch.no_grad():
        transposed.weight.data = transposed.weight.detach().t().contiguous().t()
    assert not transposed.weight.is_contiguous()
    packed._pack(row_major)
    packed._pack(transposed)
    for rows in (1, 9, 300):
        x = torch.randn(rows, 192)
        got = torch.ops.mkldnn._linear_pointwise(x, transposed.packed, transposed.bias, "none", [], "")
        want = torch.ops.mkldnn._linear_pointwise(x, row_major.packed, row_major.bias, "none", [], "")
        assert torch.equal(got, want)


def test_a_pipeline_needs_a_worker(tiny_qwen2):
    _, spare = _served_and_spare(tiny_qwen2, torch.float32)
    with pytest.raises(ValueError, match="at least 1"):
        LayoutPipeline(spare, linear_parts(spare), workers=0)


def test_weights_off_the_cpu_keep_their_storage_through_a_push(tiny_qwen2):
    """Only CPU layers are laid out: a GPU's float32 weights keep the storage its CUDA graphs read (a re-stored
    weight left a graph reading the freed one). The meta device stands in for a GPU here."""
    served = load_model(tiny_qwen2, torch.float32, CPU)
    spare = copy.deepcopy(served).to("meta")
    weights = {n: t.to("meta") for n, t in _pushed(served).items()}
    forget_layout(spare)
    layouts = LayoutPipeline(spare, linear_parts(spare))
    load_tensors(spare, weights.items(), layouts.landed)
    layouts.finish()
    assert all(m.weight.is_contiguous() and m.packed is None for m in _layers(spare))
