"""`make bench-picker`: the picker's decision throughput, latency and CPU, both ext_proc servers.

    python -m bench.picker [--seconds 5] [--streams 64] [--endpoints 3,16,64]
                           [--modes buffered,full-duplex] [--servers native,python]
                           [--rates 250,500,750,1000 --hold 0.064] [--repeat 3] [--response-phase]
                           [--parts inprocess,grpc,profile,pod,long,scrape] [--json FILE]

Parts: in process, through gRPC and scraping (service.py), where the server's CPU goes
(profile.py), one pod with its workers (scale.py's workers_bench), long prompts (longprompt.py).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile

from bench.picker.service import (LOAD_CLIENT, _write_bodies, bench_grpc, bench_inprocess, bench_scrape,
                                  grpc_line)

# The pod comparison: today's deployment (base/picker: 2 workers) on the Python server first.
POD_CONFIGS = [("python", 2), ("native", 1), ("native", 2)]


def main() -> None:
    from picker.defaults import SCRAPE_INTERVAL
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--streams", type=int, default=64, help="closed-loop concurrent streams")
    p.add_argument("--endpoints", default="3,16,64")
    p.add_argument("--modes", default="buffered,full-duplex", help="request body modes to run")
    p.add_argument("--servers", default="native,python",
                   help="ext_proc servers to run side by side (each configuration on each, in turn)")
    p.add_argument("--parts", default="inprocess,grpc,profile,pod,long,scrape",
                   help="what to run: inprocess, grpc, profile (perf: where the server's CPU goes), pod "
                        "(python -m picker --workers N, the deployed process tree), long (32k/100k-token "
                        "prompts), scrape")
    p.add_argument("--rates", default="250,500,750,1000",
                   help="open-loop new streams per second (list)")
    p.add_argument("--hold", type=float, default=0.064,
                   help="open-loop seconds each stream stays open (rate x hold streams open at once)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of the closed loop and of each rate, interleaved; reported: the "
                        "median-throughput closed run, each rate's median-p99 run")
    p.add_argument("--response-phase", action="store_true",
                   help="also send response_headers (a policy with a response phase); by default only "
                        "the request phase, as the deployed EnvoyExtensionPolicy configures")
    p.add_argument("--scrape-interval", type=float, default=SCRAPE_INTERVAL)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args()
    if not os.access(LOAD_CLIENT, os.X_OK):
        raise SystemExit(f"{LOAD_CLIENT} not found: build it with `make bench-picker` "
                         "(or set PICKER_LOADCLIENT)")
    sizes = [int(x) for x in a.endpoints.split(",")]
    parts = set(a.parts.split(","))
    servers = a.servers.split(",")
    results = {"machine": {"cpus": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0]},
               "inprocess": [], "grpc": [], "scrape": None, "servers": servers}
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared machine?)")
    if "inprocess" in parts:
        print("\nRouter.decide() in process (default profile, ~4,000-token prompts):")
        for n in sizes:
            r = bench_inprocess(n)
            results["inprocess"].append(r)
            print(f"  {n:3d} endpoints: {r['decisions_per_s']:8.0f} decisions/s  "
                  f"p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms")
    rates = [float(x) for x in a.rates.split(",") if x]
    if "grpc" in parts:
        print(f"\nthrough gRPC (plaintext, ~24 KB bodies, Go load client), {a.seconds:g} s per run; "
              "latency = stream opened -> routing answer received; servers side by side: "
              + ", ".join(servers))
        print(f"  closed = {a.streams} streams back to back (max throughput; latency is mostly queueing)")
        print(f"  open   = {a.rates} new streams/s, each held open {a.hold:g} s after its answer "
              f"({'with' if a.response_phase else 'without'} a response phase); {a.repeat} runs per "
              "rate, interleaved: the median-p99 run, [every run's p99]")
        print("  decide = the server's own decide() time (picker_decision_duration_seconds) in that run")
        with tempfile.TemporaryDirectory() as tmp:
            bodies = os.path.join(tmp, "bodies.jsonl")
            _write_bodies(bodies)
            for mode in a.modes.split(","):
                print(f" {mode}:")
                for n in [None] + sizes:
                    for server in servers:  # side by side: each configuration on each server in turn
                        r = bench_grpc(n, mode, a.streams, a.seconds, rates, a.hold, bodies,
                                       a.response_phase, a.repeat, server)
                        results["grpc"].append(r)
                        print("  " + grpc_line(r))
    if "profile" in parts:
        from bench.picker import profile
        with tempfile.TemporaryDirectory() as tmp:
            bodies = os.path.join(tmp, "bodies.jsonl")
            _write_bodies(bodies)
            results["profile"] = profile.run(servers, a.seconds, bodies)
    if "pod" in parts:
        from bench.picker.scale import workers_bench
        print("\none picker pod (python -m picker --workers N, signals process included), 16 endpoints, "
              "64 streams closed loop over 4 connections, buffered:")
        with tempfile.TemporaryDirectory() as tmp:
            bodies = os.path.join(tmp, "bodies.jsonl")
            _write_bodies(bodies)
            configs = [(s, w) for s, w in POD_CONFIGS if s in servers]
            results["pod"] = workers_bench(16, configs, a.seconds, a.repeat, bodies)
        for r in results["pod"]:
            print(f"  {r['server']:>6} x{r['workers']}: {r['decisions_per_s']:6.0f}/s "
                  f"{[round(x['decisions_per_s']) for x in r['repeats']]}, p50 {r['p50_ms'] or 0:.1f} "
                  f"p99 {r['p99_ms'] or 0:.1f} ms, {r['server_cpu_cores']:.2f} cores, "
                  f"{r['server_cpu_ms_per_request']:.2f} ms CPU/decision")
    if "long" in parts:
        from bench.picker import longprompt
        results["long"] = longprompt.run(servers, a.seconds, print)
    if "scrape" in parts:
        s = bench_scrape(64, a.scrape_interval, a.seconds)
        results["scrape"] = s
        print(f"\nscraping {s['endpoints']} endpoints every {s['interval_s']} s ({s['page_bytes']} B pages): "
              f"{s['scrapes_per_s']:.0f} scrapes/s, {s['cpu_cores']:.2f} CPU cores, "
              f"{s['cpu_ms_per_scrape']:.2f} ms CPU per scrape, {s['ready_endpoints']} ready")
    results["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    results["machine"]["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
