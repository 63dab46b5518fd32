"""`python -m bench autoscale`: the day-shaped trace (lab/daytrace.py) through `python -m lab plan`,
fixed pools of 2..6 groups against the shipped autoscaler settings, 5 seeds, and its BENCHMARKS.md
section."""

from __future__ import annotations

from bench.common import PY, REPO, RESULTS, read_json, run, run_suite
from bench.markdown import md_table, num

SLO_S = 20.0          # the TTFT objective of the figures (lab/README.md "Autoscaling")
ATTAINMENT = 95.0     # percent of requests that must meet it
JOBS = 2


def run_autoscale(seeds: list[int] | None = None, name: str = "autoscale", hours: float | None = None,
                  pools: tuple[int, ...] = (2, 3, 4, 5, 6)) -> dict:
    """The day trace (`hours` long, default lab/daytrace.py's) through `python -m lab plan`."""
    seeds = seeds or [0, 1, 2, 3, 4]
    out = RESULTS / name
    out.mkdir(parents=True, exist_ok=True)
    trace = str((out / "day.jsonl").relative_to(REPO))          # relative: commands run in REPO
    run([PY, "-m", "lab", "daytrace", "--out", trace, *(["--hours", f"{hours:g}"] if hours else [])])
    cmd = [PY, "-m", "lab", "plan", "--trace", trace, "--slo", f"{SLO_S:g}",
           "--attainment", f"{ATTAINMENT:g}", "--pools", *map(str, pools),
           "--seeds", *map(str, seeds), "--jobs", str(JOBS), "--json", str((out / "plan.json").relative_to(REPO))]
    shown = " ".join(["python", *cmd[1:]])
    return run_suite(name, cmd, lambda: {"plan": read_json(out / "plan.json")},
                     log=RESULTS / f"{name}.log", command=shown, seeds=seeds,
                     results_dir=str(out.relative_to(REPO)))


def _hours(timeline: list) -> str:
    """The group count over the day of one run, as `h:count` at each change."""
    out, last = [], None
    for t, replicas, _, _ in timeline:
        if replicas != last:
            out.append(f"{t / 3600:.1f}h:{replicas}")
            last = replicas
    return " ".join(out)


def report(d: dict) -> list[str]:
    p = d["plan"]
    res, ans, sc = p["results"], p["answer"], p["scaler"]
    names = sorted((k for k in res if k.startswith("fixed-")), key=lambda k: int(k.split("-")[1])) + ["scaler"]
    rows = [[f"fixed {k.split('-')[1]}" if k != "scaler" else "**autoscaled (shipped settings)**",
             f"{num(res[k]['p90_ttft_s'], 1)} ± {num(res[k]['p90_ttft_s_std'], 1)}",
             f"{num(res[k]['slo_attainment_pct'], 1)} % ± {num(res[k]['slo_attainment_pct_std'], 1)}",
             f"{num(res[k]['group_hours'], 1)} ± {num(res[k]['group_hours_std'], 1)}", num(res[k]["failed"])]
            for k in names if k in res]
    n = ans["smallest_fixed_pool"]
    lines = [f"Command: `{d['command']}` ({num(d['wall_s'] / 60, 1)} min wall in {JOBS} processes; load average "
             f"{num(d['load_average_start'], 1)} at the start). The trace: `python -m lab daytrace` "
             f"({num(res[names[0]]['runs'][0]['requests'])} requests "
             f"of the article's shape, a day's shape over {round(res['scaler']['runs'][0]['timeline'][-1][0] / 3600)} h "
             "of virtual time; lab/README.md). A new group serves "
             f"{num(p['startup_s'])} s after the HPA raised the count; routing: {p['policy']}. Shipped settings "
             f"(components/autoscaling/scaledobject.yaml): {sc['min_groups']}..{sc['max_groups']} groups, target "
             f"{num(sc['target'], 1)} requests in flight per group, scale-down window {num(sc['down_window_s'])} s. "
             f"Mean ± std over seeds {' '.join(map(str, p['seeds']))}; SLO: TTFT <= {num(p['slo_s'])} s, failed "
             "requests count as missed.", ""]
    lines += md_table(["pool", "P90 TTFT s", f"SLO attainment (TTFT <= {num(p['slo_s'])} s)", "group-hours",
                       "failed"], rows)
    lines.append("")
    if n is None:
        lines.append(f"No fixed pool reaches {num(ans['attainment_target_pct'])} % attainment.")
    else:
        lines.append(f"Smallest fixed pool with >= {num(ans['attainment_target_pct'])} % attainment: **{n} groups**. "
                     f"Autoscaled against it: **{ans['scaler_attainment_minus_fixed_pts']:+.1f} points** of "
                     f"attainment, **{ans['scaler_group_hours_saved_pct']:.0f} % fewer group-hours** (target: "
                     "within 2 points, at least 25 % fewer).")
    first = res["scaler"]["runs"][0]
    lines += ["", f"Group count of the autoscaled run, seed {first['seed']} (virtual hour:groups at each change): "
              f"{_hours(first['timeline'])}"]
    return lines
