"""Command line: `python -m loadtest compare ...`, `report DIR`, `sync-k8s`.

Locust (and with it gevent's monkey-patching) is imported only for `compare`.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from loadtest.workloads import PROFILES

HERE = Path(__file__).resolve().parent
# What the in-cluster locust needs (the locustfile and what it imports): copied to k8s/code/.
K8S_CODE = ["__init__.py", "locustfile.py", "metrics.py", "openai_api.py", "plan.py",
            "workloads.py"]


def sync_k8s(code_dir: Path = HERE / "k8s" / "code") -> list[Path]:
    """Copy the locust modules into loadtest/k8s/code/ (kustomize's configMapGenerator)."""
    code_dir.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(HERE / name, code_dir / name)) for name in K8S_CODE]


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

    r = sub.add_parser("report", help="rewrite report.md and the plots of a results folder")
    r.add_argument("folder")

    sub.add_parser("sync-k8s", help="copy the locustfile and its modules to loadtest/k8s/code/")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from loadtest.report import write_report
        print(write_report(args.folder))
        return 0
    if args.command == "sync-k8s":
        for path in sync_k8s():
            print(f"copied {path}")
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
