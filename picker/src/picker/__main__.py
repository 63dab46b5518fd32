"""python -m picker ... (see config.py / README.md)."""
from __future__ import annotations

import logging
import sys

from picker.app import run, run_loop
from picker.config import parse_args
from picker.observability.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    try:
        run_loop(run(args))
    except ValueError as exc:  # bad profile, objects or certificates: a clear message, exit 2
        logging.getLogger("picker").error("configuration error", extra={"error": str(exc)})
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
