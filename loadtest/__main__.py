"""Command line: `python -m loadtest compare ...`, `sweep ...`, `report DIR`.

Locust (and with it gevent's monkey-patching) is imported only for `compare` and `sweep`, after
the arguments are checked and every target port has answered.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loadtest.metrics import parse_goodput, parse_percentiles
from loadtest.targets import CLUSTER_PORTS, LOCAL_PORTS, default_ports, describe_ports
from loadtest.workloads import WORKLOADS


def _add_run_options(c: argparse.ArgumentParser, *, repetitions: bool) -> None:
    """Options shared by compare and sweep (vLLM bench serve names where there is one)."""
    c.add_argument("--host", default="127.0.0.1",
                   help="Gateway address (local stack, or the cluster Gateway's IP/DNS name)")
    c.add_argument("--ports", type=int, nargs="+", default=None,
                   help="ports to run, the first is the baseline (default: the local stack's "
                        f"{describe_ports(LOCAL_PORTS)} for a loopback --host, else "
                        f"{describe_ports(CLUSTER_PORTS)})")
    c.add_argument("--workload", default="demo", choices=sorted(WORKLOADS))
    c.add_argument("--workload-args", default="",
                   help="workload overrides key=value,... e.g. path=sharegpt.json,output_len=256")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--num-prompts", type=int, default=None, help="default: the workload's")
    c.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int,
                   default=None, help="closed-loop users = most requests in flight (vLLM "
                   "--max-concurrency); default: the workload's (sweep: no limit)")
    c.add_argument("--burstiness", type=float, default=1.0)
    c.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    c.add_argument("--model", default="qwq")
    c.add_argument("--objective", default="", help="x-gateway-inference-objective header")
    c.add_argument("--goodput", nargs="*", default=[], type=str,
                   help="SLOs in ms like vLLM: --goodput ttft:500 tpot:50 (adds request_goodput)")
    c.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", default="50,90,99",
                   help="percentiles of TTFT/TPOT/ITL/E2E in the JSONs and the table")
    c.add_argument("--label", default="", help="label stored in the results and the report")
    c.add_argument("--speedup", type=float, default=None,
                   help="simulator speedup, to say how times read (default: from the local "
                        "stack's runs/*/state.json; 1 for a remote Gateway)")
    if repetitions:
        c.add_argument("--repetitions", type=int, default=2,
                       help="runs per port; the order alternates (A B, B A, ...)")
    c.add_argument("--metrics-endpoints", nargs="*", default=None,
                   help="vLLM servers whose /metrics are scraped during the runs (default: the "
                        "simulators of the local stack serving --ports; 'none' to skip)")
    c.add_argument("--scrape-interval", type=float, default=1.0)
    c.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds to wait for the endpoints to drain between runs")
    c.add_argument("--request-timeout", type=float, default=900.0)
    c.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compare", help="same workload against each port, then a report",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_run_options(c, repetitions=True)
    c.add_argument("--request-rate", type=float, default=0.0,
                   help="req/s with gamma gaps (0 = no pacing, as vLLM's inf)")
    c.add_argument("--out", default=None, help="results folder (default results/compare-<time>)")
    c.add_argument("--client", dest="clients", action="append", default=[], metavar="FIELDS",
                   help="a client of its own (repeat for several, all at once, open loop): "
                        "name=N,rate=REQ_S,prompts=K[,key_env=VAR][,objective=O][,burstiness=B]"
                        "[,output_len=LOW-HIGH]; its answers' lengths from that range (else the workload's), its "
                        "API key from $VAR (else the run's), its objective (else --objective); result "
                        "files then hold each client's statistics (by_client). Not with --request-rate "
                        "or --num-prompts")
    c.add_argument("--before-each-run", metavar="CMD",
                   help="shell command run before every run, e.g. one that restarts the servers and the router "
                        "so no run starts with another run's caches (`python -m local.stack reset` locally)")

    s = sub.add_parser("sweep", help="each port at several request rates: TTFT and goodput "
                       "against rate", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_run_options(s, repetitions=False)
    s.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0],
                   help="request rates (req/s, Poisson unless --burstiness) to run, in order")
    s.add_argument("--out", default=None, help="results folder (default results/sweep-<time>)")

    r = sub.add_parser("report", help="rewrite report.md and the plots of a results folder")
    r.add_argument("folder")
    return parser


def check_args(args) -> None:
    """Turn the text options into values; ValueError with the reason for a bad one."""
    args.ports = args.ports or default_ports(args.host)
    args.goodput = parse_goodput(args.goodput)
    args.percentiles = parse_percentiles(args.percentiles)
    if getattr(args, "repetitions", 1) < 1 or (args.concurrency is not None
                                                and args.concurrency < 1):
        raise ValueError("--repetitions and --concurrency must be >= 1")
    if getattr(args, "rates", None) is not None and any(r <= 0 for r in args.rates):
        raise ValueError("--rates must be > 0 req/s")
    if getattr(args, "clients", None):
        from loadtest.clients import parse_client
        args.clients = tuple(parse_client(c) for c in args.clients)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from loadtest.report import write_report, write_sweep_report
        sweep = (Path(args.folder) / "sweep.json").exists()
        print((write_sweep_report if sweep else write_report)(args.folder))
        return 0
    try:
        check_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from loadtest.targets import unreachable
    problem = unreachable(args.host, args.ports)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not args.out:
        args.out = f"results/{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        if args.command == "sweep":
            from loadtest import sweep  # imports locust: gevent monkey-patching starts here
            return sweep.main(args)
        from loadtest import compare  # imports locust: gevent monkey-patching starts here
        return compare.main(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = Path(args.out).is_dir()
        print(f"\ninterrupted: {args.command} stopped; " +
              (f"the runs that finished are in {args.out}/" if kept else
               f"no run had finished, {args.out}/ removed"), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
