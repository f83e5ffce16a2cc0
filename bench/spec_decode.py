"""Rollout benchmark: speculative decoding off, fixed (draft, k), and adaptive, on several workload shapes.

Each workload is 64 requests (8 prompts x 8 samples): long_tail, near_uniform, heavy_tail, and collapse (the draft
model swapped for an unrelated one halfway). Target and draft model are built here. Each config runs `--repeats`
times round-robin; the JSON reports the median run and adaptive against the best fixed k paired round by round.
`--configs ...,perfect` adds a drafter that is always right and free; `--warm` serves each workload once untimed
first (the steady state). Prints one JSON line and writes a PNG per workload (`--plot-dir`).

    python3 -m bench.spec_decode [--threads 1] [--workloads long_tail,near_uniform] [--repeats 3] [--warm]

docs/design-notes.md describes the workloads and fields in full.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from service.config import EngineConfig
from service.engine.drafters.suffix import SuffixDrafter
from service.engine.llm_engine import LLMEngine
from service.engine.strategy import bucket_of
from service.models.loader import load_model
from service.params import SamplingParams

logger = logging.getLogger("bench.spec_decode")


def write_models(root: Path, hidden: int, layers: int, draft_layers: int, vocab: int, align: float, seed: int,
                 embed_std: float = 0.1):
    """Target with `layers` layers; draft = its first `draft_layers`. Later target layers are scaled by
    `align` (smaller = closer to the draft)."""
    g = torch.Generator().manual_seed(seed)
    heads, kv, head_dim, inter = hidden // 64, max(hidden // 128, 1), 64, int(hidden * 2.75)
    cfg = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "vocab_size": vocab, "eos_token_id": 0, "bos_token_id": 0, "torch_dtype": "float32",
    }

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    # embed_std sets how peaked next-token distributions are (tied head: logits ~ sqrt(hidden) * embed_std).
    tensors = {"model.embed_tokens.weight": rnd(vocab, hidden, std=embed_std), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out_scale = 1.0 if i < draft_layers else align
        tensors.update({
            p + "self_attn.q_proj.weight": rnd(heads * head_dim, hidden, std=hidden**-0.5),
            p + "self_attn.k_proj.weight": rnd(kv * head_dim, hidden, std=hidden**-0.5),
            p + "self_attn.v_proj.weight": rnd(kv * head_dim, hidden, std=hidden**-0.5),
            p + "self_attn.q_proj.bias": rnd(heads * head_dim, std=0.02),
            p + "self_attn.k_proj.bias": rnd(kv * head_dim, std=0.02),
            p + "self_attn.v_proj.bias": rnd(kv * head_dim, std=0.02),
            p + "self_attn.o_proj.weight": rnd(hidden, heads * head_dim, std=out_scale * hidden**-0.5),
            p + "mlp.gate_proj.weight": rnd(inter, hidden, std=hidden**-0.5),
            p + "mlp.up_proj.weight": rnd(inter, hidden, std=hidden**-0.5),
            p + "mlp.down_proj.weight": rnd(hidden, inter, std=out_scale * inter**-0.5),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    for name, n_layers in (("target", layers), ("draft", draft_layers)):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        keep = {k: v for k, v in tensors.items()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers}
        save_file(keep, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=n_layers)))
    return root / "target", root / "draft"


WORKLOADS = ("long_tail", "near_uniform", "heavy_tail", "collapse")


def workload(shape: str, n_prompts: int, per_prompt: int, median: int, sigma: float, cap: int, vocab: int,
             seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randrange(8, 32))] for _ in range(n_prompts)]
    n = n_prompts * per_prompt
    if shape == "near_uniform":
        lengths = [rng.randint(int(median * 2 * 0.9), int(median * 2 * 1.1)) for _ in range(n)]
    else:
        med, sig = (median // 2, sigma + 0.6) if shape == "heavy_tail" else (median, sigma)
        lengths = [min(cap, max(4, int(math.exp(rng.gauss(math.log(med), sig))))) for _ in range(n)]
    return prompts, lengths


def submit(engine: LLMEngine, prompts, lengths, per_prompt: int, seed: int) -> None:
    """The workload's requests: request i samples `lengths[i]` tokens of prompt i // per_prompt."""
    for i, n in enumerate(lengths):
        params = SamplingParams(temperature=1.0, max_tokens=n, seed=seed + i, ignore_eos=True)
        engine.add_request(prompts[i // per_prompt], params, group_id=f"g{i // per_prompt}")


def run(target: Path, drafter: str, spec: str, k: int, prompts, lengths, per_prompt: int, max_len: int,
        threads: int, stale_draft: Path | None = None, device: str = "cpu", eager: bool = False,
        trace_path: Path | None = None, warm_rollout: bool = False) -> dict:
    """One rollout; with `stale_draft`, the draft model is replaced by it once half the tokens are out. With
    `trace_path`, the engine writes its strategy trace there (service/engine/trace.py). With `warm_rollout`, the
    engine first serves the same workload untimed (other seeds; `steady_state` says why)."""
    engine = LLMEngine(EngineConfig(model=str(target), drafter=drafter, spec=spec, spec_k=k, max_model_len=max_len,
                                    max_num_seqs=len(lengths), num_threads=threads, seed=0, device=device,
                                    enforce_eager=eager, strategy_trace=str(trace_path) if trace_path else None))
    warm = SamplingParams(temperature=1.0, max_tokens=8, seed=1, ignore_eos=True)
    engine.generate([prompts[0]] * 4, warm)  # warm-up, also primes the strategy's plain-cost estimates
    warm_steps = steady_state(engine, prompts, lengths, per_prompt) if warm_rollout else 0
    held_before = engine.driver.held_steps
    submit(engine, prompts, lengths, per_prompt, seed=1000)
    total, tail_after = len(lengths), max(1, len(lengths) // 10)
    start = time.perf_counter()
    tail_start = None
    tokens = 0
    spec_rows = spec_emitted = drafted = accepted = 0
    strategies: dict[str, int] = {}
    trace: list[tuple[int, str, float, int]] = []  # per decode step: batch, strategy, seconds, emitted tokens
    finished = 0
    drafting = tail_drafting = 0.0  # seconds of `propose` (catch-up and drafting), all of it and in the tail
    half, swapped = sum(lengths) // 2, False
    while engine.has_unfinished():
        steps_before = engine.stats.num_steps
        outs = engine.step()
        tokens += sum(len(o.new_token_ids) for o in outs)
        finished += sum(o.finished for o in outs)
        if stale_draft is not None and not swapped and tokens >= half and "draft" in engine.drafters:
            engine.swap_drafter(load_model(stale_draft, engine.dtype, engine.device), "stale")
            swapped = True
        rec = engine.stats.recent[-1] if engine.stats.num_steps > steps_before else None
        if rec is not None and rec.kind != "prefill":
            trace.append((rec.batch_size, rec.strategy, round(rec.seconds, 5), rec.emitted_tokens))
            strategies[rec.strategy] = strategies.get(rec.strategy, 0) + 1
            if rec.k:
                spec_rows += rec.batch_size
                spec_emitted += rec.emitted_tokens
                drafting += rec.draft_seconds
                drafted, accepted = drafted + rec.drafted_tokens, accepted + rec.accepted_tokens
                tail_drafting += rec.draft_seconds if tail_start is not None else 0.0
        if tail_start is None and total - finished <= tail_after:
            tail_start = time.perf_counter()
    end = time.perf_counter()
    return {
        "seconds": round(end - start, 3),
        "tokens_per_s": round(tokens / (end - start), 1),
        "tail_seconds": round(end - (tail_start or end), 3),
        "drafting_seconds": round(drafting, 3), "tail_drafting_seconds": round(tail_drafting, 3),
        "mean_accepted_length": round(spec_emitted / spec_rows, 3) if spec_rows else 1.0,
        "acceptance": round(accepted / drafted, 4) if drafted else None,  # accepted drafts over drafts verified
        "strategies": strategies,
        # steps an earlier choice decided (service/engine/strategy_driver.py)
        "held_steps": engine.driver.held_steps - held_before,
        "warm_steps": warm_steps,
        "tokens": tokens,
        "per_bucket": per_bucket(trace),
        "trace": trace,
    }


def steady_state(engine: LLMEngine, prompts, lengths, per_prompt: int) -> int:
    """Serve the workload once untimed (other seeds) and return its decode steps. A rollout server serves one
    rollout after another, so every rollout but a run's first meets a strategy that has measured its arms' costs
    and acceptance already; a fresh engine per timed rollout (the default) prices exploring from nothing into
    every figure. The suffix table forgets these responses afterwards: the timed rollout's prompts are the same,
    and what its history of them would add is prompt repetition, not the strategy's warm state."""
    submit(engine, prompts, lengths, per_prompt, seed=500_000)
    steps = 0
    while engine.has_unfinished():
        before = engine.stats.num_steps
        engine.step()
        steps += engine.stats.num_steps > before and engine.stats.recent[-1].kind != "prefill"
    for drafter in engine.drafters.values():
        if isinstance(drafter, SuffixDrafter):
            drafter.reset()
    return steps


def per_bucket(trace: list[tuple[int, str, float, int]]) -> dict[str, float]:
    """tokens/s of the decode steps whose batch falls in each power-of-two bucket."""
    tok: dict[int, int] = {}
    sec: dict[int, float] = {}
    for batch, _, seconds, emitted in trace:
        b = bucket_of(batch)
        tok[b] = tok.get(b, 0) + emitted
        sec[b] = sec.get(b, 0.0) + seconds
    return {str(b): round(tok[b] / sec[b], 1) for b in sorted(tok) if sec[b] > 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--align", type=float, default=0.1, help="scale of the target's extra layers")
    ap.add_argument("--embed-std", type=float, default=0.1, help="embedding scale (peakedness of the model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--per-prompt", type=int, default=8)
    ap.add_argument("--median", type=int, default=48)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--cap", type=int, default=640)
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--perfect-k", type=int, default=8, help="the depth of the `perfect` config (see the docstring)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per config, the median run is reported (default 3; 1 with --quick)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {WORKLOADS}")
    ap.add_argument("--configs", default=None, help="only these configs (e.g. off,adaptive); default all")
    ap.add_argument("--plot-dir", type=lambda text: Path(text) if text else None,
                    default=Path(__file__).resolve().parent.parent / "docs", help="where the PNGs go ('': none)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (GPU), no torch.compile (CPU)")
    ap.add_argument("--strategy-trace", type=Path, default=None, metavar="DIR",
                    help="write each adaptive run's strategy trace to DIR/trace_<workload>_<round>.jsonl")
    ap.add_argument("--warm", action="store_true",
                    help="each engine serves the workload once untimed first (steady state; `steady_state`)")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.quick:
        args.hidden, args.layers, args.prompts, args.per_prompt, args.cap, args.median = 128, 4, 4, 4, 96, 16
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    shapes = [w for w in args.workloads.split(",") if w]
    unknown = set(shapes) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    if args.strategy_trace:
        args.strategy_trace.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    summary: dict = {
        "bench": "spec_decode", "threads": args.threads or torch.get_num_threads(), "device": args.device,
        "enforce_eager": args.enforce_eager, "warm": args.warm,
        "model": {"hidden": args.hidden, "layers": args.layers, "draft_layers": args.draft_layers, "vocab": args.vocab},
        "workloads": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = write_models(Path(tmp), args.hidden, args.layers, args.draft_layers, args.vocab, args.align,
                                     args.seed, args.embed_std)
        # An unrelated draft model of the same shape: what a drafter is worth after the policy moved away.
        _, stale = write_models(Path(tmp) / "stale", args.hidden, args.draft_layers, args.draft_layers, args.vocab,
                                args.align, args.seed + 1, args.embed_std)
        configs = [("off", "none", "off", 0)] + [(f"k={k}", str(draft), "fixed", int(k)) for k in args.ks.split(",")]
        configs.append(("adaptive", f"{draft},suffix", "adaptive", 4))
        configs.append(("perfect", str(target), "fixed", args.perfect_k))
        wanted = args.configs.split(",") if args.configs else [c[0] for c in configs if c[0] != "perfect"]
        configs = [c for c in configs if c[0] in wanted]
        for shape in shapes:
            prompts, lengths = workload(shape, args.prompts, args.per_prompt, args.median, args.sigma, args.cap,
                                        args.vocab, args.seed)
            # The collapse swaps the draft model for a stale one halfway: a perfect drafter would not stay one.
            shape_configs = [c for c in configs if not (shape == "collapse" and c[0] == "perfect")]
            runs: dict[str, list[dict]] = {name: [] for name, *_ in shape_configs}
            # Repeats go round the configs, so a drift in the machine's speed hits every config alike.
            rounds = [c for _ in range(args.repeats) for c in shape_configs]
            for name, drafter, spec, k in tqdm(rounds, desc=shape, file=sys.stderr):
                trace = None
                if args.strategy_trace and spec == "adaptive":
                    trace = args.strategy_trace / f"trace_{shape}_{len(runs[name])}.jsonl"
                r = run(target, drafter, spec, k, prompts, lengths, args.per_prompt, 40 + max(lengths), args.threads,
                        stale if shape == "collapse" else None, args.device, args.enforce_eager, trace, args.warm)
                runs[name].append(r)
                logger.warning("%s %s: %s", shape, name, {k: v for k, v in r.items() if k != "trace"})
            results = {name: median_run(rs) for name, rs in runs.items()}
            if args.plot_dir:
                from bench.spec_plots import strategy_plot

                args.plot_dir.mkdir(parents=True, exist_ok=True)
                strategy_plot(shape, results, args.plot_dir / f"spec_decode_{shape}.png")
            summary["workloads"][shape] = summarise(results, lengths)
    summary["loadavg"] = {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]}
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def median_run(runs: list[dict]) -> dict:
    """The run with the median wall time (its trace, tail and buckets), with every run's seconds."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return dict(ordered[(len(ordered) - 1) // 2], seconds_runs=[r["seconds"] for r in runs])


def summarise(results: dict[str, dict], lengths: list[int]) -> dict:
    out: dict = {"requests": len(lengths), "median_len": sorted(lengths)[len(lengths) // 2], "max_len": max(lengths),
                 "results": {n: {k: v for k, v in r.items() if k != "trace"} for n, r in results.items()}}
    fixed = {n: r for n, r in results.items() if n.startswith("k=")}
    off, ada = results.get("off"), results.get("adaptive")
    if fixed:
        best = min(fixed, key=lambda n: fixed[n]["seconds"])
        out["best_fixed"] = best
        if ada:
            out["ratio_adaptive_vs_best_fixed"] = round(fixed[best]["seconds"] / ada["seconds"], 3)
            # Paired: round i's best-fixed run against round i's adaptive run, which ran next to it. The machine's
            # speed drifts by several % over a bench (both configs move together within a round), so the median
            # of these says more than the ratio of two medians from different rounds.
            paired = sorted(b / a for b, a in zip(fixed[best]["seconds_runs"], ada["seconds_runs"], strict=True))
            out["ratio_adaptive_vs_best_fixed_paired"] = {"median": round(paired[(len(paired) - 1) // 2], 3),
                                                          "runs": [round(x, 3) for x in paired]}
        if off:
            out["ratio_best_fixed_vs_off"] = round(off["seconds"] / fixed[best]["seconds"], 3)
            oracle = bucket_oracle(off, [off, *fixed.values()])
            out["bucket_oracle_seconds"] = round(oracle, 3)
            out["ratio_bucket_oracle_vs_best_fixed"] = round(fixed[best]["seconds"] / oracle, 3)
    if off and ada:
        out["ratio_adaptive_vs_off"] = round(off["seconds"] / ada["seconds"], 3)
        out["ratio_tail_adaptive_vs_off"] = round(off["tail_seconds"] / max(ada["tail_seconds"], 1e-9), 3)
    if off and (perfect := results.get("perfect")):  # a drafter always right and free: what SD can reach at most
        out["ratio_perfect_vs_off"] = round(off["seconds"] / (perfect["seconds"] - perfect["drafting_seconds"]), 3)
        tail = perfect["tail_seconds"] - perfect["tail_drafting_seconds"]  # 0 where every row ends in one step
        out["ratio_tail_perfect_vs_off"] = round(off["tail_seconds"] / tail, 3) if tail >= 1e-3 else None
    return out


def bucket_oracle(off: dict, configs: list[dict]) -> float:
    """Decode seconds of a rollout that ran, in each batch-size bucket, whichever of `configs` was fastest there,
    with no step spent finding out which: SD off's tokens in each bucket over the best tokens/s there. What
    picking one of these configs per bucket can reach at best. Where it is close to the best fixed config, so is
    any strategy choosing among them per bucket: on the long tail on a CPU it was 1.10-1.11x the best fixed k, so
    the issue's 10% lead needs more than the right k per bucket."""
    tokens: dict[int, int] = {}
    for batch, _, _, emitted in off["trace"]:
        tokens[bucket_of(batch)] = tokens.get(bucket_of(batch), 0) + emitted
    return sum(n / max(r["per_bucket"].get(str(b), 0.0) for r in configs) for b, n in tokens.items())


if __name__ == "__main__":
    sys.exit(main())
