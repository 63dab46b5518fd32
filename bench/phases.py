"""What the picker is sent: the request phase only (the deployed EnvoyExtensionPolicy) against
the request and the response phase, in the lab (5 seeds, the article and shared-prefix workloads).

    python -m bench phases

With the request phase only, Envoy closes the ext_proc stream as soon as the picker has answered,
so the picker learns nothing of a request's end; with the response phase it learns when the
response completes. The lab reports each request's end to the picker at those two moments
(`lab.picker_policy.PickerPolicy(phases=...)`), everything else equal.
"""
from __future__ import annotations

import time

from bench.common import load_average, save, stamp
from loadtest.metrics import HEADLINE_KEYS

WORKLOADS = ("article", "shared-prefix")


def run(seeds: list[int]) -> dict:
    from lab.experiment import named_workload, run_policies, summaries
    from lab.picker_policy import PickerPolicy
    from lab.policies import make_policy
    from lab.simulation import LabConfig
    from lab.stats import aggregate
    from loadtest.workloads import workload_settings
    from local.sim.engines import DEFAULT_ENGINE_MODEL, get_engine_model

    engine_model = get_engine_model(DEFAULT_ENGINE_MODEL)
    policies = {"least-request": lambda: make_policy("least-request"),
                "picker, request phase only (deployed)": lambda: PickerPolicy("default", phases="request"),
                "picker, request + response phase": lambda: PickerPolicy("default", phases="response")}
    out = {}
    for workload in WORKLOADS:
        config = LabConfig(concurrency=workload_settings(workload)["concurrency"], engine_model=engine_model)
        runs = run_policies(named_workload(workload), policies, seeds, config, workload_seed=0)
        out[workload] = {}
        for name, stats in aggregate(summaries(runs), HEADLINE_KEYS).items():
            row = {k: stats[k]["mean"] for k in HEADLINE_KEYS}
            row["sd_mean_ttft_ms"] = stats["mean_ttft_ms"]["std"]
            out[workload][name] = row
            print(f"{workload:14} {name:40} mean TTFT {row['mean_ttft_ms']:8,.0f} ms (sd {row['sd_mean_ttft_ms']:,.0f})",
                  flush=True)
    return out


def main(seeds: list[int] | None = None) -> dict:
    seeds = seeds or [0, 1, 2, 3, 4]
    started, load_start = time.monotonic(), load_average()
    data = {"command": "python -m bench phases", "seeds": seeds, "load_average_start": load_start,
            "lab": run(seeds), "wall_s": time.monotonic() - started, **stamp()}
    save("phases", data)
    return data


def report(d: dict) -> list[str]:
    lines = [f"Command: `{d['command']}` (lab, seeds {' '.join(map(str, d['seeds']))}, 3 A10 groups, the "
             "default profile): the picker told of each request's end right after its decision (request phase "
             "only: Envoy closes the stream then) or when the response completes (response phase too).", "",
             "| workload | policy | mean TTFT ms (sd) | P99 TTFT ms | output tok/s |", "|---|---|---|---|---|"]
    for workload, rows in d["lab"].items():
        for name, r in rows.items():
            lines.append(f"| {workload} | {name} | {r['mean_ttft_ms']:,.0f} ({r['sd_mean_ttft_ms']:,.0f}) | "
                         f"{r['p99_ttft_ms']:,.0f} | {r['output_throughput']:.1f} |")
    return lines
