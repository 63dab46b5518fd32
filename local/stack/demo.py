"""`python -m local.stack demo` (what `make demo` runs): a stack with the demo's simulators, both
listeners compared with `loadtest compare`, then Envoy's listener counters and the CPU of every
process, written beside the comparison's report."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from loadtest.workloads import DEMO_SCALE
from local import dataplane
from local.stack.config import REPO, StackConfig
from local.stack.launcher import Stack, describe
from local.stack.processes import children_cpu_seconds, python_env

# The demo's simulator speedup keeps the SSE chunk rate ~1,200/s, low enough that the stack's CPU
# use does not distort latencies on 2 cores (see DATAPLANE.md, "make demo"). Its scale (lengths
# and KV capacity) is loadtest.workloads.DEMO_SCALE.
DEMO_SPEEDUP = 5.0


def demo_config(**fields) -> StackConfig:
    """The configuration `python -m local.stack demo` runs by default; `fields` override it."""
    return StackConfig(**{"speedup": DEMO_SPEEDUP, "kv_scale": DEMO_SCALE, **fields})
DEMO_ORDERS = ("http-first", "picker-first")  # which listener loadtest compare runs first


def demo_command(config: StackConfig, listeners: dict[str, int], metrics_endpoints: list[str], out: Path,
                 workload: str, compare_args: list[str], warm: bool = False, order: str = "http-first") -> list[str]:
    """The `loadtest compare` command of the demo: both listeners (`listeners`: name -> port), http
    (least request) then llm-gw (picker) or, with order picker-first, llm-gw then http."""
    if order not in DEMO_ORDERS:
        raise ValueError(f"order {order!r}: expected one of {', '.join(DEMO_ORDERS)}")
    names = ["http", "llm-gw"] if order == "http-first" else ["llm-gw", "http"]
    cmd = [sys.executable, "-m", "loadtest", "compare", "--host", config.host,
           "--ports", *(str(listeners[n]) for n in names), "--workload", workload,
           "--seed", str(config.seed), "--out", str(out), "--repetitions", "2",  # A B, B A
           "--metrics-endpoints", *metrics_endpoints, *compare_args]
    if not warm:  # every run cold: its own caches and prefix index, whatever ran before
        cmd += ["--before-each-run", f"{shlex.quote(sys.executable)} -m local.stack reset --name {config.name} "
                                     f"--run-root {shlex.quote(str(config.run_root))}"]
    return cmd


def demo(config: StackConfig, out: Path | None, workload: str, compare_args: list[str], warm: bool = False,
         order: str = "http-first") -> int:
    out = out or REPO / "results" / time.strftime("demo-%Y%m%d-%H%M%S")
    with Stack(config) as stack:
        print(describe(stack), flush=True)
        before, t0 = stack.cpu_seconds(), time.monotonic()
        cmd = demo_command(config, stack.listener_ports(), [s.address for s in stack.topology.sims], out,
                           workload, compare_args, warm, order)
        print("$ python " + " ".join(cmd[1:]), flush=True)
        client_before = children_cpu_seconds()
        envoy_before = dataplane.listener_stats(stack.envoy_admin(), stack.listener_ports())
        env = python_env()
        if stack.api_key():
            env["OPENAI_API_KEY"] = stack.api_key()  # the load generator's key, not on the command line
        rc = subprocess.call(cmd, cwd=REPO, env=env)
        envoy = dataplane.stats_delta(envoy_before, dataplane.listener_stats(stack.envoy_admin(),
                                                                             stack.listener_ports()))
        after, wall = stack.cpu_seconds(), time.monotonic() - t0
        after["loadtest"] = children_cpu_seconds() - client_before  # the load generator, for comparison
    table = envoy_table(envoy, stack.listener_ports())
    print(table)
    print(cpu_table(before, after, wall))
    if out.is_dir():
        cpu = {name: after[name] - before.get(name, 0.0) for name in after}
        (out / "dataplane.json").write_text(json.dumps(
            {"wall_s": wall, "cores": os.cpu_count(), "cpu_s": cpu, "listeners": stack.listener_ports(),
             "envoy_listener_stats": envoy, "speedup": config.speedup, "workload": workload,
             "state_between_runs": "warm" if warm else "cold"}, indent=2))
    report = out / "report.md"
    if report.exists():
        with report.open("a") as f:
            f.write(f"\n## Envoy's own listener statistics\n\n{table}\n\n## CPU per process\n\n"
                    f"```\n{cpu_table(before, after, wall)}\n```\n\n"
                    + ("Runs started **warm**: simulators and picker kept their state between runs.\n" if warm else
                       "Runs started **cold**: the simulators and the picker were restarted before every run "
                       "(`python -m local.stack reset`), so no run starts with another's KV/prefix caches or "
                       "prefix index.\n"))
    return rc


def envoy_table(delta: dict[str, dict[str, int]], ports: dict[str, int]) -> str:
    """Markdown table of what Envoy counted on each listener during the comparison."""
    stats = dataplane.LISTENER_STATS
    rows = ["| listener | " + " | ".join(s.replace("downstream_", "") for s in stats) + " |",
            "|---|" + "---|" * len(stats)]
    for name, values in delta.items():
        rows.append(f"| {name} ({ports[name]}) | " + " | ".join(str(values[s]) for s in stats) + " |")
    return "\n".join(rows)


def cpu_table(before: dict[str, float], after: dict[str, float], wall: float) -> str:
    rows = [f"CPU used during the comparison ({wall:.0f} s wall, {os.cpu_count()} cores):"]
    total = 0.0
    for name in after:
        used = after[name] - before.get(name, 0.0)
        if name != "loadtest":
            total += used
        rows.append(f"  {name:<12} {used:7.1f} s  {used / wall:5.2f} cores")
    rows.append(f"  {'stack total':<12} {total:7.1f} s  {total / wall:5.2f} cores (without loadtest)")
    return "\n".join(rows)
