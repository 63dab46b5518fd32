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


# What `demo --engine vllm` sends through each listener: (API, streamed). Functional only: the
# CPU engine with a tiny model has no A10 timing, so there is nothing to compare in figures.
REAL_ENGINE_CALLS = (("completions", False), ("completions", True), ("chat", False), ("chat", True))


def _served_per_group(stack: Stack) -> dict[str, float]:
    """vllm:request_success_total summed per group (from its own /metrics)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for sim in stack.topology.sims:
        with urllib.request.urlopen(f"http://{sim.address}/metrics", timeout=10) as r:
            text = r.read().decode()
        out[sim.address] = sum(s.value for f in text_string_to_metric_families(text)
                               for s in f.samples if s.name == "vllm:request_success_total")
    return out


def real_engine_call(client, model: str, api: str, stream: bool, max_tokens: int = 12) -> int:
    """One request with the official OpenAI client; the completion tokens it reported."""
    prompt = "the model thinks about this step and then answers with a short note"
    kwargs = {"model": model, "max_tokens": max_tokens, "extra_body": {"ignore_eos": True}}
    if stream:
        kwargs.update(stream=True, stream_options={"include_usage": True})
    if api == "chat":
        resp = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs)
    else:
        resp = client.completions.create(prompt=prompt, **kwargs)
    if not stream:
        return resp.usage.completion_tokens
    usage = [chunk.usage for chunk in resp if chunk.usage is not None]
    return usage[-1].completion_tokens if usage else 0


def demo_real_engine(config: StackConfig, max_tokens: int = 12) -> int:
    """Real vLLM groups behind the gateway: completions and chat, streamed or not, through both
    listeners (http: Envoy's least request; llm-gw: the picker). Prints a table and which group
    served how many; 0 when every call returned its max_tokens tokens."""
    import openai

    failures = 0
    with Stack(config) as stack:
        print(describe(stack), flush=True)
        before = _served_per_group(stack)
        rows = ["| listener | API | stream | result |", "|---|---|---|---|"]
        for listener, port in stack.listener_ports().items():
            client = openai.OpenAI(base_url=f"http://{config.host}:{port}/v1",
                                   api_key=stack.api_key() or "none", max_retries=0, timeout=120)
            for api, stream in REAL_ENGINE_CALLS:
                try:
                    tokens = real_engine_call(client, "qwq", api, stream, max_tokens)
                    result = f"{tokens} tokens" + ("" if tokens == max_tokens else " (expected "
                                                   f"{max_tokens})")
                    failures += tokens != max_tokens
                except openai.OpenAIError as e:
                    result, failures = f"error: {e}"[:120], failures + 1
                rows.append(f"| {listener} ({port}) | {api} | {'yes' if stream else 'no'} | {result} |")
        after = _served_per_group(stack)
    print("\n".join(rows))
    print("requests served per vLLM group: " + ", ".join(
        f"{addr} {after[addr] - before.get(addr, 0):.0f}" for addr in after))
    return 1 if failures else 0
