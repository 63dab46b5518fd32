"""Routing lab CLI.

    python -m lab run --workload article --policy least-request --policy picker \\
        --seeds 0 1 2 3 4 --out results/lab
    python -m lab calibrate [--seeds 0 1 2 3 4]    # least request vs the article's 8080 figures
    python -m lab plot results/lab                 # TTFT CDF per policy, KV usage over time
    python -m lab matrix --out results/lab-matrix  # every scenario x policy x seed (lab/matrix.py)
    python -m lab daytrace --out day.jsonl         # the day-shaped trace (lab/daytrace.py)
    python -m lab plan --trace day.jsonl --slo 20  # groups for a trace, fixed vs autoscaled (lab/plan.py)

`run` writes one JSON per (policy, seed) in vLLM's benchmark result format (plus lab fields),
`<name>.series.json` with per-endpoint KV usage / running / waiting over virtual time, and
`summary.json` + `summary.md` with the mean and spread over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from loadtest.metrics import HEADLINE_KEYS, percent_change
from loadtest.workloads import WORKLOADS, workload_settings
from local.sim.engines import DEFAULT_ENGINE_MODEL, ENGINE_MODELS, get_engine_model
from lab.article import ARTICLE
from lab.daytrace import DAY_HOURS, DAY_PEAK_RATE
from lab.experiment import named_workload, run_policies, summaries
from lab.policies import file_name, make_policy
from lab.simulation import LabConfig
from lab.stats import SUMMARY_KEYS, aggregate, versus

BASELINE = "least-request"   # the 8080 route: Envoy Gateway's least request

ARTICLE_8080 = ARTICLE["least-request"]  # Envoy Gateway least request, the calibration target


def _add_run_options(p: argparse.ArgumentParser, default_policies: list[str]) -> None:
    p.add_argument("--workload", default="article", choices=sorted(WORKLOADS))
    p.add_argument("--policy", action="append", dest="policies",
                   help="round-robin | random | least-request | picker[:PROFILE] | "
                        f"picker-upstream (repeatable; default {' '.join(default_policies)})")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--concurrency", type=int, help="client concurrency (default: the workload's)")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--engine-model", default=DEFAULT_ENGINE_MODEL, choices=sorted(ENGINE_MODELS))
    p.add_argument("--num-gpu-blocks", type=int, help="override the engine model's KV capacity")
    p.add_argument("--sharegpt-path", help="ShareGPT JSON for --workload sharegpt / sharegpt-long")
    p.add_argument("--trace", help="JSONL trace for --workload trace (loadtest/traces.py)")


def _workload(args) -> tuple[dict, dict]:
    """The workload's build options (the ShareGPT path) and its settings, --concurrency applied."""
    extra = ({"path": args.sharegpt_path} if args.workload.startswith("sharegpt")
             else {"path": args.trace} if args.workload == "trace" else {})
    settings = workload_settings(args.workload, num_prompts=args.num_prompts, **extra)
    settings["concurrency"] = args.concurrency or settings.get("concurrency")
    return extra, settings


def run_settings(args) -> dict:
    """What was run: the workload's settings and the lab's, for the machine-readable summary."""
    _, settings = _workload(args)
    settings["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    return {"workload": settings, "engines": args.engines, "engine_model": args.engine_model,
            "num_gpu_blocks": args.num_gpu_blocks or get_engine_model(args.engine_model).num_gpu_blocks}


def lab_config(args) -> LabConfig:
    """The pool and client of `run` / `calibrate` (the seed is set per run)."""
    engine_model = get_engine_model(args.engine_model)
    if args.num_gpu_blocks:
        engine_model = engine_model.with_overrides(num_gpu_blocks=args.num_gpu_blocks)
    return LabConfig(num_engines=args.engines, engine_model=engine_model,
                     concurrency=_workload(args)[1]["concurrency"], request_rate=args.request_rate)


def run_seeds(args, policies: list[str], out: Path | None) -> dict[str, list[dict]]:
    """Run every policy on every seed; returns policy -> list of summaries (one per seed)."""
    extra, _ = _workload(args)

    def on_run(name: str, seed: int, run) -> None:
        run.summary.update(workload=args.workload, wall_seconds=run.wall_s)
        print(f"  {args.workload} {name} seed {seed}: mean TTFT "
              f"{run.summary['mean_ttft_ms']:.0f} ms, {run.summary['wall_seconds']:.1f} s wall",
              file=sys.stderr, flush=True)
        if out is not None:
            ttfts = [s.ttft for s in run.samples if s.success]
            stem = f"{args.workload}-{file_name(name)}-seed{seed}"
            (out / f"{stem}.json").write_text(json.dumps({**run.summary, "ttfts": ttfts}, indent=1))
            (out / f"{stem}.series.json").write_text(json.dumps(run.series))

    workload = named_workload(args.workload, args.num_prompts, **extra)
    return summaries(run_policies(workload, policies, args.seeds, lab_config(args), on_run=on_run))


def table(agg: dict[str, dict[str, dict]], seeds: list[int]) -> str:
    lines = [f"mean ± std over seeds {' '.join(map(str, seeds))}", "",
             "| policy | " + " | ".join(SUMMARY_KEYS) + " |",
             "|---" * (len(SUMMARY_KEYS) + 1) + "|"]
    for policy, stats in agg.items():
        cells = [f"{stats[k]['mean']:.1f} ± {stats[k]['std']:.1f}" for k in SUMMARY_KEYS]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    changes = versus(agg, BASELINE)
    if changes:
        lines += ["", f"change of the mean against {BASELINE}", "",
                  "| policy | " + " | ".join(HEADLINE_KEYS) + " | mean TTFT ratio |",
                  "|---" * (len(HEADLINE_KEYS) + 2) + "|"]
        for policy, ch in changes.items():
            cells = [f"{ch[k]['change_pct']:+.1f} %" for k in HEADLINE_KEYS]
            ratio = ch["mean_ttft_ms"]["baseline_over_policy"]
            lines.append(f"| {policy} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return "\n".join(lines)


def calibration_table(agg_lr: dict[str, dict]) -> str:
    lines = ["| metric | article 8080 | lab least-request (mean ± std) | difference |",
             "|---|---|---|---|"]
    for key, ref in ARTICLE_8080.items():
        m = agg_lr[key]
        lines.append(f"| {key} | {ref:,.1f} | {m['mean']:,.1f} ± {m['std']:,.1f} | "
                     f"{percent_change(ref, m['mean']):+.1f} % |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run_p = sub.add_parser("run", help="run policies x seeds and write results")
    _add_run_options(run_p, ["least-request"])
    run_p.add_argument("--out", required=True, type=Path)
    run_p.add_argument("--plots", action="store_true", help="also write the plots into --out")
    cal_p = sub.add_parser("calibrate", help="least request on the article workload vs the article")
    _add_run_options(cal_p, ["least-request"])
    plot_p = sub.add_parser("plot", help="plots from a `run` output folder")
    plot_p.add_argument("folder", type=Path)
    plot_p.add_argument("--seed", type=int, default=0, help="seed of the KV-usage plots")
    from lab import matrix
    mat_p = sub.add_parser("matrix", help="the scenario matrix (lab/matrix.py) -> OUT/matrix.json")
    mat_p.add_argument("--out", required=True, type=Path)
    mat_p.add_argument("--seeds", type=int, nargs="+", default=matrix.REPORTED_SEEDS)
    mat_p.add_argument("--scenario", action="append", choices=list(matrix.BY_NAME),
                       help="only these scenarios (repeatable; default all)")
    mat_p.add_argument("--policy", action="append", dest="policies",
                       help=f"policies (repeatable; default {' '.join(matrix.POLICIES)})")
    mat_p.add_argument("--jobs", type=int, help="worker processes (default: 2 or the CPUs)")
    mat_p.add_argument("--resume", action="store_true",
                       help="reuse the runs an interrupted matrix saved in OUT/runs (those made by the "
                            "same code, policies and capacity)")
    from lab import plan
    plan_p = sub.add_parser("plan", help="how many groups for a trace: fixed pools and the shipped "
                                         "autoscaler against a TTFT objective (lab/plan.py)")
    plan_p.add_argument("--trace", required=True, type=Path, help="JSONL trace with arrival times")
    plan_p.add_argument("--slo", required=True, type=float, help="TTFT objective in seconds")
    plan_p.add_argument("--attainment", type=float, default=95.0,
                        help="percent of requests that must meet it (default 95)")
    plan_p.add_argument("--pools", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    plan_p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    plan_p.add_argument("--startup", type=float, default=plan.STARTUP_S,
                        help="seconds from a raised group count to a serving group (default %(default)s)")
    plan_p.add_argument("--no-scaler", action="store_true", help="fixed pools only")
    plan_p.add_argument("--jobs", type=int, default=1, help="worker processes")
    plan_p.add_argument("--json", type=Path, help="write every figure here")
    day_p = sub.add_parser("daytrace", help="write the day-shaped trace (lab/daytrace.py)")
    day_p.add_argument("--out", required=True, type=Path)
    day_p.add_argument("--peak-rate", type=float, default=DAY_PEAK_RATE, help="requests/s at the peak")
    day_p.add_argument("--hours", type=float, default=DAY_HOURS, help="the day compressed to this many hours")
    day_p.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    if args.cmd == "matrix":
        return matrix.main(args)
    if args.cmd == "plan":
        return plan.main(args)
    if args.cmd == "daytrace":
        from lab.daytrace import day_trace, write_trace
        records = day_trace(args.peak_rate, args.hours, args.seed)
        write_trace(args.out, records)
        print(f"{args.out}: {len(records)} requests over {args.hours:g} h")
        return 0

    if args.cmd == "plot":
        from lab.plots import plot_folder
        for path in plot_folder(args.folder, args.seed):
            print(path)
        return 0

    if args.cmd == "calibrate":
        args.workload = "article"
        results = run_seeds(args, ["least-request"], None)
        print(calibration_table(aggregate(results, SUMMARY_KEYS)["least-request"]))
        return 0
    policies = args.policies or ["least-request"]
    for name in policies:
        make_policy(name)   # fail fast on a bad name
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_seeds(args, policies, args.out)
    agg = aggregate(results, SUMMARY_KEYS)
    (args.out / "summary.json").write_text(json.dumps(
        {"workload": args.workload, "seeds": args.seeds, "settings": run_settings(args),
         "baseline": BASELINE, "policies": agg, "versus_baseline": versus(agg, BASELINE)}, indent=1))
    text = table(agg, args.seeds)
    (args.out / "summary.md").write_text(f"# Lab: workload {args.workload}\n\n{text}\n")
    print(text)
    if args.plots:
        from lab.plots import plot_folder
        plot_folder(args.out, args.seeds[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
