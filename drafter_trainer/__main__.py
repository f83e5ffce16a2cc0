"""`python -m drafter_trainer ...` = `specroll drafter-trainer ...`."""

import argparse
import logging
import os
import sys

from drafter_trainer.cli import add_subcommand


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m drafter_trainer")
    parser.add_argument("--log-level", default=os.environ.get("SPECROLL_LOG_LEVEL", "INFO"))
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    log_level = [a for a in argv if a.startswith("--log-level")]
    args = parser.parse_args([*log_level, "drafter-trainer", *[a for a in argv if a not in log_level]])
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
