"""PNG for bench/spec_decode.py (matplotlib, Agg): tokens/s per strategy per batch bucket, and the adaptive
strategy's choice over the run's steps."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"off": "#7f7f7f", "adaptive": "#d62728"}


def _k_of(strategy: str) -> int:
    """"draft:k=4" and "draft:k=4+suffix" (assisted by the suffix table) -> 4; "plain" -> 0."""
    return int(strategy.split("k=")[1].split("+")[0]) if "k=" in strategy else 0


def _kind_of(strategy: str) -> str:
    """plain | draft | suffix | draft+suffix: the drafter of a step's strategy, and the one assisting it."""
    return strategy.split(":")[0] + ("+" + strategy.split("+")[1] if "+" in strategy else "")


def strategy_plot(shape: str, results: dict[str, dict], path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, res in results.items():
        buckets = sorted(int(b) for b in res["per_bucket"])
        left.plot(buckets, [res["per_bucket"][str(b)] for b in buckets], marker="o", label=name,
                  color=COLORS.get(name), linewidth=2.5 if name == "adaptive" else 1.2)
    left.set_xscale("log", base=2)
    left.set_xlabel("running batch (power-of-two bucket)")
    left.set_ylabel("decode tokens/s in that bucket")
    left.set_title(f"{shape}: throughput per strategy per bucket")
    left.legend(fontsize=8)
    ada = results.get("adaptive")
    if ada:
        trace = ada["trace"]
        steps = range(len(trace))
        kinds = (("draft", "#1f77b4"), ("draft+suffix", "#9467bd"), ("suffix", "#2ca02c"), ("plain", "#7f7f7f"))
        for kind, color in kinds:
            pts = [(i, _k_of(s)) for i, (_, s, _, _) in zip(steps, trace, strict=True) if _kind_of(s) == kind]
            if pts:
                right.scatter([p[0] for p in pts], [p[1] for p in pts], s=9, color=color, label=kind)
        right.set_xlabel("decode step of the adaptive run")
        right.set_ylabel("k chosen (0 = plain)")
        twin = right.twinx()
        twin.plot(list(steps), [t[0] for t in trace], color="#ff7f0e", linewidth=1)
        twin.set_ylabel("running batch", color="#ff7f0e")
        right.set_title("adaptive: choice per step")
        right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
