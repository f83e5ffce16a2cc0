"""PNG plots of an e2e run (matplotlib, Agg backend): lengths, rollout time, accepted length, rewards."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from examples.grpo.grpo import StepRecord

COLORS = {"off": "#7f7f7f", "adaptive": "#d62728", "adaptive-suffix": "#2ca02c"}


def _color(name: str) -> str:
    return COLORS.get(name, "#1f77b4")


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def lengths_plot(results: dict[str, list[StepRecord]], path: Path) -> Path:
    recs = results.get("off") or next(iter(results.values()))
    lengths = [n for r in recs for n in r.lengths]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.hist(lengths, bins=40, color="#1f77b4")
    ax.set_yscale("log")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("samples")
    srt = sorted(lengths)
    med, p99 = srt[len(srt) // 2], srt[min(len(srt) - 1, int(0.99 * len(srt)))]
    ax.set_title(f"Response lengths: median {med}, p99 {p99}, max {srt[-1]}")
    return _save(fig, path)


def rollout_time_plot(results: dict[str, list[StepRecord]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for name, recs in results.items():
        ax.plot([r.step for r in recs], [r.rollout_s for r in recs], marker="o", ms=3, label=name,
                color=_color(name))
        ax.plot([r.step for r in recs], [r.tail_s for r in recs], ls=":", color=_color(name))
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("seconds")
    ax.set_title("Rollout time per step (dotted: tail after 75% finished)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return _save(fig, path)


def accepted_length_plot(results: dict[str, list[StepRecord]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for name, recs in results.items():
        if name == "off":
            continue
        ax.plot([r.step for r in recs], [r.tokens_per_step for r in recs], marker="o", ms=3, label=name,
                color=_color(name))
    ax.axhline(1.0, color=_color("off"), ls="--", lw=1, label="off")
    ax.set_xlabel("policy version (step-N pushed after step N-1)")
    ax.set_ylabel("tokens per engine step")
    ax.set_title("Accepted length per step across policy pushes")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return _save(fig, path)


def reward_plot(results: dict[str, list[StepRecord]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for name, recs in results.items():
        ax.plot([r.step for r in recs], [r.reward for r in recs], marker="o", ms=3, label=name, color=_color(name))
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward (fraction correct)")
    ax.set_title("Reward curves (same seeds; SD is lossless)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_plots(results: dict[str, list[StepRecord]], out_dir: Path, tag: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        lengths_plot(results, out_dir / f"{tag}_lengths.png"),
        rollout_time_plot(results, out_dir / f"{tag}_rollout_time.png"),
        accepted_length_plot(results, out_dir / f"{tag}_accepted_length.png"),
        reward_plot(results, out_dir / f"{tag}_reward.png"),
    ]
