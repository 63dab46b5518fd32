"""Routing on learned output lengths through HTTP: the real data plane, the picker learning from
Envoy's access log.

For each workload, the local stack (3 simulator processes at speedup SPEEDUP, the picker with one
worker, Envoy Gateway + Envoy with the edge's API keys and the outcome path) runs twice: the
picker's `default` profile and its `lengths` profile (picker/README.md, "Output lengths"). In the
first stack `loadtest compare` also sends the same requests to listener http (least request).
Every run starts cold (`local.stack reset`: simulators and picker restarted), so the picker learns
the lengths from nothing during the run, as in the lab.

- `chat-reasoning`: the lab's mix, every request sent with max_tokens 16,384 (the length goes as
  min_tokens, which only the simulator reads: loadtest/openai_api.py);
- `client-mix`: three applications with their own API keys (the edge names them in x-client-id),
  whose answers differ by client only, in a KV-starved pool (0.7x, as in the lab's matrix).

The picker's forecast error (`picker_length_forecast_error_log2`) is read from its /metrics after
the llm-gw run. The lab runs the same workloads for comparison ("Routing lab: scenario matrix").
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from bench.common import PY, RESULTS, load_average, read_json, run, save, stamp
from bench.markdown import md_table, num

NAME = "lengths-http"
SPEEDUP = 20.0
PROMPTS = 150
CONCURRENCY = 30
# workload -> (workload arguments, KV capacity factor of the simulators)
WORKLOADS = {"chat-reasoning": ("cap=16384", 1.0), "client-mix": ("", 0.7)}
PROFILES = ("default", "lengths")
KEPT = ("completed", "failed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
        "output_throughput", "request_throughput", "duration")


def _config(workload: str, profile: str, seed: int):
    """The stack for one workload and profile, on free loopback ports; the picker on its
    approximate prefix index, as the lab's matrix runs it."""
    from local.sim.engines import A10_QWQ32B
    from local.stack.config import StackConfig
    from local.stack.processes import free_ports
    _, kv = WORKLOADS[workload]
    sim_args = ["--num-gpu-blocks", str(int(A10_QWQ32B.num_gpu_blocks * kv))] if kv != 1.0 else []
    ports = free_ports(9)
    return StackConfig(name=f"bench-lengths-{profile}", seed=seed, speedup=SPEEDUP, profile=profile,
                       sim_args=sim_args, sim_ports=ports[6:9], http_port=ports[0], llm_port=ports[1],
                       picker_grpc_port=ports[2], picker_health_port=ports[3],
                       picker_metrics_port=ports[4], picker_outcomes_port=ports[5],
                       precise_prefix=False)


def forecast_error(metrics_text: str) -> dict:
    """The picker's forecast errors (|log2 ratio|): count and mean over every family."""
    count = total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("picker_length_forecast_error_log2_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith("picker_length_forecast_error_log2_sum"):
            total += float(line.rsplit(" ", 1)[1])
    return {"outcomes": int(count), "mean_log2_error": total / count if count else None}


def run_stack(workload: str, profile: str, seed: int, with_http: bool, out: Path) -> dict:
    """One stack, one `loadtest compare`: listener http (least request) first when asked, then
    llm-gw through the picker with `profile`."""
    from local.stack.launcher import Stack
    config = _config(workload, profile, seed)
    args, _ = WORKLOADS[workload]
    with Stack(config) as stack:
        ports = ([stack.http_port] if with_http else []) + [stack.llm_port]
        folder = out / f"{workload}-{profile}"
        cmd = [PY, "-m", "loadtest", "compare", "--host", config.host, "--ports", *map(str, ports),
               "--workload", workload, "--seed", str(seed), "--num-prompts", str(PROMPTS),
               "--concurrency", str(CONCURRENCY), "--repetitions", "1", "--out", str(folder),
               "--metrics-endpoints", *(f"http://{s.address}" for s in stack.topology.sims),
               "--before-each-run", f"{PY} -m local.stack reset --name {config.name} "
                                    f"--run-root {config.run_root}"]
        if args:
            cmd += ["--workload-args", args]
        wall = run(cmd, log=out / f"{workload}-{profile}.log",
                   env={"OPENAI_API_KEY": stack.api_key("loadtest")})
        metrics = urllib.request.urlopen(
            f"http://{config.host}:{config.picker_metrics_port}/metrics", timeout=10).read().decode()
    result = {"wall_s": wall, "forecast": forecast_error(metrics)}
    for port, label in ((stack.llm_port, profile), (stack.http_port, "least-request")):
        path = folder / f"{port}.json"
        if path.exists():
            summary = read_json(path)
            result[label] = {k: summary.get(k) for k in KEPT}
    return result


def main(seeds: list[int] | None = None) -> dict:
    seeds = seeds or [0]
    started, load_start = time.monotonic(), load_average()
    out = RESULTS / NAME
    runs = []
    for seed in seeds:
        for workload in WORKLOADS:
            row: dict = {"seed": seed, "workload": workload}
            for i, profile in enumerate(PROFILES):
                r = run_stack(workload, profile, seed, with_http=i == 0, out=out / f"seed{seed}")
                row.update({k: v for k, v in r.items() if k in (profile, "least-request")})
                row[f"forecast_{profile}"] = r["forecast"]
                row[f"wall_{profile}"] = r["wall_s"]
            runs.append(row)
            print(f"{workload} seed {seed}: mean TTFT least request "
                  f"{row['least-request']['mean_ttft_ms']:,.0f} ms, default "
                  f"{row['default']['mean_ttft_ms']:,.0f} ms, lengths {row['lengths']['mean_ttft_ms']:,.0f} ms",
                  flush=True)
    data = {"command": f"python -m bench {NAME}", "speedup": SPEEDUP, "prompts": PROMPTS,
            "concurrency": CONCURRENCY, "seeds": seeds, "runs": runs,
            "wall_s": time.monotonic() - started, "load_average_start": load_start, **stamp()}
    save(NAME, data)
    return data


def report(d: dict) -> list[str]:
    rows = []
    for r in d["runs"]:
        lr, default, lengths = r["least-request"], r["default"], r["lengths"]
        err = r["forecast_lengths"]["mean_log2_error"]
        rows.append([r["workload"], str(r["seed"]),
                     *(f"{num(x['mean_ttft_ms'])} / {num(x['p99_ttft_ms'])} / {num(x['output_throughput'], 1)}"
                       for x in (lr, default, lengths)),
                     f"{(lengths['mean_ttft_ms'] / default['mean_ttft_ms'] - 1) * 100:+.1f} %",
                     f"{(default['mean_ttft_ms'] / lr['mean_ttft_ms'] - 1) * 100:+.1f} %",
                     f"{2 ** err:.2f}x ({r['forecast_lengths']['outcomes']})" if err is not None else "-",
                     f"{default['failed'] + lengths['failed'] + lr['failed']}"])
    return [f"Command: `{d['command']}` ({d['wall_s'] / 60:.1f} min wall; 1-minute load average "
            f"{d['load_average_start']:.1f} at the start): for each workload the local stack (3 simulator "
            f"processes at speedup {d['speedup']:g}, the picker with one worker, Envoy Gateway + Envoy, the "
            "edge's API keys, the access log to the picker) twice, the picker's `default` and `lengths` "
            f"profiles; {d['prompts']} prompts, closed loop at {d['concurrency']}, every run cold (simulators "
            "and picker restarted), listener http (least request) in the first stack. chat-reasoning: every "
            "request sends max_tokens 16,384; client-mix: three applications with their own API keys, KV "
            "0.7x. Wall-clock ms at the speedup (model time / the speedup).", "",
            "Cells: mean TTFT ms / P99 TTFT ms / output tok/s.", ""] + md_table(
        ["workload", "seed", "least request (http)", "picker default", "picker lengths",
         "lengths vs default (mean TTFT)", "default vs least request (mean TTFT)",
         "forecast error, geometric mean factor (outcomes)", "failed (all three)"], rows)
