"""The lab against the HTTP stack: the same scaled workload through both, side by side.

    python -m bench crosscheck [--seed 0] [--seeds 0 1 2 3 4] [--speedup 2.5]

HTTP: `python -m local.stack demo` (3 simulators with the KV capacity / DEMO_SCALE, the picker with
its scrape interval and staleness divided by the speedup, Envoy Gateway + Envoy; `loadtest compare`
of listener http = least request and llm-gw = picker, the demo workload = the article's / DEMO_SCALE, two
repetitions in alternating order). Lab: the same prompts (same workload seed), the same engines
and concurrency, policies `least-request` and the picker's default profile scraping every
`model_scrape_interval` model seconds (what the HTTP stack's picker effectively has), over several
policy seeds. Also in the lab: the picker at the interval it would have if the launcher did not
scale it (0.1 s of wall time = 0.1 x speedup model seconds).

Speedup 2.5 by default (the demo's is 5), see DEFAULT_SPEEDUP. Pass: the same ordering of the two policies by mean TTFT, and each policy's mean TTFT in the lab
within 25 % of the HTTP stack's (TOLERANCE).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.common import PY, REPO, RESULTS, load_average, run, save, stamp
from loadtest.metrics import REPORT_KEYS, percent_change
from local.sim.clock import to_model_rate, to_model_seconds

# Half the demo's speedup: the HTTP side then needs half the CPU per wall second, so other work on
# the machine stretches its model time less (the run's wall time is in BENCHMARKS.md).
DEFAULT_SPEEDUP = 2.5
TOLERANCE = 0.25
HTTP_REPETITIONS = 2  # `local.stack demo` runs each port twice
TPOT_STARVED = 0.10  # HTTP mean TPOT this much above the lab's: the stack lacked CPU (see verdict)


def http_side(seed: int, speedup: float, out: Path) -> tuple[dict, float]:
    cmd = [PY, "-m", "local.stack", "demo", "--name", "bench-crosscheck", "--seed", str(seed),
           "--speedup", f"{speedup:g}", "--out", str(out)]
    wall = run(cmd, log=out.parent / f"{out.name}.log")
    from local.dataplane import local_listener_port

    ports = {"least-request": local_listener_port(8080), "picker": local_listener_port(8081)}
    return {policy: to_model_time(json.loads((out / f"{port}.json").read_text()), speedup)
            for policy, port in ports.items()}, wall


def to_model_time(result: dict, speedup: float) -> dict:
    """loadtest measures wall time at the client; the lab reports model time (wall x speedup).
    `duration` of a multi-repetition result is the sum of its runs: per run here, like the lab."""
    sent = result["completed"] + result["failed"] + result.get("unfinished", 0)
    reps = max(1, round(sent / result["num_prompts"]))
    out = {k: to_model_seconds(result[k], speedup) for k in REPORT_KEYS if k.endswith("_ms")}
    out["output_throughput"] = to_model_rate(result["output_throughput"], speedup)
    out["duration"] = to_model_seconds(result["duration"], speedup) / reps
    return out


def lab_side(seed: int, lab_seeds: list[int], model_interval: float, model_staleness: float,
             speedup: float) -> dict:
    from lab.experiment import run_policies, summaries
    from lab.picker_policy import PickerPolicy
    from lab.policies import make_policy
    from lab.simulation import LabConfig
    from lab.stats import aggregate
    from loadtest.workloads import build_workload, workload_settings
    from local.stack.demo import demo_config
    from local.stack.plan import sim_engine_model
    from picker import defaults

    engine_model = sim_engine_model(demo_config(speedup=speedup))  # what the demo's simulators run
    config = LabConfig(concurrency=workload_settings("demo")["concurrency"], engine_model=engine_model)
    unscaled = to_model_seconds(defaults.SCRAPE_INTERVAL, speedup)  # the picker's default read as wall time
    policies = {
        "least-request": lambda: make_policy("least-request"),
        "picker": lambda: PickerPolicy("default", scrape_interval=model_interval, staleness=model_staleness),
        f"picker (scrape {unscaled:g} s model, unscaled)":
            lambda: PickerPolicy("default", scrape_interval=unscaled, staleness=10 * unscaled),
    }
    runs = run_policies(lambda s: build_workload("demo", seed=s), policies, lab_seeds, config, workload_seed=seed)
    agg = aggregate(summaries(runs), REPORT_KEYS)
    out = {}
    for name, stats in agg.items():
        out[name] = {k: stats[k]["mean"] for k in REPORT_KEYS}
        out[name]["std_mean_ttft_ms"] = stats["mean_ttft_ms"]["std"]
    return out


def verdict(http: dict, lab: dict) -> dict:
    order_http = sorted(("least-request", "picker"), key=lambda p: http[p]["mean_ttft_ms"])
    order_lab = sorted(("least-request", "picker"), key=lambda p: lab[p]["mean_ttft_ms"])
    diffs = {p: percent_change(http[p]["mean_ttft_ms"], lab[p]["mean_ttft_ms"]) / 100 for p in ("least-request", "picker")}
    # TPOT hardly depends on routing (lab: within a few %), so HTTP TPOT above the lab's measures how
    # much the stack's own CPU starvation stretched model time (late engine steps), not routing.
    tpot = {p: percent_change(lab[p]["mean_tpot_ms"], http[p]["mean_tpot_ms"]) / 100 for p in ("least-request", "picker")}
    return {"order_http": order_http, "order_lab": order_lab, "same_order": order_http == order_lab,
            "lab_vs_http_mean_ttft": diffs, "within_tolerance": all(abs(d) <= TOLERANCE for d in diffs.values()),
            "tolerance": TOLERANCE, "http_tpot_over_lab": tpot,
            "cpu_starved": any(x > TPOT_STARVED for x in tpot.values())}


def main(seed: int = 0, lab_seeds: list[int] | None = None, speedup: float | None = None) -> dict:
    from loadtest.workloads import workload_settings
    from local.stack.demo import demo_config
    from local.stack.plan import picker_timing

    speedup = speedup or DEFAULT_SPEEDUP
    lab_seeds = lab_seeds or [0, 1, 2, 3, 4]
    config = demo_config(speedup=speedup)
    timing = picker_timing(config)
    load_start = load_average()
    out = RESULTS / "crosscheck-http"
    http, wall = http_side(seed, speedup, out)
    started = time.monotonic()
    lab = lab_side(seed, lab_seeds, timing.model_scrape_interval, timing.model_staleness, speedup)
    data = {"command": f"python -m bench crosscheck --seed {seed} --speedup {speedup:g}",
            "workload": "demo", "num_prompts": workload_settings("demo")["num_prompts"], "kv_scale": config.kv_scale, "speedup": speedup, "seed": seed, "lab_seeds": lab_seeds,
            "picker_scrape_interval_wall_s": timing.scrape_interval,
            "picker_scrape_interval_model_s": timing.model_scrape_interval,
            "picker_staleness_model_s": timing.model_staleness,
            "http_wall_s": wall, "lab_wall_s": time.monotonic() - started, "http_results_dir": str(out),
            "load_average_start": load_start, "http": http, "lab": lab, "verdict": verdict(http, lab), **stamp()}
    print(report(data))
    save("crosscheck", data)
    return data


def report(d: dict) -> str:
    lines = [f"Scaled article workload (`demo`: lengths and KV capacity / {d['kv_scale']}), 3 groups, "
             f"concurrency 30, {d.get('num_prompts', 150)} prompts, workload seed {d['seed']}. HTTP: speedup {d['speedup']:g}, 2 repetitions "
             f"per port (alternating order), picker scraping every {d['picker_scrape_interval_wall_s'] * 1000:.0f} ms "
             f"wall = {d['picker_scrape_interval_model_s']:g} s model time. Lab: mean of policy seeds "
             f"{' '.join(map(str, d['lab_seeds']))}.", "",
             "| run | mean TTFT ms | median TTFT ms | P99 TTFT ms | mean TPOT ms | output tok/s | duration s |",
             "|---|---|---|---|---|---|---|"]
    rows = [("HTTP http (least request)", d["http"]["least-request"]), ("HTTP llm-gw (picker)", d["http"]["picker"])]
    rows += [(f"lab {name}", r) for name, r in d["lab"].items()]
    for name, r in rows:
        lines.append(f"| {name} | {r['mean_ttft_ms']:,.0f} | {r['median_ttft_ms']:,.0f} | {r['p99_ttft_ms']:,.0f} | "
                     f"{r['mean_tpot_ms']:.1f} | {r['output_throughput']:.1f} | {r['duration']:.0f} |")
    v = d["verdict"]
    change = lambda s: percent_change(s["least-request"]["mean_ttft_ms"], s["picker"]["mean_ttft_ms"]) / 100  # noqa: E731
    lines += ["", f"Picker vs least request, mean TTFT: HTTP {change(d['http']):+.1%}, lab {change(d['lab']):+.1%}. "
              f"Ordering {'the same' if v['same_order'] else 'DIFFERENT'} "
              f"({' < '.join(v['order_http'])} over HTTP, {' < '.join(v['order_lab'])} in the lab); lab vs HTTP mean "
              f"TTFT: " + ", ".join(f"{p} {x:+.1%}" for p, x in v["lab_vs_http_mean_ttft"].items())
              + f" ({'within' if v['within_tolerance'] else 'NOT within'} ±{v['tolerance']:.0%})."]
    lines += ["", f"Over policy seeds the lab's least request varies by ± "
                  f"{d['lab']['least-request']['std_mean_ttft_ms']:,.0f} ms (sd) in mean TTFT; an HTTP run is one sample "
                  "of Envoy's random draws."]
    if "http_tpot_over_lab" in v:
        lines += ["", "HTTP mean TPOT vs the lab's (routing hardly changes TPOT, so this is how much late engine "
                      "steps stretched model time on the HTTP stack): "
                  + ", ".join(f"{p} {x:+.1%}" for p, x in v["http_tpot_over_lab"].items())
                  + (". **The stack was short of CPU** (other work on the machine): its TTFTs are inflated."
                     if v["cpu_starved"] else ".")]
    return "\n".join(lines)


def section_lines(d: dict) -> list[str]:
    """The BENCHMARKS.md section: how it ran, then `report(d)`."""
    return [f"Command: `{d['command']}`: the HTTP part is `python -m local.stack demo` (what `make demo` runs: "
            "3 simulator processes, the picker, Envoy Gateway + Envoy, `loadtest compare` of both listeners); the lab "
            "part runs the same prompts through the same engine model in virtual time. HTTP took "
            f"{d['http_wall_s']:.0f} s wall, the lab {d['lab_wall_s']:.0f} s. HTTP results: "
            f"`{d['http_results_dir'].replace(str(REPO) + '/', '')}/report.md`.", "", report(d)]
