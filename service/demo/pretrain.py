"""Pretraining of the demo models on worked solutions: a shallow draft model first, then the target grown from
it (progressive stacking: the draft's layers plus new layers that start as the identity), then an EAGLE-style
head on the trained target's features. Cache-free causal forwards of our own decoder (`causal_meta`), AdamW,
warmup + cosine learning rate. No transformers.

Why grow: on a CPU budget a 2-layer decoder learns this task (copies and local arithmetic) several times
faster than a 4-layer one from scratch (1,000 steps: loss 0.20 vs 0.38); grown from it and trained 600 more
steps, the 4-layer target solves 6-number problems 88% of the time greedily, against 19% for the 2-layer
model alone. The draft model is then also close to the target, as a drafter should be."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from service.config import ModelConfig
from service.demo.data import Batch, batches
from service.demo.export import init_weights
from service.demo.task import Difficulty
from service.engine.drafters.eagle import EagleHead, init_head
from service.models.llama import CausalLM, causal_meta
from service.models.rope import Rope
from service.tokenizer import Tokenizer

Progress = Callable[[int, dict[str, float]], None]  # (steps done since the last call, stats)


@dataclass(frozen=True, slots=True)
class TrainPlan:
    draft_steps: int  # the shallow draft model first ...
    steps: int  # ... then the target, grown from it
    token_budget: int  # tokens per batch, padding included
    lr: float
    draft_lr: float
    eagle_steps: int
    eagle_lr: float
    difficulty: Difficulty
    warmup: float = 0.05
    weight_decay: float = 0.01
    init_std: float = 0.05
    seed: int = 0


@dataclass(slots=True)
class TrainLog:
    loss: list[float] = field(default_factory=list)
    draft_loss: list[float] = field(default_factory=list)
    eagle_loss: list[float] = field(default_factory=list)
    tokens: int = 0


@contextlib.contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """Seeded torch RNG and deterministic kernels for the duration; the previous settings come back."""
    was = torch.are_deterministic_algorithms_enabled()
    state = torch.random.get_rng_state()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.random.set_rng_state(state)


def lr_at(step: int, total: int, peak: float, warmup: float) -> float:
    w = max(1, int(total * warmup))
    if step < w:
        return peak * (step + 1) / w
    frac = (step - w) / max(1, total - w)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _adamw(module: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for n, p in module.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in module.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.98), eps=1e-8)


def new_model(cfg: ModelConfig, gen: torch.Generator, std: float) -> CausalLM:
    model = CausalLM(cfg)
    init_weights(model, gen, std)
    return model.train()


def lm_loss(model: CausalLM, rope: Rope, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy over the solution tokens of a batch."""
    ids = batch.ids
    B, T = ids.shape
    hidden = model(ids[:, :-1], causal_meta(rope.cos, rope.sin, B, T - 1), None, None)
    logits = model.logits(hidden)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    mask = batch.mask.reshape(-1)
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)


def _step(opt: torch.optim.Optimizer, module: torch.nn.Module, loss: torch.Tensor, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()


def train_lm(model: CausalLM, tok: Tokenizer, steps: int, lr: float, plan: TrainPlan, seed: int,
             max_positions: int, losses: list[float], progress: Progress, label: str) -> int:
    """Train on `steps` batches of worked solutions (cross-entropy on the solutions); returns tokens seen."""
    rope = Rope(model.config, max_positions, torch.device("cpu"), torch.float32)
    opt = _adamw(model, lr, plan.weight_decay)
    stream = batches(tok, seed, plan.difficulty, plan.token_budget)
    ema, tokens = None, 0
    for step in range(steps):
        batch = next(stream)
        loss = lm_loss(model, rope, batch)
        _step(opt, model, loss, lr_at(step, steps, lr, plan.warmup))
        tokens += batch.num_tokens
        losses.append(round(loss.item(), 5))
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        progress(1, {label: ema})
    return tokens


@torch.no_grad()
def grow(src: CausalLM, cfg: ModelConfig, gen: torch.Generator, std: float) -> CausalLM:
    """A deeper model that computes exactly what `src` computes: src's embedding, final norm and layers first,
    then new layers whose output projections are zero (progressive stacking). Training then only has to
    learn what the extra depth adds."""
    model = new_model(cfg, gen, std)
    n = src.config.num_layers
    model.embed_tokens.load_state_dict(src.embed_tokens.state_dict())
    model.norm.load_state_dict(src.norm.state_dict())
    for i in range(n):
        model.layers[i].load_state_dict(src.layers[i].state_dict())
    for layer in list(model.layers)[n:]:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return model.train()


def eagle_loss(head: EagleHead, target: CausalLM, rope: Rope, batch: Batch) -> torch.Tensor:
    """Head position t reads (f_t, x_{t+1}) and predicts f_{t+1}: KL from the target's next-token distribution
    at t + 1 to the one the predicted feature gives through the target's LM head, plus a feature regression."""
    ids = batch.ids
    B, T = ids.shape
    with torch.no_grad():
        feats = target(ids, causal_meta(rope.cos, rope.sin, B, T), None, None)  # [B, T, H]
        teacher = F.log_softmax(target.logits(feats[:, 1:]), dim=-1)  # predicts x_{t+2}
        embeds = target.embed_tokens(ids[:, 1:])
    pred = head(embeds, feats[:, :-1], causal_meta(rope.cos, rope.sin, B, T - 1))  # [B, T - 1, H]
    student = F.log_softmax(target.logits(pred), dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)  # [B, T - 1]
    reg = F.smooth_l1_loss(pred, feats[:, 1:], reduction="none").mean(-1)
    mask = batch.mask[:, 1:]  # positions whose drafted token x_{t+2} is a solution token
    per = (kl + 0.1 * reg)[:, : mask.shape[1]]
    return (per * mask).sum() / mask.sum().clamp_min(1.0)


def train_eagle(target: CausalLM, tok: Tokenizer, plan: TrainPlan, max_positions: int, log: TrainLog,
                progress: Progress) -> EagleHead:
    """A fresh head trained on the (frozen) target's features of newly drawn worked solutions."""
    head = init_head(target.config, seed=plan.seed + 2).train()
    target.requires_grad_(False)
    rope = Rope(target.config, max_positions, torch.device("cpu"), torch.float32)
    opt = _adamw(head, plan.eagle_lr, plan.weight_decay)
    stream = batches(tok, plan.seed + 1, plan.difficulty, plan.token_budget)
    ema = None
    for step in range(plan.eagle_steps):
        loss = eagle_loss(head, target, rope, next(stream))
        _step(opt, head, loss, lr_at(step, plan.eagle_steps, plan.eagle_lr, plan.warmup))
        log.eagle_loss.append(round(loss.item(), 5))
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        progress(1, {"eagle": ema})
    return head.eval().requires_grad_(False)
