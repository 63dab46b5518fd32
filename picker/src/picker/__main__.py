"""python -m picker ... (see config.py / README.md)."""
from __future__ import annotations

import logging
import os
import sys
import tempfile

from picker.config import parse_args
from picker.observability.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    with tempfile.TemporaryDirectory(prefix="picker-metrics-") as metrics_dir:
        if args.workers > 1:
            # Before prometheus_client is imported: every worker's counters go to files there,
            # summed when /metrics is scraped (app.App._metrics_registry).
            os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", metrics_dir)
        from picker.app import run
        from picker.runtime import run_loop
        try:
            run_loop(run(args))
        except ValueError as exc:  # bad profile, objects or certificates: a clear message, exit 2
            logging.getLogger("picker").error("configuration error", extra={"error": str(exc)})
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
