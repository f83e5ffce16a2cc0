"""Decoder for the Llama family and its relatives (Qwen2: q/k/v bias; Qwen3: q/k RMSNorm), with GQA.

Every forward is an "extend": each of B rows appends Q new tokens (prefill: the prompt; decode: 1;
speculative verify: k + 1) to a sequence whose K/V already sit in the static cache. Attention reads the
cache rows [slot_lo, slot_lo + B) as a view, masked per row by position. Rows of different lengths can be
packed (`AttnMeta.packed`): the linear layers, norms and MLP, nearly all of a step's arithmetic, run on the N
real tokens [N, hidden] only, and attention alone sees the padded [B, Q] grid; the forward returns the N rows, so
the LM head runs on them alone too. On a CPU, where a padded position costs as much as a real one, that is what a
prefill of prompts of different lengths, a draft model's catch-up or a verify of drafts of different lengths
would otherwise waste.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from service.config import ModelConfig
from service.models.attention import cached_attention
from service.models.packed import Linear
from service.models.rope import apply_rope


@dataclass(slots=True)
class AttnMeta:
    """Everything attention needs for one forward; built once per step by the runner, shared by layers."""

    slot_lo: int  # rows are cache slots [slot_lo, slot_lo + B)
    kv_len: int  # attend over cache positions [0, kv_len)
    write_slots: torch.Tensor | None  # [B * Q] cache slot of each new token; None = no cache (training)
    write_pos: torch.Tensor | None  # [B * Q] cache position of each new token (scratch for padding)
    # [B, Hkv, G * Q, kv_len] additive mask: 0 = attend, -inf = not (attention.mask_dtype); None where the kernel
    # takes `positions` instead (cpp), and in training
    bias: torch.Tensor | None
    cos: torch.Tensor  # [B, Q, 1, D], or [N, 1, D] when packed
    sin: torch.Tensor  # [B, Q, 1, D], or [N, 1, D] when packed
    kernel: str = "sdpa"  # attention over the cache (service/models/attention.py)
    # [N] indices into the B * Q grid of the tokens computed (rows of different lengths): only those go through
    # the linear layers, and write_slots / write_pos name only them. None: every token of the grid.
    packed: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # [B, Q] cache position of each query on the grid (padding: scratch)


def causal_meta(cos_table: torch.Tensor, sin_table: torch.Tensor, batch: int, seq_len: int) -> AttnMeta:
    """Metadata for a cache-free causal forward over [batch, seq_len] tokens at positions 0.. (training).
    Tables are a Rope's cos / sin ([positions, D])."""
    cos, sin = cos_table[:seq_len][None, :, None], sin_table[:seq_len][None, :, None]  # [1, Q, 1, D]
    return AttnMeta(0, seq_len, None, None, None, cos.expand(batch, -1, -1, -1), sin.expand(batch, -1, -1, -1))


def write_cache(cache: torch.Tensor, layer: int, meta: AttnMeta, x: torch.Tensor) -> None:
    """cache [layers, slots, Hkv, P, D][layer, write_slots, :, write_pos] = x [N, Hkv, D], in place. Traced by
    torch.compile, the write indexes the whole cache (a write through a view of it would copy all of it)."""
    if torch.compiler.is_compiling():
        cache[torch.full_like(meta.write_slots, layer), meta.write_slots, :, meta.write_pos] = x
    else:
        cache[layer][meta.write_slots, :, meta.write_pos] = x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; it reduces in float32 for half-precision inputs.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, meta: AttnMeta, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        G = H // Hkv
        qkv = self.qkv_proj(x).view(*x.shape[:-1], H + 2 * Hkv, D)  # [B, Q, H + 2 Hkv, D] or packed [N, ...]
        if self.q_norm is None:
            qk = apply_rope(qkv[..., : H + Hkv, :], meta.cos, meta.sin)  # q and k heads rotated together
            q, k = qk.split((H, Hkv), dim=-2)
        else:
            q = apply_rope(self.q_norm(qkv[..., :H, :]), meta.cos, meta.sin)
            k = apply_rope(self.k_norm(qkv[..., H : H + Hkv, :]), meta.cos, meta.sin)
        v = qkv[..., H + Hkv :, :]
        if meta.write_slots is None:  # training: causal attention over these tokens only, no cache
            B, Q, _ = x.shape
            k, v = (t.repeat_interleave(G, dim=2).transpose(1, 2) for t in (k, v))  # [B, H, Q, D]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)  # [B, H, Q, D]
            return self.o_proj(out.transpose(1, 2).reshape(B, Q, H * D))
        # Write the new K/V at their positions: cache [layers, slots, Hkv, P, D] at (layer, slot[n], :, pos[n]).
        write_cache(k_cache, self.layer_idx, meta, k.reshape(-1, Hkv, D))
        write_cache(v_cache, self.layer_idx, meta, v.reshape(-1, Hkv, D))
        B, Q = meta.positions.shape
        if meta.packed is not None:  # queries back on the [B, Q] grid (padding: zeros, whose output is dropped)
            q = q.new_zeros(B * Q, H, D).index_copy_(0, meta.packed, q)
        keys = k_cache[self.layer_idx, meta.slot_lo : meta.slot_lo + B, :, : meta.kv_len]  # [B, Hkv, L, D] view
        values = v_cache[self.layer_idx, meta.slot_lo : meta.slot_lo + B, :, : meta.kv_len]
        # Group the G query heads of each KV head along the query axis: [B, Hkv, G * Q, D].
        q = q.view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D)
        out = cached_attention(q, keys, values, meta.bias, meta.kernel, meta.positions)  # [B, Hkv, G * Q, D]
        out = out.view(B, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, H * D)
        if meta.packed is not None:
            out = out.view(B * Q, H * D).index_select(0, meta.packed)  # [N, H * D]
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, meta: AttnMeta, k_cache: torch.Tensor, v_cache: torch.Tensor):
        x = x + self.self_attn(self.input_layernorm(x), meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Token ids -> final hidden states; `logits()` applies the LM head to the rows that need it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, meta: AttnMeta, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None
    ) -> torch.Tensor:
        """input_ids [B, Q]; k_cache/v_cache [layers, slots, Hkv, P, D] (None with a causal_meta) -> [B, Q, hidden],
        or with `meta.packed` the N real tokens' [N, hidden], in `meta.packed`'s order (the LM head then runs on
        them alone)."""
        ids = input_ids if meta.packed is None else input_ids.reshape(-1).index_select(0, meta.packed)  # [N]
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, meta, k_cache, v_cache)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> float32 logits [..., vocab]."""
        return self.lm_head(hidden).float()
