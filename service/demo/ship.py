"""The demo model's shipped weights: built by our own code, checked in as safetensors, verified by SHA-256.

``specroll serve`` without ``--model`` serves ``service/demo/weights/<name>`` when it is there and its files
match ``SHA256SUMS``, so a fresh machine answers in seconds instead of training for minutes first.

Rebuild them (bit-identical on the same torch build and CPU family; the thread count is pinned):

    python3 -m service.demo.ship                 # build the full size into service/demo/weights/default-v2
    python3 -m service.demo.ship --check         # rebuild in a temporary folder, compare with the shipped files
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

WEIGHTS_ROOT = Path(__file__).resolve().parent / "weights"
SUMS = "SHA256SUMS"
BUILD_THREADS = 2


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_sums(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under `folder` (but the sums file), keyed by its POSIX path relative to `folder`."""
    return {p.relative_to(folder).as_posix(): sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != SUMS}


def write_sums(folder: Path) -> dict[str, str]:
    sums = folder_sums(folder)
    (folder / SUMS).write_text("".join(f"{digest}  {name}\n" for name, digest in sums.items()), encoding="utf-8")
    return sums


def read_sums(folder: Path) -> dict[str, str]:
    sums: dict[str, str] = {}
    for line in (folder / SUMS).read_text(encoding="utf-8").splitlines():
        digest, _, name = line.partition("  ")
        sums[name] = digest
    return sums


def verified(folder: Path) -> bool:
    """Whether `folder` holds exactly the files its SHA256SUMS lists, with those contents."""
    if not (folder / SUMS).is_file():
        return False
    try:
        return folder_sums(folder) == read_sums(folder)
    except OSError:
        return False


def shipped_dir(name: str) -> Path | None:
    """The shipped, verified folder of the default model called `name`, or None."""
    folder = WEIGHTS_ROOT / name
    if not folder.is_dir():
        return None
    if not verified(folder):
        logger.warning("shipped weights in %s do not match their %s; building instead", folder, SUMS)
        return None
    return folder


def build(out: Path, size_name: str) -> dict[str, str]:
    """Build the demo model of `size_name` into `out` (replaced) with pinned threads; returns its sums."""
    from service.demo.build import build_demo, demo_size

    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        if out.exists():
            shutil.rmtree(out)
        build_demo(out, demo_size(size_name))
    finally:
        torch.set_num_threads(threads)
    return write_sums(out)


def main(argv: list[str] | None = None) -> int:
    from service.demo.default_model import model_name

    p = argparse.ArgumentParser(prog="python3 -m service.demo.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="full", help="demo size (default full)")
    p.add_argument("--root", type=Path, default=WEIGHTS_ROOT, help="where the shipped folders live")
    p.add_argument("--check", action="store_true", help="rebuild elsewhere and compare with the shipped files")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    target = args.root / model_name(args.size)
    if not args.check:
        tmp = Path(tempfile.mkdtemp(prefix=".ship-", dir=args.root if args.root.is_dir() else None))
        try:
            build(tmp / "model", args.size)
            if target.exists():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / "model", target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("shipped %s (%.1f MB)", target, sum(f.stat().st_size for f in target.rglob("*")) / 1e6)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rebuilt = build(Path(tmp) / "model", args.size)
    shipped = read_sums(target)
    differ = sorted(name for name in set(rebuilt) | set(shipped) if rebuilt.get(name) != shipped.get(name))
    if differ:
        logger.error("rebuild differs from %s in: %s", target, ", ".join(differ))
        return 1
    logger.info("rebuild is bit-identical to %s (%d files)", target, len(shipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
