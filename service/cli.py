"""The `specroll` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("specroll")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SPECROLL_{name.upper().replace('-', '_')}", default)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_env("model"), help="Hugging Face model folder (default: embedded model)")
    p.add_argument("--dtype", default=_env("dtype", "float32"), choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=_env("device", "cpu"))
    p.add_argument("--max-model-len", type=int, default=int(_env("max_model_len", "0")) or None,
                   help="longest prompt + output (default: the checkpoint's context length, capped by what the KV "
                        "cache holds; the reason is logged)")
    p.add_argument("--max-num-seqs", type=int, default=int(_env("max_num_seqs", "64")))
    p.add_argument("--kv-cache-gb", type=float, default=float(_env("kv_cache_gb", "2.0")))
    p.add_argument("--seed", type=int, default=int(_env("seed", "0")))
    p.add_argument("--spec", default=_env("spec", "adaptive"), choices=["adaptive", "fixed", "off"],
                   help="speculative decoding: adaptive (drafter, k) per step, fixed k, or off")
    p.add_argument("--spec-k", type=int, default=int(_env("spec_k", "4")), help="draft length for --spec fixed")
    p.add_argument("--enforce-eager", action="store_true", default=_env("enforce_eager", "") in ("1", "true"),
                   help="decode and verify steps run eagerly: no CUDA graphs on a GPU (either backend), no "
                   "torch.compile on CPU (native backend; saves its start-up compile)")
    p.add_argument("--threads", type=int, default=int(_env("threads", "0")) or None, help="torch CPU threads")
    p.add_argument("--strategy-trace", default=_env("strategy_trace"), metavar="PATH",
                   help="append one JSON line per decode step to PATH: the adaptive strategy's choice, its cost "
                   "and what it believed (native backend)")


def _model_dir(args: argparse.Namespace) -> str:
    """The model folder: --model, else the embedded default model (built or unpacked on first use)."""
    if args.model:
        return str(args.model)
    from service.demo.default_model import ensure_default_model

    return str(ensure_default_model())


def _engine_config(args: argparse.Namespace, **settings: Any):
    from service.config import EngineConfig
    from service.drafter_spec import DrafterSpec

    return EngineConfig(
        model=_model_dir(args), dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, kv_cache_memory_gb=args.kv_cache_gb, seed=args.seed,
        max_num_batched_tokens=max(8192, args.max_model_len or 0), spec=args.spec, spec_k=args.spec_k,
        num_threads=args.threads, drafter=DrafterSpec.parse(getattr(args, "drafter", "none")),
        enforce_eager=args.enforce_eager, strategy_trace=args.strategy_trace, **settings,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from service.engine.llm_engine import LLMEngine
    from service.params import SamplingParams

    engine = LLMEngine(_engine_config(args))
    if engine.tokenizer is None:
        logger.error("model folder %s has no tokenizer.json; cannot encode --prompt", engine.model_path)
        return 2
    prompt_ids = engine.tokenizer.encode(args.prompt)
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sample_seed,
    )
    start = time.perf_counter()
    [out] = engine.generate([prompt_ids], params)
    elapsed = time.perf_counter() - start
    n_tokens = 0
    for comp in out.outputs:
        n_tokens += len(comp.token_ids)
        text = engine.tokenizer.decode(comp.token_ids)
        sys.stdout.write(f"{args.prompt}{text}\n" if args.n == 1 else f"[{comp.index}] {args.prompt}{text}\n")
    sys.stdout.write(f"-- {n_tokens} tokens in {elapsed:.2f} s: {n_tokens / elapsed:.1f} tokens/s\n")
    return 0


def cmd_build_default(args: argparse.Namespace) -> int:
    from service.demo.default_model import ensure_default_model

    sys.stdout.write(f"{ensure_default_model()}\n")
    return 0


def read_secret(args: argparse.Namespace, name: str) -> str | None:
    """A token from its file (--NAME-file / SPECROLL_NAME_FILE), else the environment or the flag. A token given
    as a flag is readable in the process table: that works, with a warning."""
    path = getattr(args, f"{name}_file")
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"{path}: the {name.replace('_', ' ')} file is empty")
        return token
    value = getattr(args, name)
    if value and value != _env(name):
        flag = "--" + name.replace("_", "-")
        logger.warning("%s on the command line is visible to every user in the process table; prefer "
                       "%s-file or the SPECROLL_%s environment variable", flag, flag, name.upper())
    return value  # type: ignore[no-any-return]


def cmd_serve(args: argparse.Namespace) -> int:
    from service.api.generation import Limits
    from service.app import ServerConfig, run_server
    from service.backend.admission import AdmissionLimits
    from service.buffer.config import buffer_config_from_args
    from service.vllm.config import vllm_config_from_args

    if args.free_replaced_weights and args.weight_spare not in ("free", None):
        raise ValueError(f"--free-replaced-weights is --weight-spare free; it contradicts --weight-spare "
                         f"{args.weight_spare}")
    spare = "free" if args.free_replaced_weights else args.weight_spare or "start"
    if spare == "in-place" and args.backend == "vllm":
        raise ValueError("--weight-spare in-place is for the native backend: the vLLM backend loads pushes through "
                         "vLLM's own weight loader, which keeps no spare of ours to drop and cannot mark its "
                         "weights invalid after a failed load; start without --weight-spare")
    engine_config = _engine_config(args, compile_background=not args.compile_before_serving, weight_spare=spare)
    if args.max_upload_gb <= 0:
        raise ValueError(f"--max-upload-gb must be > 0, got {args.max_upload_gb}")
    limits = Limits(max_tokens=args.max_tokens_per_request, max_n=args.max_n,
                    max_request_bytes=args.max_request_mb * 2**20,
                    max_upload_bytes=int(args.max_upload_gb * 2**30),
                    max_message_bytes=args.max_message_mb * 2**20, stream_interval=args.stream_interval)
    config = ServerConfig(
        host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        admin_token=read_secret(args, "admin_token"), api_token=read_secret(args, "api_token"),
        redis_url=args.redis_url, served_model_name=args.served_model_name,
        load_root=tuple(args.load_root or [r for r in (_env("load_root") or "").split(os.pathsep) if r]) or None,
        limits=limits,
        buffer=buffer_config_from_args(args),
        admission=AdmissionLimits(args.max_waiting_seqs, args.max_pending_tokens, args.retry_after),
        backend=args.backend,
        vllm=vllm_config_from_args(args) if args.backend == "vllm" else None,
        control_auth=args.control_auth,
    )
    return run_server(engine_config, config)


def _serve_args(p: argparse.ArgumentParser) -> None:
    from service.config import WEIGHT_SPARES

    p.add_argument("--backend", default=_env("backend", "native"), choices=["native", "vllm"],
                   help="the engine behind the APIs: native (PyTorch, CPU or one GPU, adaptive speculation) or "
                        "vllm (GPUs, tensor/pipeline parallel; needs the specroll[vllm] extra)")
    p.add_argument("--drafter", default=_env("drafter", "auto"),
                   help="auto (suffix + the model folder's draft/ model, if any) | none | suffix | eagle[:DIR] | "
                        "draft-model folder; comma-separated for several")
    p.add_argument("--host", default=_env("host", "127.0.0.1"))
    p.add_argument("--max-waiting-seqs", type=int, default=int(_env("max_waiting_seqs", "4096")),
                   help="sequences that may wait beyond the running batch; more are refused with 503 / "
                        "RESOURCE_EXHAUSTED and Retry-After (0: no bound)")
    p.add_argument("--max-pending-tokens", type=int, default=int(_env("max_pending_tokens", "16000000")),
                   help="prompt + max_tokens of all unfinished sequences beyond which new requests are refused "
                        "(0: no bound)")
    p.add_argument("--retry-after", type=int, default=int(_env("retry_after", "2")),
                   help="seconds a refused client is told to wait (Retry-After)")
    p.add_argument("--http-port", type=int, default=int(_env("http_port", "8000")))
    p.add_argument("--grpc-port", type=int, default=int(_env("grpc_port", "50051")))
    p.add_argument("--admin-token", default=_env("admin_token"),
                   help="bearer token for weight, pause/resume/abort and reward calls (they are refused without)")
    p.add_argument("--admin-token-file", default=_env("admin_token_file"),
                   help="file holding the admin token (preferred: a flag's value is visible in the process table)")
    p.add_argument("--control-auth", default=_env("control_auth", "token"), choices=["token", "none"],
                   help="token: control calls (pause, resume, abort, weight loads) need the admin token; none: they "
                        "need no token, for RL frameworks that send none, on a trusted network only (a warning is "
                        "logged and /server_info says so)")
    p.add_argument("--api-token", default=_env("api_token"), help="bearer token for generation (default: open)")
    p.add_argument("--api-token-file", default=_env("api_token_file"), help="file holding the API token")
    p.add_argument("--redis-url", default=_env("redis_url"), help="Redis for the rollout buffer")
    p.add_argument("--served-model-name", default=_env("served_model_name"))
    p.add_argument("--load-root", action="append", default=None,
                   help="only load weights from folders under this one; repeat it for several (e.g. the checkpoint "
                        "folder and /dev/shm for same-host pushes through shared memory). Environment: "
                        "SPECROLL_LOAD_ROOT, several separated by ':'")
    p.add_argument("--max-tokens-per-request", type=int, default=int(_env("max_tokens_per_request", "0")) or None,
                   help="largest max_tokens a request may ask for, per sample (default: max_model_len, less the "
                        "prompt)")
    p.add_argument("--max-n", type=int, default=int(_env("max_n", "64")))
    p.add_argument("--max-request-mb", type=int, default=int(_env("max_request_mb", "16")))
    p.add_argument("--max-upload-gb", type=float, default=float(_env("max_upload_gb", "64") or 64),
                   help="largest safetensors upload, in GiB (fractions allowed, e.g. 0.5)")
    p.add_argument("--compile-before-serving", action="store_true",
                   default=_env("compile_before_serving", "") not in ("", "0", "false"),
                   help="native backend on CPU: compile the forwards before answering (default: answer at once "
                        "with eager forwards, compile in the background and switch when done)")
    p.add_argument("--weight-spare", default=_env("weight_spare"), choices=list(WEIGHT_SPARES),
                   help="native backend: the buffer a weight push is loaded into. start (default): a copy of the "
                        "weights made at start, so the first push is as fast as the rest; on-demand: made by the "
                        "first push; both keep the weights a push replaced as the next push's buffer (memory: "
                        "twice the weights). free: a new buffer per push, the replaced weights freed after its "
                        "swap (slower pushes, twice the weights only during one); in-place: no second copy "
                        "ever: a push pauses generation (its mode: wait, abort or keep), loads into the serving "
                        "weights and resumes; one failing after its first write leaves the server not ready "
                        "until a complete push (docs/weights.md)")
    p.add_argument("--free-replaced-weights", action="store_true",
                   default=_env("free_replaced_weights", "") not in ("", "0", "false"),
                   help="the same as --weight-spare free")
    p.add_argument("--stream-interval", type=int, default=int(_env("stream_interval", "8")),
                   help="gRPC Generate streams a sample's tokens in chunks of this many (1: every step); "
                        "fewer, larger messages leave more CPU to decoding")
    p.add_argument("--max-message-mb", type=int, default=int(_env("max_message_mb", "8")),
                   help="gRPC message size limit (weight chunks are at most 4 MiB)")
    from service.buffer.config import add_buffer_args

    add_buffer_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specroll", description="Rollout server with lossless adaptive SD")
    parser.add_argument("--log-level", default=_env("log_level", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from one prompt and print text and tokens/s")
    _engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--drafter", default=_env("drafter", "none"), help="none | suffix | eagle[:DIR] | draft folder")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve gRPC and HTTP APIs over one engine")
    _engine_args(serve)
    _serve_args(serve)
    from service.vllm.config import add_vllm_args

    add_vllm_args(serve)
    serve.set_defaults(func=cmd_serve)

    from drafter_trainer.cli import add_subcommand

    add_subcommand(sub)

    build = sub.add_parser("build-default-model", help="build (or find) the embedded default model; print its folder")
    build.set_defaults(func=cmd_build_default)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
