"""Where a rollout's decode time goes, per batch-size bucket, from strategy traces.

Per trace and bucket: decode steps, tokens, seconds, milliseconds a step, tokens a step and a row, tokens a second,
and the arms that ran. Given several traces (SD off first), each bucket's tokens a second is set against the first
trace's: the speed-up where the batch is full and where it drains. The work between two steps is reported apart.

    python -m bench.trace_summary OFF.jsonl ADAPTIVE.jsonl [--skip-rollouts 2]

Prints one JSON line. docs/design-notes.md says how rollouts are delimited.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.engine.strategy import bucket_of  # the strategy's batch buckets


@dataclass(slots=True)
class Bucket:
    steps: int = 0
    seconds: float = 0.0
    between_s: float = 0.0
    emitted: int = 0
    rows: int = 0
    arms: Counter[str] = field(default_factory=Counter)

    def add(self, line: dict[str, Any]) -> None:
        self.steps += 1
        self.seconds += line["seconds"]
        if line.get("cost_seconds") is not None:
            self.between_s += max(line["cost_seconds"] - line["seconds"], 0.0)
        self.emitted += line["emitted"]
        self.rows += line["batch"]
        self.arms[line["arm"]] += 1

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "tokens": self.emitted, "seconds": round(self.seconds, 4),
            "ms_per_step": round(self.seconds / self.steps * 1e3, 3),
            "between_ms": round(self.between_s / self.steps * 1e3, 3),
            "tokens_per_step": round(self.emitted / self.steps, 2),
            "tokens_per_row_step": round(self.emitted / self.rows, 3),
            "tokens_per_s": round(self.emitted / self.seconds, 1) if self.seconds else None,
            "arms": {arm: round(n / self.steps, 3) for arm, n in self.arms.most_common()},
        }


def rollouts(lines: list[dict[str, Any]], new_rows: int) -> list[list[dict[str, Any]]]:
    """The trace cut where a new rollout begins (see the module docstring)."""
    out: list[list[dict[str, Any]]] = []
    left = False  # a row of the current part has finished
    for line in lines:
        prev = out[-1][-1]["batch"] if out else 0
        joined = line.get("joined", max(line["batch"] - prev, 0))  # traces before `joined` was written: growth
        if not out or (left and joined >= new_rows):
            out.append([])
            left = False
        elif prev + joined > line["batch"]:
            left = True
        out[-1].append(line)
    return out


def summarize(path: Path, skip_rollouts: int, new_rows: int) -> dict[str, Any]:
    lines = [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
    parts = rollouts(lines, new_rows)
    buckets: dict[int, Bucket] = {}
    total = Bucket()
    for line in (x for part in parts[skip_rollouts:] for x in part):
        buckets.setdefault(bucket_of(line["batch"]), Bucket()).add(line)
        total.add(line)
    return {
        "trace": str(path), "rollouts": len(parts), "rollouts_skipped": min(skip_rollouts, len(parts)),
        "buckets": {str(k): buckets[k].summary() for k in sorted(buckets)},
        "total": total.summary() if total.steps else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path, help="strategy trace files (JSON lines); the first is the base")
    ap.add_argument("--skip-rollouts", type=int, default=0, help="leave out each trace's first N rollouts")
    ap.add_argument("--new-rows", type=int, default=4, help="rows that must join the batch to begin a rollout")
    args = ap.parse_args(argv)
    runs = [summarize(p, args.skip_rollouts, args.new_rows) for p in args.traces]
    base = runs[0]["buckets"]
    for run in runs[1:]:
        for k, b in run["buckets"].items():
            if k in base and base[k]["tokens_per_s"] and b["tokens_per_s"]:
                b["tokens_per_s_vs_first"] = round(b["tokens_per_s"] / base[k]["tokens_per_s"], 3)
    sys.stdout.write(json.dumps({"bench": "trace_summary", "runs": runs}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
