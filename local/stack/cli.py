"""Launcher of the local stack: simulated vLLM groups, the picker, Envoy Gateway + Envoy.

    python -m local.stack up     [options]   start, wait until healthy, leave it running
    python -m local.stack down   [--name N]  stop a stack started by `up`
    python -m local.stack status [--name N]  what runs and whether it is healthy
    python -m local.stack reset  [--name N]  restart its simulators and picker (cold caches)
    python -m local.stack key    [--name N] [--client C]  print its throw-away API key
    python -m local.stack demo   [options]   up, compare both ports with loadtest, down

The command line (local/stack/README.md has the modules); nothing imports it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from local import dataplane
from loadtest.workloads import DEMO_SCALE
from local.stack.api_keys import read_api_keys
from local.stack.config import (API_CLIENTS, API_KEYS_FILE, EDGE_SECURITY, ENGINES, RUN_ROOT,
                                 VLLM_STARTUP_TIMEOUT, StackConfig, StackError)
from local.stack.demo import DEMO_ORDERS, DEMO_SPEEDUP, demo, demo_config, demo_real_engine
from local.stack.launcher import Stack, describe, down, reset, status


def show_key(name: str, client: str, run_root: Path = RUN_ROOT) -> int:
    """Print the throw-away API key of `client` of stack `name` (for OPENAI_API_KEY, curl...)."""
    path = Path(run_root) / name / API_KEYS_FILE
    keys = read_api_keys(path)
    if client not in keys:
        print(f"no API key for client {client!r} in {path} (is stack {name!r} up, with edge security?)",
              file=sys.stderr)
        return 1
    print(keys[client])
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m local.stack", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("up", "down", "status", "reset", "demo", "key"):
        s = sub.add_parser(name)
        s.add_argument("--name", default="local", help="run folder <run-root>/<name>")
        s.add_argument("--run-root", type=Path, default=RUN_ROOT, help="where run folders live (default runs/)")
        if name in ("up", "demo"):
            d = demo_config() if name == "demo" else StackConfig()  # the defaults live there
            s.add_argument("--groups", type=int, default=d.groups, help="simulated vLLM groups (stable)")
            s.add_argument("--engine", choices=ENGINES, default="sim",
                           help="what serves each group: the simulator (default) or real vLLM's CPU "
                                "build with the tiny model (`make vllm` first; real time: --speedup "
                                "and --kv-scale do not apply)")
            s.add_argument("--speedup", type=float, default=d.speedup,
                           help=f"simulator time speedup (default: {StackConfig.speedup:g} for up, "
                                f"{DEMO_SPEEDUP:g} for demo)")
            s.add_argument("--scrape-interval", type=float, dest="picker_scrape_interval",
                           help="picker scrape interval in MODEL seconds (default: the picker's, "
                                "0.1); the picker gets it divided by the speedup")
            s.add_argument("--staleness", type=float, dest="picker_staleness",
                           help="picker staleness in MODEL seconds (default: the picker's, 1.0)")
            s.add_argument("--seed", type=int, default=d.seed)
            s.add_argument("--body-mode", choices=["buffered", "full-duplex"],
                           help="request body mode of the EnvoyExtensionPolicy (default: base/gateway's, "
                                "full-duplex; buffered renders with components/buffered-body)")
            s.add_argument("--canary", action="store_true", help="overlays/a10-canary: extra canary group + weights")
            s.add_argument("--edge-security", action=argparse.BooleanOptionalAction, default=d.edge_security,
                           help=f"render {EDGE_SECURITY} (API keys, rate limits, connection limit) with "
                                "throw-away keys (default: on; --no-edge-security: open listeners)")
            s.add_argument("--token-budget", action="store_true",
                           help="components/token-budget: per-client token budgets (Envoy Gateway's global "
                                "rate limit; starts Redis and the Envoy rate limit service)")
            s.add_argument("--tls", action="store_true",
                           help="TLS on both listeners and the verified picker hop (components/gateway-tls, "
                                "components/picker-tls) with a CA made at start: <run>/tls/ca.crt")
            s.add_argument("--profile", default=d.profile, help="picker scheduling profile")
            s.add_argument("--sim-base-port", type=int, default=d.sim_base_port)
            s.add_argument("--sim-ports", type=int, nargs="+")
            s.add_argument("--http-port", type=int, help="listener http (default: 8080 + "
                           f"{dataplane.LISTENER_PORT_OFFSET} = 18080)")
            s.add_argument("--llm-port", type=int, help="listener llm-gw (default: 8081 + "
                           f"{dataplane.LISTENER_PORT_OFFSET} = 18081)")
            s.add_argument("--picker-grpc-port", type=int, default=d.picker_grpc_port)
            s.add_argument("--picker-health-port", type=int, default=d.picker_health_port)
            s.add_argument("--picker-metrics-port", type=int, default=d.picker_metrics_port)
            s.add_argument("--pickers", type=int, default=d.pickers,
                           help="picker replicas (default 1). 2 or more run as base/picker runs "
                                "them: active-passive on a Lease of a real API server (etcd and "
                                "the project's kube-apiserver start too), linked, all in the "
                                "gateway's picker Backend; replica i listens on the first's ports + 10 x i")
            s.add_argument("--picker-outcomes-port", type=int, default=d.picker_outcomes_port,
                           help="the picker's outcome port (Envoy's access log service)")
            s.add_argument("--sim-arg", action="append", default=[], help="extra simulator argument (repeat)")
            s.add_argument("--picker-arg", action="append", default=[], help="extra picker argument (repeat)")
            s.add_argument("--startup-timeout", type=float, default=d.startup_timeout)
            s.add_argument("--precise-prefix", action=argparse.BooleanOptionalAction,
                           default=d.precise_prefix,
                           help="the simulators publish KV-cache events and the picker routes on "
                                "them (default); --no-precise-prefix: its approximate index only")
            s.add_argument("--kv-events-base-port", type=int, default=d.kv_events_base_port,
                           help="group i's KV-event publisher port is this + 2i, its replay "
                                "socket the next")
            s.add_argument("--tokenizer", type=Path,
                           help="the model's tokenizer directory (default: the tiny model's, "
                                "built on start)")
            s.add_argument("--kv-scale", type=int, default=d.kv_scale,
                           help="simulators get the engine model's KV capacity / this (default: 1 for up, "
                                f"{DEMO_SCALE} for demo, whose workload is the article's / {DEMO_SCALE})")
        if name == "key":
            s.add_argument("--client", default="loadtest", choices=API_CLIENTS,
                           help="whose key: loadtest (the load generators' rate limit) or user (any other client's)")
        if name == "up":
            s.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the stack")
        if name == "demo":
            s.add_argument("--workload", default="demo")
            s.add_argument("--out", type=Path)
            s.add_argument("--warm", action="store_true",
                           help="keep the simulators' caches and the picker's state between runs (default: "
                                "restart both before every run, so no run depends on the one before)")
            s.add_argument("--order", choices=DEMO_ORDERS, default="http-first",
                           help="which listener loadtest compare loads first: http (least request, the "
                                "default) or llm-gw (through the picker); the repetition then swaps them")
    return p


def config_from(args: argparse.Namespace) -> StackConfig:
    real = args.engine == "vllm"
    return StackConfig(
        name=args.name, engine=args.engine, groups=args.groups, speedup=1.0 if real else args.speedup,
        seed=args.seed, body_mode=args.body_mode,
        canary=args.canary, edge_security=args.edge_security, token_budget=args.token_budget, tls=args.tls,
        profile=args.profile, sim_base_port=args.sim_base_port,
        sim_ports=args.sim_ports, http_port=args.http_port, llm_port=args.llm_port,
        picker_grpc_port=args.picker_grpc_port, picker_health_port=args.picker_health_port,
        picker_metrics_port=args.picker_metrics_port, picker_outcomes_port=args.picker_outcomes_port,
        pickers=args.pickers, sim_args=[a for x in args.sim_arg for a in x.split()],
        picker_args=[a for x in args.picker_arg for a in x.split()],
        startup_timeout=max(args.startup_timeout, VLLM_STARTUP_TIMEOUT) if real else args.startup_timeout,
        picker_scrape_interval=args.picker_scrape_interval, picker_staleness=args.picker_staleness,
        kv_scale=1 if real else args.kv_scale, run_root=args.run_root, precise_prefix=args.precise_prefix,
        tokenizer=args.tokenizer, kv_events_base_port=args.kv_events_base_port)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(argv)
    if rest and args.command != "demo":
        parser().error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo" and any(a == "--ports" or a.startswith("--ports=") for a in rest):
        parser().error("demo compares both listeners: choose which goes first with --order, not --ports")
    if args.command == "down":
        return down(args.name, args.run_root)
    if args.command == "status":
        return status(args.name, args.run_root)
    if args.command == "reset":
        return reset(args.name, args.run_root)
    if args.command == "key":
        return show_key(args.name, args.client, args.run_root)
    config = config_from(args)
    # Ctrl-C and SIGTERM both unwind through Stack.start/stop, which stop every process group.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # also when started in the background (SIGINT ignored)
    try:
        if args.command == "demo" and config.engine == "vllm":
            return demo_real_engine(config)
        if args.command == "demo":
            return demo(config, args.out, args.workload, rest, warm=args.warm, order=args.order)
        stack = Stack(config).start()
        print(describe(stack), flush=True)
        if args.foreground:
            try:
                while all(p.popen.poll() is None for p in stack.procs):
                    time.sleep(0.5)
                print("a process exited; stopping the stack", file=sys.stderr)
                return 1
            finally:
                stack.stop()
        print(f"stop it with: python -m local.stack down --name {config.name}   (or make down)")
        return 0
    except (StackError, dataplane.DataPlaneError) as e:
        print(f"local.stack: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; the stack was stopped", file=sys.stderr)
        return 130
