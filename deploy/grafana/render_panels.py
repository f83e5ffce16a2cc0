"""Render the dashboard's key panels from a Prometheus as one PNG (a stand-in for a Grafana screenshot).

    python3 deploy/grafana/render_panels.py --prometheus http://127.0.0.1:9090 --start 1700000000 \\
        --end 1700000060 --out dashboard.png [--rate-interval 20s] [--panel TITLE ...]

Each panel's queries (deploy/grafana/specroll*-dashboard.json) are evaluated with /api/v1/query_range, with
``$__rate_interval`` and ``$instance`` substituted, and drawn one series per line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger("render_panels")

DASHBOARDS = sorted(Path(__file__).resolve().parent.glob("specroll*-dashboard.json"))
KEY_PANELS = ("Tokens / s", "Speculative decoding: acceptance", "Decoding strategy (steps / s)",
              "Time to first token", "Weight push latency (pushes of the last hour)", "Rollout buffer")


def promql(expr: str, rate_interval: str) -> str:
    return expr.replace("$__rate_interval", rate_interval).replace('"$instance"', '".*"')


def legend(fmt: str, labels: dict[str, str]) -> str:
    out = fmt
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def query_range(api: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    r = httpx.get(f"{api}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step},
                  timeout=30)
    body = r.json()
    if r.status_code != 200 or body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def render(api: str, start: float, end: float, out: Path, titles: tuple[str, ...] = KEY_PANELS,
           rate_interval: str = "20s") -> int:
    """Draw the panels named `titles` into `out`; returns the number of series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {p["title"]: p for path in DASHBOARDS for p in json.loads(path.read_text())["panels"]}
    missing = [t for t in titles if t not in panels]
    if missing:
        raise ValueError(f"no such panels: {missing}")
    cols = 2
    rows = math.ceil(len(titles) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.0 * rows), squeeze=False)
    step = max((end - start) / 200, 1.0)
    drawn = 0
    for ax, title in zip(axes.flat, titles, strict=False):
        for target in panels[title]["targets"]:
            for series in query_range(api, promql(target["expr"], rate_interval), start, end, step):
                points = [(float(t) - start, float(v)) for t, v in series["values"] if math.isfinite(float(v))]
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]) or None)
                drawn += 1
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds", fontsize=8)
        ax.tick_params(labelsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(titles):]:
        ax.axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--start", type=float, required=True)
    p.add_argument("--end", type=float, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rate-interval", default="20s")
    p.add_argument("--panel", action="append", help="panel title (default: the key panels)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    n = render(args.prometheus.rstrip("/"), args.start, args.end, args.out, tuple(args.panel or KEY_PANELS),
               args.rate_interval)
    logger.info("%d series drawn into %s", n, args.out)
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
