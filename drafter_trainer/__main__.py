"""`python -m drafter_trainer ...` = `specroll drafter-trainer ...`."""

import sys

from service.cli import main

if __name__ == "__main__":
    sys.exit(main(["drafter-trainer", *sys.argv[1:]]))
