"""The self-check's sampler test on MRv2's compiled Triton kernels, on a GPU machine without vLLM.

vLLM's CUDA builds verify drafts with the V2 model runner's rejection kernels by default; those files are
plain Triton and need little of vLLM. This script serves `vllm.*` imports from a folder of vLLM's sources
(no vLLM package initialisation: `vllm.triton_utils` is a stub over the real triton), then runs
`service/vllm/sampler_check.py` on `mrv2_verifier` on the GPU and prints one JSON line. Without CUDA or triton
it prints why it skipped and exits 0.

    .venv-vllm/bin/python -m bench.mrv2_sampler_gpu --export /tmp/vllm-src   # on a machine with vLLM
    python3 -m bench.mrv2_sampler_gpu --vllm-src /tmp/vllm-src              # on the GPU machine
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import shutil
import sys
import types
from pathlib import Path

# the parts of vLLM the kernels import (package folders, relative to vllm/)
KERNEL_DIRS = ("v1/worker/gpu/spec_decode", "v1/worker/gpu/sample", "v1/watermarking")


class _VllmSources(importlib.abc.MetaPathFinder):
    """vllm.<a>.<b> from <root>/<a>/<b>.py; packages as empty modules (their __init__ is not run);
    vllm.triton_utils as a stub over triton."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != "vllm" and not name.startswith("vllm."):
            return None
        if name == "vllm.triton_utils":
            return importlib.machinery.ModuleSpec(name, _TritonStub(), is_package=False)
        rel = Path(*name.split(".")[1:])
        if name != "vllm" and (file := self.root / rel.with_suffix(".py")).is_file():
            return importlib.util.spec_from_file_location(name, file)
        if (self.root / rel).is_dir():
            spec = importlib.machinery.ModuleSpec(name, _Empty(), is_package=True)
            spec.submodule_search_locations = [str(self.root / rel)]
            return spec
        return None


class _Empty(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _TritonStub(_Empty):
    def exec_module(self, module: types.ModuleType) -> None:
        import triton
        import triton.language as tl
        import triton.language.extra.libdevice as tldevice

        module.__dict__.update(HAS_TRITON=True, triton=triton, tl=tl, tldevice=tldevice,
                               LOG2E=1.4426950408889634, LOGE2=0.6931471805599453)


def export(dest: Path) -> None:
    """Copy the kernel folders out of the installed vLLM (run where vLLM is installed)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("no vllm installed here to export from")
    root = Path(spec.origin).parent
    for rel in KERNEL_DIRS:
        shutil.copytree(root / rel, dest / rel, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    print(json.dumps({"exported": str(dest), "from": str(root)}))


def run(src: Path) -> dict:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"needs torch and triton: {exc}"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    if not (src / "v1/worker/gpu/spec_decode/rejection_sampler_utils.py").is_file():
        return {"skipped": f"no vLLM kernel sources under {src} (make them with --export)"}
    sys.meta_path.insert(0, _VllmSources(src))
    from service.vllm.sampler_adapters import mrv2_verifier
    from service.vllm.sampler_check import run_check

    result = run_check(mrv2_verifier("cuda"), "cuda")
    return result | {"device": torch.cuda.get_device_name(), "triton": sys.modules["triton"].__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-src", type=Path, default=Path("/tmp/vllm-src"),
                    help="a folder with vLLM's kernel sources (vllm/ layout), as --export writes it")
    ap.add_argument("--export", type=Path, help="copy the kernel sources of the installed vLLM here and exit")
    args = ap.parse_args(argv)
    if args.export:
        export(args.export)
        return 0
    result = run(args.vllm_src)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result.get("skipped") or result.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
