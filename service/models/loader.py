"""Load Hugging Face safetensors checkpoints into our decoder, with strict checking of names and shapes.

Checkpoint names stay the Hugging Face ones (also for weight pushes); q/k/v and gate/up are fused into one
parameter each here, so the mapping says which slice of which parameter a checkpoint tensor fills.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from service.config import ModelConfig
from service.models.llama import CausalLM
from service.models.packed import Linear
from service.safetensors_io import IGNORED, iter_safetensors, read_shapes, safetensors_files, shape_problems

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class WeightError(ValueError):
    """A checkpoint or pushed tensor set that does not fit the model; the message names the tensors."""


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must contain, by Hugging Face name, with its shape."""
    hd, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hd), "model.norm.weight": (hd,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hd)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, hd), p + "self_attn.k_proj.weight": (kv, hd),
            p + "self_attn.v_proj.weight": (kv, hd), p + "self_attn.o_proj.weight": (hd, q),
            p + "mlp.gate_proj.weight": (inter, hd), p + "mlp.up_proj.weight": (inter, hd),
            p + "mlp.down_proj.weight": (hd, inter),
            p + "input_layernorm.weight": (hd,), p + "post_attention_layernorm.weight": (hd,),
        })
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (cfg.head_dim,),
                           p + "self_attn.k_norm.weight": (cfg.head_dim,)})
    return shapes


def _target(model: CausalLM, name: str) -> tuple[torch.Tensor, slice | None]:
    """The parameter a checkpoint tensor fills, and the slice of its first dim (None = all of it)."""
    cfg = model.config
    m = _LAYER.match(name)
    if m is None:
        return model.get_parameter(name.removeprefix("model.")), None
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
        "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter)),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        new_module, sl = fused[module]
        return layer.get_parameter(f"{new_module}.{kind}"), sl
    return layer.get_parameter(rest), None


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (fused q/k/v and gate/up split again), as float32 CPU
    copies: what a checkpoint of its config holds, and what a weight push sends."""
    out = {}
    for name in checkpoint_shapes(model.config):
        param, rows = _target(model, name)
        out[name] = (param if rows is None else param[rows]).detach().to("cpu", torch.float32).contiguous().clone()
    return out


def check_tensors(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], *, partial: bool = False) -> None:
    """Raise WeightError naming unknown, missing or misshaped tensors."""
    # A tied checkpoint may still carry lm_head.weight: tolerated and ignored.
    tolerated = {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)} if cfg.tie_word_embeddings else {}
    problems = shape_problems(checkpoint_shapes(cfg), tolerated, shapes, partial)
    if problems:
        raise WeightError(f"checkpoint does not match {cfg.architecture}: " + "; ".join(problems))


def checkpoint_view(model: CausalLM, name: str) -> torch.Tensor | None:
    """The part of the model's storage a checkpoint tensor fills (a view to write into), None for a name a
    load skips (a rotary buffer, a tied checkpoint's lm_head)."""
    if IGNORED.search(name) or (model.config.tie_word_embeddings and name == "lm_head.weight"):
        return None
    param, sl = _target(model, name)
    return param if sl is None else param[sl]


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, faster into a transposed layout (a float32 linear weight, service/models/packed.py):
    torch copies a transposed source into contiguous rows several times faster than the other way round. A
    `src` that already is `dst` (written there by the transport) is not copied."""
    if src.data_ptr() == dst.data_ptr() and src.shape == dst.shape and src.stride() == dst.stride() \
            and src.dtype == dst.dtype and src.device == dst.device:
        return
    if dst.dim() == 2 and dst.stride(0) == 1 and dst.stride(1) != 1 and src.shape == dst.shape:
        dst.t().copy_(src.t())
    else:
        dst.copy_(src)


def linear_parts(model: CausalLM) -> dict[str, tuple[Linear, slice | None]]:
    """Checkpoint tensor name -> the `Linear` whose weight it fills and the rows it fills (None: all; q/k/v and
    gate/up: three and two names for one layer; a tied checkpoint's embedding: the lm_head's weight). Names of
    other tensors are left out."""
    by_weight = {id(m.weight): m for m in model.modules() if isinstance(m, Linear)}
    parts = {}
    for name in checkpoint_shapes(model.config):
        param, rows = _target(model, name)
        layer = by_weight.get(id(param))
        if layer is not None:
            parts[name] = layer, rows
    return parts


@torch.no_grad()
def load_tensors(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]],
                 landed: Callable[[str, torch.Tensor], None] | None = None) -> int:
    """Copy named checkpoint tensors into the model (casting dtype, moving device). Returns bytes copied.
    `landed(name, tensor)`: told after each tensor is in place (service/models/packed.py `LayoutPipeline`)."""
    tied = model.config.tie_word_embeddings
    total = 0
    for name, tensor in tensors:
        if IGNORED.search(name) or (tied and name == "lm_head.weight"):
            continue
        param, sl = _target(model, name)
        copy_into(param if sl is None else param[sl], tensor)
        total += tensor.numel() * tensor.element_size()
        if landed is not None:
            landed(name, tensor)
    return total


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build our decoder from a Hugging Face folder (config.json + safetensors, single or sharded)."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    files = safetensors_files(path)
    check_tensors(cfg, read_shapes(files))
    return build_model(cfg, iter_safetensors(files), dtype, device)


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """A model of `cfg` whose storage is allocated and not filled."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def build_model(
    cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> CausalLM:
    """A model with uninitialised storage filled from `tensors` (already checked to be complete)."""
    model = empty_model(cfg, dtype, device)
    load_tensors(model, tensors)
    return model.eval().requires_grad_(False)
