"""How independent two sets of CPUs are: the compute rate on one set while the other set computes, over its rate alone.

bench/e2e.py pins the rollout server and the GRPO trainer to halves of the machine, as a deployment gives them their
own devices. On a virtual machine two "cores" can be hyperthreads of one physical core: then work on one half slows
the other, and the trainer's update (or the server's in-process drafter trainer beside it) is slower than pinning
suggests. One 2-vCPU machine here ran a matmul loop 0.57x as fast while the other vCPU ran one too.

    python -m bench.core_probe 0 1          # rate on CPU 0 with CPU 1 busy, over its rate alone

Prints one JSON line. Each rate is a child process pinned to its CPUs running 256 x 256 float32 matmuls on one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MATMUL = 256


def _rate(seconds: float) -> float:
    """Matmuls a second on this process's CPUs, one thread."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
    for _ in range(20):
        a @ b
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ b
        n += 20
    return n / (time.perf_counter() - start)


def _pinned(cpus: set[int], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "bench.core_probe", "--child", *args], stdout=subprocess.PIPE,
                            text=True, preexec_fn=lambda: os.sched_setaffinity(0, cpus))


def sharing(measured: set[int], busy: set[int], seconds: float = 1.5) -> dict[str, float | list[int]]:
    """The matmul rate on `measured` while `busy` runs the same loop, over the rate alone (1.0: independent; about
    0.5: one core time-sliced; in between: hyperthreads of one core, or a memory bus both saturate)."""
    alone = float(_pinned(measured, "rate", str(seconds)).communicate()[0])
    spinner = _pinned(busy, "rate", str(seconds + 2.0))
    try:
        time.sleep(0.5)  # the spinner's interpreter and torch import, so it computes through the measurement
        shared = float(_pinned(measured, "rate", str(seconds)).communicate()[0])
    finally:
        spinner.kill()
        spinner.wait()
    return {"measured_cpus": sorted(measured), "busy_cpus": sorted(busy), "alone_per_s": round(alone, 1),
            "shared_per_s": round(shared, 1), "rate_with_other_busy": round(shared / alone, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured", nargs="?", type=int, default=0)
    ap.add_argument("busy", nargs="?", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SECONDS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.stdout.write(f"{_rate(float(args.child[1]))}\n")
        return 0
    sys.stdout.write(json.dumps(sharing({args.measured}, {args.busy}, args.seconds)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
