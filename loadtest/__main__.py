"""Command line: `python -m loadtest compare ...`, `report DIR`.

Locust (and with it gevent's monkey-patching) is imported only for `compare`.
"""
from __future__ import annotations

import argparse
import sys

from loadtest.workloads import PROFILES

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compare", help="same workload against each port, then a report",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    c.add_argument("--host", default="127.0.0.1",
                   help="Gateway address (local stack, or the cluster Gateway's IP/DNS name)")
    c.add_argument("--ports", type=int, nargs="+", default=[8080, 8081],
                   help="ports to compare; the first is the baseline of the change column")
    c.add_argument("--workload", default="demo", choices=sorted(PROFILES))
    c.add_argument("--workload-args", default="",
                   help="profile overrides key=value,... e.g. path=sharegpt.json,output_len=256")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--num-prompts", type=int, default=None, help="default: the profile's")
    c.add_argument("--concurrency", type=int, default=None,
                   help="closed-loop users (vLLM --max-concurrency); default: the profile's")
    c.add_argument("--request-rate", type=float, default=0.0,
                   help="req/s with gamma gaps (0 = no pacing, as vLLM's inf)")
    c.add_argument("--burstiness", type=float, default=1.0)
    c.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    c.add_argument("--model", default="qwq")
    c.add_argument("--objective", default="", help="x-gateway-inference-objective header")
    c.add_argument("--repetitions", type=int, default=1,
                   help="runs per port; the order alternates (A B, B A, ...)")
    c.add_argument("--metrics-endpoints", nargs="*", default=None,
                   help="vLLM servers whose /metrics are scraped during the runs "
                        "(default: the local stack's 127.0.0.1:8101-8103; 'none' to skip)")
    c.add_argument("--scrape-interval", type=float, default=1.0)
    c.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds to wait for the endpoints to drain between runs")
    c.add_argument("--request-timeout", type=float, default=900.0)
    c.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per run")
    c.add_argument("--out", default=None, help="results folder (default results/compare-<time>)")
    c.add_argument("--before-each-run", metavar="CMD",
                   help="shell command run before every run, e.g. one that restarts the servers and the router "
                        "so no run starts with another run's caches (`python -m local.stack reset` locally)")

    r = sub.add_parser("report", help="rewrite report.md and the plots of a results folder")
    r.add_argument("folder")

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from loadtest.report import write_report
        print(write_report(args.folder))
        return 0
    if args.repetitions < 1 or (args.concurrency is not None and args.concurrency < 1):
        print("error: --repetitions and --concurrency must be >= 1", file=sys.stderr)
        return 2
    from loadtest import compare  # imports locust: gevent monkey-patching starts here
    try:
        return compare.main(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
