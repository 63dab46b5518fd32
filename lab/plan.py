"""How many groups for this traffic: fixed pools and the shipped autoscaler on a trace, in virtual
time (lab/autoscale.py), against a TTFT objective.

    python -m lab plan --trace day.jsonl --slo 20 [--attainment 95] [--pools 2 3 4 5 6]
                       [--seeds 0 1 2 3 4] [--startup 600] [--json OUT]

For each fixed pool and for the scaler settings of components/autoscaling/scaledobject.yaml:
P90 TTFT, SLO attainment (share of requests with TTFT <= --slo; failed requests count as
missed) and group-hours, mean over seeds (each seed draws new prompt words and routing
randomness; the trace's arrivals stay). The answer is the smallest fixed pool whose mean
attainment reaches --attainment, and how the scaler compares with it.
"""
from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np

from lab.autoscale import STARTUP_S, ScalerSettings, ScalingLab, slo_figures
from lab.policies import make_policy
from lab.simulation import LabConfig, prepare_requests
from local.sim.engines import A10_QWQ32B
from loadtest.traces import trace_workload

KEYS = ("p90_ttft_s", "slo_attainment_pct", "group_hours", "failed")
POLICY = "least-request"


def run_day(trace: str, seed: int, slo_s: float, groups: Optional[int] = None,
            scaler: Optional[ScalerSettings] = None, startup_s: float = STARTUP_S,
            policy: str = POLICY) -> dict:
    """One run: a fixed pool of `groups`, or `scaler` starting at its minimum."""
    requests = prepare_requests(trace_workload(seed, trace), A10_QWQ32B.block_size)
    size = 2 * scaler.max_groups if scaler else groups      # room for groups still draining
    config = LabConfig(num_engines=size, concurrency=None, seed=seed)
    started = time.perf_counter()
    lab = ScalingLab(requests, make_policy(policy), config, scaler,
                     scaler.min_groups if scaler else groups, startup_s)
    run = lab.run()
    out = {**slo_figures(run.samples, slo_s), "group_hours": run.summary["group_hours"],
           "requests": len(run.samples), "wall_seconds": time.perf_counter() - started}
    if scaler:
        out["timeline"] = [[round(t), r, s, round(sig, 1)] for t, r, s, sig in lab.timeline]
    return out


def _job(args):
    name, trace, seed, slo_s, groups, scaler, startup_s = args
    return name, seed, run_day(trace, seed, slo_s, groups, scaler, startup_s)


def evaluate(trace: str, slo_s: float, pools: list[int], seeds: list[int],
             scaler: Optional[ScalerSettings], startup_s: float = STARTUP_S, jobs: int = 1) -> dict:
    """name ('fixed-N' | 'scaler') -> {'runs': [...per seed], key: mean}."""
    work = [(f"fixed-{n}", trace, seed, slo_s, n, None, startup_s) for n in pools for seed in seeds]
    if scaler:
        work += [("scaler", trace, seed, slo_s, None, scaler, startup_s) for seed in seeds]
    results: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        for name, seed, run in pool.map(_job, work) if jobs > 1 else map(_job, work):
            results.setdefault(name, {"runs": []})["runs"].append({"seed": seed, **run})
            print(f"  {name} seed {seed}: P90 TTFT {run['p90_ttft_s']:.1f} s, SLO "
                  f"{run['slo_attainment_pct']:.1f} %, {run['group_hours']:.1f} group-hours, "
                  f"{run['wall_seconds']:.0f} s wall", file=sys.stderr, flush=True)
    for entry in results.values():
        for key in KEYS:
            values = [r[key] for r in entry["runs"]]
            entry[key] = float(np.mean(values))
            entry[f"{key}_std"] = float(np.std(values))
    return results


def answer(results: dict, attainment_pct: float) -> dict:
    """The smallest fixed pool meeting the attainment, and the scaler against it."""
    fixed = sorted((int(k.split("-")[1]), v) for k, v in results.items() if k.startswith("fixed-"))
    meeting = [(n, v) for n, v in fixed if v["slo_attainment_pct"] >= attainment_pct]
    out: dict = {"attainment_target_pct": attainment_pct,
                 "smallest_fixed_pool": meeting[0][0] if meeting else None}
    if meeting and "scaler" in results:
        best, scaler = meeting[0][1], results["scaler"]
        out["scaler_attainment_minus_fixed_pts"] = scaler["slo_attainment_pct"] - best["slo_attainment_pct"]
        out["scaler_group_hours_saved_pct"] = 100.0 * (1 - scaler["group_hours"] / best["group_hours"])
    return out


def table(results: dict, slo_s: float) -> str:
    lines = [f"| pool | P90 TTFT (s) | SLO attainment (TTFT <= {slo_s:g} s) | group-hours | failed |",
             "|---|---|---|---|---|"]
    order = sorted((k for k in results if k.startswith("fixed-")), key=lambda k: int(k.split("-")[1]))
    for name in order + (["scaler"] if "scaler" in results else []):
        r = results[name]
        label = f"fixed {name.split('-')[1]}" if name != "scaler" else "autoscaled (shipped settings)"
        lines.append(f"| {label} | {r['p90_ttft_s']:.1f} ± {r['p90_ttft_s_std']:.1f} | "
                     f"{r['slo_attainment_pct']:.1f} % ± {r['slo_attainment_pct_std']:.1f} | "
                     f"{r['group_hours']:.1f} ± {r['group_hours_std']:.1f} | {r['failed']:.0f} |")
    return "\n".join(lines)


def main(args) -> int:
    scaler = None if args.no_scaler else ScalerSettings.from_scaled_object()
    started = time.perf_counter()
    results = evaluate(str(args.trace), args.slo, args.pools, args.seeds, scaler, args.startup, args.jobs)
    verdict = answer(results, args.attainment)
    print(table(results, args.slo))
    n = verdict["smallest_fixed_pool"]
    print(f"\n{n} groups meet {args.attainment:g} % of requests with TTFT <= {args.slo:g} s"
          if n else f"\nno pool of {args.pools} meets {args.attainment:g} % with TTFT <= {args.slo:g} s")
    if "scaler_group_hours_saved_pct" in verdict:
        print(f"autoscaled: {verdict['scaler_attainment_minus_fixed_pts']:+.1f} points of attainment, "
              f"{verdict['scaler_group_hours_saved_pct']:.0f} % fewer group-hours than {n} fixed groups")
    if args.json:
        doc = {"trace": str(args.trace), "slo_s": args.slo, "seeds": args.seeds, "startup_s": args.startup,
               "policy": POLICY, "scaler": scaler.__dict__ if scaler else None, "answer": verdict,
               "results": results, "wall_seconds": time.perf_counter() - started}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=lambda o: o.__dict__))
    return 0
