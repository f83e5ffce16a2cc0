"""End-to-end benchmark: the same GRPO run (examples/grpo) with speculative decoding off, with a fixed k, adaptive
over the suffix drafter and the demo draft model with the drafter-distillation trainer on, and adaptive over
the suffix drafter alone. Same model, prompts and sampling seeds in every run.

Per step it records rollout time, tail time (after 75% of the samples finished), whole-step time, tokens per
engine step (accepted length), drafter versions and rewards; it writes a JSON summary and PNG plots and prints
one JSON line. Lossless SD means the reward curves agree up to sampling noise.

    python -m bench.e2e                       # the default configuration (CPU, about a minute per run)
    python -m bench.e2e --quick               # smoke run
    python -m bench.e2e --device cuda --steps 30 --prompts-per-step 32 ...   # larger, on a GPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from examples.grpo.grpo import GRPOConfig, StepRecord, record_dict, run
from examples.grpo.server import ServerProcess

logger = logging.getLogger("bench.e2e")
REPO = Path(__file__).resolve().parent.parent


def configs(args: argparse.Namespace, model: Path) -> dict[str, dict[str, Any]]:
    """Server settings per run: SD off, a fixed (drafter, k), adaptive over all drafters + the trainer."""
    from service.demo.default_model import default_drafters

    d = default_drafters(model)
    fixed = d[args.fixed_drafter]
    adaptive = ",".join(d[x] for x in args.adaptive_drafters.split(","))
    return {
        "off": {"drafter": "none", "spec": "off", "drafter_trainer": False},
        f"fixed_{args.fixed_drafter}_k{args.k}": {"drafter": fixed, "spec": "fixed", "spec_k": args.k,
                                                   "drafter_trainer": False},
        # Not in the default runs: the same fixed (drafter, k) with the in-process drafter trainer, so the trained
        # drafter's acceptance (tokens per step) shows on its own, whichever arm adaptive would pick.
        f"fixed-trained_{args.fixed_drafter}_k{args.k}": {"drafter": fixed, "spec": "fixed", "spec_k": args.k,
                                                           "drafter_trainer": True},
        "adaptive": {"drafter": adaptive, "spec": "adaptive", "drafter_trainer": not args.no_trainer},
        "adaptive-suffix": {"drafter": d["suffix"], "spec": "adaptive", "drafter_trainer": False},
    }


def run_config(name: str, server_kw: dict[str, Any], cfg: GRPOConfig, args: argparse.Namespace,
               model: Path, log_dir: Path) -> list[StepRecord]:
    extra = ["--device", args.device] if args.device != "cpu" else []
    if args.strategy_trace is not None:  # one trace per run (bench/trace_summary.py sets them side by side)
        args.strategy_trace.mkdir(parents=True, exist_ok=True)
        trace = args.strategy_trace / f"trace_{name}.jsonl"
        trace.unlink(missing_ok=True)  # the server appends
        extra += ["--strategy-trace", str(trace)]
    with ServerProcess(str(model), threads=args.server_threads, cpus=args.server_cpus,
                       max_model_len=cfg.max_tokens + 256,
                       max_num_seqs=max(64, cfg.prompts_per_step * cfg.group_size), extra_args=extra,
                       compile_before_serving=True,  # every timed step on compiled forwards
                       log_path=log_dir / f"server_{name}.log", **server_kw) as server:
        run_cfg = replace(cfg, server=server.grpc_target, admin_token=server.admin_token, model=str(model),
                          server_pid=server.proc.pid if server.proc else None)
        start = time.perf_counter()
        records = run(run_cfg)
        logger.warning("%s: %d steps in %.1f s, rewards %s", name, len(records), time.perf_counter() - start,
                       [round(r.reward, 2) for r in records])
        return records


def _mean(xs: list[float]) -> float:
    return round(statistics.fmean(xs), 4) if xs else 0.0


def summarize(results: dict[str, list[StepRecord]], skip: int) -> dict[str, Any]:
    """Per run: mean times over the steps after `skip` warm-up steps, accepted lengths, reward curve."""
    out: dict[str, Any] = {}
    for name, recs in results.items():
        timed = recs[skip:] or recs
        out[name] = {
            "rollout_s": _mean([r.rollout_s for r in timed]), "tail_s": _mean([r.tail_s for r in timed]),
            "update_s": _mean([r.update_s for r in timed]), "push_s": _mean([r.push_s for r in timed]),
            "step_s": _mean([r.step_s for r in timed]),
            "update_cpu_s": _mean([r.extra.get("update_cpu_s", 0.0) for r in timed]),
            "server_cpu_during_update_s": _mean([r.extra.get("server_cpu_during_update_s", 0.0) for r in timed]),
            "trained_tokens": _mean([r.extra.get("trained_tokens", 0) for r in timed]),
            # The update's work is the tokens of rows with a non-zero advantage, which differ between runs
            # (SD draws other samples, so other rewards): compare updates per trained token.
            "update_ms_per_trained_token": round(1e3 * sum(r.update_s for r in timed)
                                                 / max(1, sum(r.extra.get("trained_tokens", 0) for r in timed)), 4),
            # Per position the update's forward and backward ran (prompts and padding included): rows of other
            # lengths cost other amounts per trained token
            "forward_tokens": _mean([r.extra.get("forward_tokens", 0) for r in timed]),
            "update_ms_per_forward_token": round(1e3 * sum(r.update_s for r in timed)
                                                 / max(1, sum(r.extra.get("forward_tokens", 0) for r in timed)), 4),
            "tokens_per_step": [round(r.tokens_per_step, 3) for r in recs],
            "drafter_versions": [r.drafter_versions for r in recs],
            "reward": [round(r.reward, 4) for r in recs], "mean_reward": _mean([r.reward for r in recs]),
            "output_tokens": sum(r.output_tokens for r in recs),
            "logprob_max_abs_diff": max((r.logprob_max_abs_diff for r in recs), default=0.0),
        }
    base = out.get("off")
    if base:
        for s in out.values():
            s["rollout_speedup"] = round(base["rollout_s"] / s["rollout_s"], 3) if s["rollout_s"] else None
            s["tail_speedup"] = round(base["tail_s"] / s["tail_s"], 3) if s["tail_s"] else None
            s["step_speedup"] = round(base["step_s"] / s["step_s"], 3) if s["step_s"] else None
            # The step with SD off's update: a lossless server leaves the update's expected work as it is, but each
            # run trains on its own draws (other rows get a non-zero advantage: forward_tokens moved by 13-19%
            # between runs here), so this separates what the rollout server changed from the update's luck
            same = s["rollout_s"] + base["update_s"] + s["push_s"]
            s["step_speedup_same_update"] = round(base["step_s"] / same, 3) if same else None
    return out


def recovery_steps(recs: list[StepRecord], frac: float = 0.8) -> list[int]:
    """For each step whose accepted length fell below `frac` of the previous step's, how many steps it took to
    get back above that level (0 = it did not fall)."""
    out = []
    for i in range(1, len(recs)):
        ref = recs[i - 1].tokens_per_step
        if recs[i].tokens_per_step >= frac * ref:
            out.append(0)
            continue
        n = next((j - i for j in range(i + 1, len(recs)) if recs[j].tokens_per_step >= frac * ref), len(recs) - i)
        out.append(n)
    return out


def split_cores() -> tuple[set[int], set[int]] | None:
    """This process's cores in two halves, the server's and the trainer's (None: fewer than two, or no affinity)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def core_sharing(args: argparse.Namespace) -> Callable[[], dict[str, Any]] | None:
    """Where the run pins the server and the trainer to halves of the machine, a probe of how much one half's work
    slows the other (taken before and after the runs: on a shared virtual machine it changes over minutes)."""
    if args.server_cpus is None or args.quick:
        return None
    from bench.core_probe import sharing

    trainer_cpus = set(os.sched_getaffinity(0))
    return lambda: sharing(args.server_cpus, trainer_cpus)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=640)
    ap.add_argument("--min-terms", type=int, default=3)
    ap.add_argument("--max-terms", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--pool", type=int, default=16, help="fixed prompt pool size (epochs); 0 = fresh prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--fixed-drafter", default="draft", choices=["draft", "eagle", "suffix"])
    ap.add_argument("--adaptive-drafters", default="suffix,draft")
    ap.add_argument("--no-trainer", action="store_true", help="adaptive run without the drafter trainer")
    ap.add_argument("--runs", default="off,fixed,adaptive,adaptive-suffix", help="which runs, in order")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the time means")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--server-threads", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="trainer torch threads")
    ap.add_argument("--out-dir", type=Path, default=REPO / "docs")
    ap.add_argument("--tag", default="e2e", help="file name prefix of the JSON summary and plots")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--strategy-trace", type=Path, default=None, metavar="DIR",
                    help="write each run's strategy trace to DIR/trace_<run>.jsonl (python -m bench.trace_summary)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    ap.add_argument("--no-pin", action="store_true",
                    help="on CPU, do not split the cores between the server (and its drafter trainer) and the "
                         "GRPO trainer")
    args = ap.parse_args(argv)
    args.server_cpus = None
    halves = split_cores() if args.device == "cpu" and not args.no_pin else None
    if halves is not None:
        # As in a deployment, the rollout server and the trainer get their own compute: half the cores each,
        # so the server's idle time (the trainer's update) is really idle and its drafter trainer uses it.
        args.server_cpus, trainer_cpus = halves
        os.sched_setaffinity(0, trainer_cpus)
        args.server_threads = args.server_threads or len(args.server_cpus)
        args.threads = args.threads or len(trainer_cpus)
    if args.quick:
        args.steps, args.prompts_per_step, args.max_tokens, args.max_terms, args.skip = 3, 2, 160, 5, 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    from service.demo.default_model import ensure_default_model

    model = ensure_default_model()
    cfg = GRPOConfig(steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                     max_tokens=args.max_tokens, min_terms=args.min_terms, max_terms=args.max_terms, lr=args.lr,
                     pool=args.pool, seed=args.seed, threads=args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = args.out_dir / f"{args.tag}_logs"
    log_dir.mkdir(exist_ok=True)
    all_configs = configs(args, model)
    wanted = [w.strip() for w in args.runs.split(",")]
    chosen = {n: c for n, c in all_configs.items() if any(n == w or n.startswith(w + "_") for w in wanted)}
    load_start = os.getloadavg()
    probe = core_sharing(args)
    sharing = {"start": probe()} if probe else None
    results = {name: run_config(name, kw, cfg, args, model, log_dir) for name, kw in chosen.items()}
    if probe:
        sharing["end"] = probe()
    runs = summarize(results, args.skip)
    adaptive = results.get("adaptive")
    summary = {
        "bench": "e2e", "device": args.device, "model": str(model), "steps": args.steps,
        "prompts_per_step": args.prompts_per_step, "group_size": args.group_size, "max_tokens": args.max_tokens,
        "terms": [args.min_terms, args.max_terms], "pool": args.pool, "seed": args.seed, "runs": runs,
        "recovery_steps_adaptive": recovery_steps(adaptive) if adaptive else None,
        # Pinned halves: the server's compute rate while the trainer's half computes, over its rate alone (1.0:
        # independent; below, the halves share physical cores or a memory bus: bench/core_probe.py)
        "core_sharing": sharing,
        "loadavg": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
    }
    (args.out_dir / f"{args.tag}.json").write_text(json.dumps(
        {"summary": summary, "records": {n: [record_dict(r) for r in rs] for n, rs in results.items()}}, indent=1))
    if not args.no_plots:
        from bench.e2e_plots import write_plots

        summary["plots"] = [str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)
                            for p in write_plots(results, args.out_dir, args.tag)]
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
