"""Flow control (late binding) in the lab: fairness between two clients and priorities, into a
saturated pool, the picker without and with its flow control (`picker`, `picker-flow`).

    python -m bench flow [--seeds 0 1 2]

Open loop, 3 A10 groups, the article's prompts (1,000-token shared prefix, ~3,400 in,
~1,800 out). The pool's capacity is least request's request throughput on the closed-loop base
(concurrency 30), measured first for each seed.

- fairness: a light client at 0.15 x capacity and a heavy one at 1.5 x (10x its rate), same
  priority: total 1.65x capacity. The light client's mean TTFT with the heavy one, against what
  it gets alone (the same requests at the same times, nothing else); each client's share of the
  completed requests and output tokens. Target: within 1.5x of alone.
- priorities: `interactive` (priority 10) and `standard` (0) at 0.75 x capacity each (1.5x in
  all). P99 TTFT per class. Target: interactive at most half of standard's.
- several clients (bench/flow_mixes.py): clients whose answers differ ~10x in length, in one
  closed loop, each in its own, or open loop, below saturation and at it. Target below
  saturation: flow control never worse than the picker without it beyond the seed spread, and
  no request refused.
Failed requests are counted; TTFT is over completed requests.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from bench.common import load_average, save, stamp
from picker import defaults
from lab.stats import mean

LIGHT, HEAVY = 0.15, 1.5               # fractions of capacity: 10x the rate, 1.65x in all
PRIORITY_LOAD = 0.75                    # each class, fraction of capacity
DURATION_REQUESTS = 150                 # heavy requests per fairness run


def _arrivals(rate: float, n: int, gen) -> list[float]:
    return np.cumsum(gen.exponential(1.0 / rate, size=n)).tolist()


def _engine(engine):
    from local.sim.engines import A10_QWQ32B
    return engine or A10_QWQ32B


def _capacity(seed: int, workload: str = "article", engine=None) -> float:
    from lab.experiment import named_workload, run_policies
    from lab.simulation import LabConfig
    runs = run_policies(named_workload(workload, num_prompts=150), ["least-request"], [seed],
                        LabConfig(concurrency=30, engine_model=_engine(engine)))
    return runs["least-request"][0].summary["request_throughput"]


def _requests(seed: int, streams: list[tuple[str, str | None, float, int]], workload: str = "article",
              engine=None):
    """Requests of several open-loop streams (client, objective, rate, count), merged by time."""
    from lab.simulation import prepare_requests
    from loadtest.workloads import build_workload
    total = sum(n for *_, n in streams)
    reqs = prepare_requests(build_workload(workload, seed=seed, num_prompts=total), _engine(engine).block_size)
    gen = np.random.default_rng(seed)
    i = 0
    for client, objective, rate, n in streams:
        for t in _arrivals(rate, n, gen):
            r = reqs[i]
            r.arrival, r.client, r.objective, r.group = t, client, objective, client
            i += 1
    reqs.sort(key=lambda r: r.arrival)
    return reqs


def _policies(priorities: bool = False):
    """The picker without and with flow control; for priorities also with `--flow-at-bound
    reject` (a held request is always refused at its age bound)."""
    from lab.picker_policy import PickerPolicy
    from picker.discovery.objects import Objective
    from picker.flowcontrol.controller import FlowSettings
    objectives = (Objective("interactive", 10), Objective("standard", 0))
    out = {"picker": lambda: PickerPolicy("default", objectives=objectives),
           "picker-flow": lambda: PickerPolicy("default", flow=True, objectives=objectives)}
    if priorities:
        out["picker-flow, reject at bound"] = lambda: PickerPolicy(
            "default", objectives=objectives, flow_settings=FlowSettings(at_bound="reject"))
    return out


def _by_group(run) -> dict:
    out = {}
    for g in sorted({s.group for s in run.samples}):
        ok = [s for s in run.samples if s.group == g and s.success]
        ttfts = [s.ttft * 1000 for s in ok]
        out[g] = {"completed": len(ok),
                  "failed": sum(1 for s in run.samples if s.group == g and not s.success),
                  "output_tokens": sum(s.output_tokens for s in ok),
                  "mean_ttft_ms": statistics.fmean(ttfts) if ttfts else None,
                  "p99_ttft_ms": float(np.percentile(ttfts, 99)) if ttfts else None}
    return out


def run(seeds: list[int], workload: str = "article", engine=None, policies=None) -> dict:
    """Fairness and priorities per seed on `workload` and 3 groups of `engine` (default: the
    article's on A10s); `policies`: the names of _policies() to run (default: all)."""
    from lab.simulation import LabConfig, run_lab
    out = {"fairness": {}, "priorities": {}, "capacity_rps": {}}
    for seed in seeds:
        cap = _capacity(seed, workload, engine)
        out["capacity_rps"][seed] = cap
        n_heavy = DURATION_REQUESTS
        n_light = max(10, round(n_heavy * LIGHT / HEAVY))
        config = LabConfig(concurrency=None, seed=seed, engine_model=_engine(engine))

        def streams(*s):
            return _requests(seed, list(s), workload, engine)
        for name, make in _policies().items():
            if policies and name not in policies:
                continue
            both = streams(("heavy", None, HEAVY * cap, n_heavy), ("light", None, LIGHT * cap, n_light))
            alone = [r for r in both if r.client == "light"]   # same requests, same times
            mixed = _by_group(run_lab(both, make(), config))
            solo = _by_group(run_lab(alone, make(), config))["light"]
            out["fairness"].setdefault(name, []).append({"seed": seed, "mixed": mixed, "alone": solo})
            print(f"seed {seed} {name:12} light alone {solo['mean_ttft_ms'] or 0:8,.0f} ms, with heavy "
                  f"{mixed['light']['mean_ttft_ms'] or 0:8,.0f} ms", flush=True)
        for name, make in _policies(priorities=True).items():
            if policies and name not in policies:
                continue
            n = round(DURATION_REQUESTS * PRIORITY_LOAD)
            prio = streams(("interactive", "interactive", PRIORITY_LOAD * cap, n),
                           ("standard", "standard", PRIORITY_LOAD * cap, n))
            out["priorities"].setdefault(name, []).append({"seed": seed, **_by_group(run_lab(prio, make(), config))})
    return out


def main(seeds: list[int] | None = None) -> dict:
    seeds = seeds or [0, 1, 2]
    started, load_start = time.monotonic(), load_average()
    from bench import flow_mixes
    lab = run(seeds)
    data = {"command": "python -m bench flow", "seeds": seeds, "load_average_start": load_start,
            "lab": lab, "mixes": flow_mixes.run(seeds), "wall_s": time.monotonic() - started, **stamp()}
    save("flow", data)
    return data


def _mean(rows, *path) -> float:
    values = []
    for r in rows:
        v = r
        for key in path:
            v = v[key]
        if v is not None:
            values.append(v)
    return mean(values) if values else float("nan")


def report(d: dict) -> list[str]:
    lab = d["lab"]
    lines = [f"Command: `{d['command']}` (lab, seeds {' '.join(map(str, d['seeds']))}, 3 A10 groups, open "
             f"loop, the article's prompts; capacity = least request's closed-loop request throughput). "
             "Means over seeds; TTFT over completed requests. The picker's flow-control defaults: 30 s age "
             f"bound, then `--flow-at-bound {defaults.FLOW_AT_BOUND}` (dispatch-uncontested: sent to an engine's "
             "queue when no other band or client is active, else refused with 503); a "
             f"{defaults.FLOW_HOLDBACK:g} KV reserve (`--flow-holdback`) left free by a "
             "lower band while a higher one is active and, while the pool is saturated, by a client over its share of its band. `reject at "
             "bound`: always refused with 503 there.", "",
             f"**Fairness**: a light client ({LIGHT:g}x capacity) and a heavy one ({HEAVY:g}x), same priority. Target: the "
             "light client's mean TTFT within 1.5x of what it gets alone.", "",
             "| policy | light alone: mean TTFT ms | light with heavy | ratio | heavy mean TTFT | "
             "share of completed requests light / heavy | failed light / heavy |", "|---|---|---|---|---|---|---|"]
    for name, rows in lab["fairness"].items():
        alone, mixed = _mean(rows, "alone", "mean_ttft_ms"), _mean(rows, "mixed", "light", "mean_ttft_ms")
        cl, ch = _mean(rows, "mixed", "light", "completed"), _mean(rows, "mixed", "heavy", "completed")
        lines.append(f"| {name} | {alone:,.0f} | {mixed:,.0f} | {mixed / alone:.2f}x | "
                     f"{_mean(rows, 'mixed', 'heavy', 'mean_ttft_ms'):,.0f} | {cl / (cl + ch):.0%} / {ch / (cl + ch):.0%} | "
                     f"{_mean(rows, 'mixed', 'light', 'failed'):.1f} / {_mean(rows, 'mixed', 'heavy', 'failed'):.1f} |")
    lines += ["", "**Priorities**: `interactive` (10) and `standard` (0), 0.75x capacity each. Target: interactive "
              "P99 TTFT at most half of standard's.", "",
              "| policy | interactive P99 TTFT ms | standard P99 TTFT ms | ratio | interactive mean | standard mean | "
              "failed interactive / standard |", "|---|---|---|---|---|---|---|"]
    for name, rows in lab["priorities"].items():
        hi, lo = _mean(rows, "interactive", "p99_ttft_ms"), _mean(rows, "standard", "p99_ttft_ms")
        lines.append(f"| {name} | {hi:,.0f} | {lo:,.0f} | {hi / lo:.2f} | {_mean(rows, 'interactive', 'mean_ttft_ms'):,.0f} | "
                     f"{_mean(rows, 'standard', 'mean_ttft_ms'):,.0f} | {_mean(rows, 'interactive', 'failed'):.1f} / "
                     f"{_mean(rows, 'standard', 'failed'):.1f} |")
    if d.get("mixes"):
        from bench import flow_mixes
        lines += [""] + flow_mixes.report(d["mixes"])
    return lines


# ---- through HTTP: the real data plane, bursty arrivals ---------------------------------------

HTTP_RATE = 2.7          # req/s: ~80 % of the demo's closed-loop throughput (BENCHMARKS.md "make demo")
HTTP_BURSTINESS = 0.25   # gamma shape of the gaps (the matrix's bursty scenarios)
HTTP_PROMPTS = 150


def run_http() -> dict:
    """`python -m local.stack demo` twice (the picker with and without --flow-control), each
    comparing listener http (least request) with llm-gw (the picker) on bursty open-loop arrivals.
    Run it under `flock /tmp/local-stack.lock` (the stack binds fixed ports)."""
    from bench.common import PY, RESULTS, read_json, run_suite
    compare = ["--request-rate", str(HTTP_RATE), "--burstiness", str(HTTP_BURSTINESS),
               "--concurrency", "1000", "--num-prompts", str(HTTP_PROMPTS)]
    runs = {}
    for mode, flag in (("on", "--flow-control"), ("off", "--no-flow-control")):
        out = RESULTS / f"flow-http-{mode}"
        cmd = [PY, "-m", "local.stack", "demo", "--name", f"bench-flow-{mode}", "--out", str(out),
               f"--picker-arg={flag}", *compare]
        runs[mode] = run_suite(f"flow-http-{mode}", cmd, lambda out=out: {
            "dataplane": read_json(out / "dataplane.json"),
            "results": {name: read_json(out / f"{port}.json")
                        for name, port in read_json(out / "dataplane.json")["listeners"].items()}},
            log=RESULTS / f"flow-http-{mode}.log")
    data = {"command": "python -m bench flow-http", "rate": HTTP_RATE, "burstiness": HTTP_BURSTINESS,
            "num_prompts": HTTP_PROMPTS, "runs": runs, **stamp()}
    save("flow-http", data)
    return data


def http_report(d: dict) -> list[str]:
    lines = [f"Command: `{d['command']}` (under `flock /tmp/local-stack.lock`): `make demo`'s stack (3 simulator "
             f"processes, the picker, Envoy Gateway + Envoy, speedup 5) twice, the picker with and without "
             f"`--flow-control`; `loadtest compare` of both listeners, open loop at {d['rate']} req/s with gamma "
             f"shape {d['burstiness']} gaps (bursty), {d['num_prompts']} prompts, 2 runs per listener. Times are "
             "wall-clock ms at the speedup; a machine shared with other work.", "",
             "| listener | mean TTFT ms | P99 TTFT ms | output tok/s | completed | failed |", "|---|---|---|---|---|---|"]
    for mode, run in d["runs"].items():
        for name, r in run["results"].items():
            label = "least request (http)" if name == "http" else f"picker, flow control {mode} (llm-gw)"
            if name == "http":
                label += f", run with flow control {mode}"
            lines.append(f"| {label} | {r['mean_ttft_ms']:,.0f} | {r['p99_ttft_ms']:,.0f} | "
                         f"{r['output_throughput']:.1f} | {r['completed']} | {r['failed']} |")
    return lines


# ---- the scenario matrix, on the scenarios late binding is for --------------------------------

MATRIX_SCENARIOS = ["base", "chat-reasoning", "kv-0.8x", "open-bursty-50", "open-poisson-50"]
MATRIX_POLICIES = ["least-request", "picker", "picker-flow", "picker-flow-reject", "oracle", "oracle-late"]


def run_matrix(seeds: list[int] | None = None) -> dict:
    """`python -m lab matrix` on MATRIX_SCENARIOS with MATRIX_POLICIES (the full matrix runs
    them too, `python -m bench matrix`; this is the part that takes minutes, not an hour, on a
    shared machine)."""
    from bench.common import PY, RESULTS, read_json, run_suite
    seeds = seeds or [0, 1, 2, 3, 4]
    out = RESULTS / "lab-matrix-flow"
    cmd = [PY, "-m", "lab", "matrix", "--out", str(out), "--seeds", *map(str, seeds), "--resume",
           *(a for s in MATRIX_SCENARIOS for a in ("--scenario", s)),
           *(a for p in MATRIX_POLICIES for a in ("--policy", p))]
    return run_suite("lab-matrix-flow", cmd, lambda: {"matrix": read_json(out / "matrix.json")}, seeds=seeds)
