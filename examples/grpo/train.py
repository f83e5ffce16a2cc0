"""GRPO on the demo task with a specroll server doing the rollouts.

Against a running server (the trainer loads the policy from the server's model folder, or --model):

    specroll serve --admin-token T &
    python -m examples.grpo.train --server 127.0.0.1:50051 --admin-token T --steps 20

Or let the example start the server itself (default model, adaptive SD over its drafters):

    python -m examples.grpo.train --spawn-server --steps 20 --out grpo.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields
from pathlib import Path

from examples.grpo.grpo import GRPOConfig, StepRecord, record_dict, run
from examples.grpo.server import ServerProcess

logger = logging.getLogger("examples.grpo")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="GRPO on the demo task against a specroll server")
    for f in fields(GRPOConfig):
        kind = type(f.default) if f.default is not None else str
        if f.name == "threads":
            kind = int
        if kind is bool:
            p.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=f.default)
            continue
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    p.add_argument("--spawn-server", action="store_true", help="start `specroll serve` on free loopback ports")
    p.add_argument("--drafter", default=None, help="with --spawn-server: --drafter (default: the demo's drafters)")
    p.add_argument("--spec", default="adaptive", choices=["adaptive", "fixed", "off"])
    p.add_argument("--spec-k", type=int, default=4)
    p.add_argument("--server-threads", type=int, default=None)
    p.add_argument("--server-dtype", default=None, help="with --spawn-server: the served dtype (--dtype)")
    p.add_argument("--out", type=Path, default=None, help="write the step records here (JSON)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = GRPOConfig(**{f.name: getattr(args, f.name) for f in fields(GRPOConfig)})
    server = None
    if args.spawn_server:
        from service.demo.default_model import default_drafters, ensure_default_model

        model = Path(cfg.model) if cfg.model else ensure_default_model()
        drafters = default_drafters(model)
        drafter = args.drafter or f"{drafters['suffix']},{drafters['draft']}"
        server = ServerProcess(str(model), drafter=drafter, spec=args.spec, spec_k=args.spec_k,
                               threads=args.server_threads, max_model_len=max(1024, cfg.max_tokens + 256),
                               extra_args=["--dtype", args.server_dtype] if args.server_dtype else []).start()
        cfg.server, cfg.admin_token, cfg.model = server.grpc_target, server.admin_token, str(model)
    records: list[StepRecord] = []
    try:
        records = run(cfg)
    finally:
        if server is not None:
            server.stop()
    curve = [round(r.reward, 3) for r in records]
    logger.info("reward per step: %s", curve)
    if args.out:
        args.out.write_text(json.dumps({"config": {f.name: getattr(cfg, f.name) for f in fields(cfg)},
                                        "steps": [record_dict(r) for r in records]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
