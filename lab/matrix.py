"""The scenario matrix: every routing policy on many workloads, arrival processes and pools.

Design: one base scenario plus one-factor variations (not the full cartesian product). The base
is the article's run: the `article` workload, closed loop at concurrency 30, 3 `a10-qwq32b`
groups with their KV capacity. Each other scenario changes one factor of the base:

- workload: shared-prefix, chat-reasoning, multi-turn, long-tail (each at its own size and
  concurrency 30);
- arrivals: open loop (no concurrency limit) at 50 / 80 / 95 % of the pool's measured capacity,
  Poisson and bursty (gamma shape 0.25). The capacity is measured in the same run: the request
  throughput of least request on the base scenario (closed loop, KV-bound: queues never empty),
  mean over the seeds. Open-loop runs send 150 prompts (they last 2x-4x longer per prompt);
- pool: 8 and 16 groups, the base's load per group (concurrency 10 per group), 50 / 40 prompts
  per group;
- KV capacity 0.8x and 2x the engine model's;
- heterogeneous pool: group 0 steps 1.5x slower, or has half the KV (a canary on other hardware);
- outage: group 0 fails at 600 s (its in-flight requests fail) and comes back empty at 900 s;
- lengths: answer lengths that differ by class, the class shown only by the client id, the
  system prompt, the thinking switch, or by nothing, in a KV-starved pool (0.7x).

Every client sends max_tokens as a cap (CAP, or its workload's own), never the answer's length:
only the two oracles know lengths (the clairvoyant one each request's, the distribution one each
class's distribution, lab/distribution_oracle.py).

Every scenario runs every policy of POLICIES on the same prompts for each seed (the seed
changes the prompts, the arrival times and the policy's randomness).

    python -m lab matrix --out results/lab-matrix [--seeds 0 1 2 3 4] [--jobs 2] [--scenario NAME ...]
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import queue
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from local.sim.engines import A10_QWQ32B
from loadtest.metrics import HEADLINE_KEYS, REPORT_KEYS, percent_change, summary_keys
from loadtest.workloads import workload_settings
from lab.experiment import named_workload, run_policies
from lab.policies import make_policy
from lab.simulation import OUTAGE_KEYS, LabConfig
from lab.stats import mean, over_seeds

POLICIES = ["least-request", "round-robin", "picker-upstream", "picker", "picker:lengths",
            "picker-flow", "oracle", "oracle-late", "oracle-dist"]
# Every client sends max_tokens = the model's context (vLLM's default when none is sent), unless
# its workload gives its own cap: no policy but the oracles sees an answer's true length.
CAP = A10_QWQ32B.max_model_len
KEYS = summary_keys(*REPORT_KEYS, "request_throughput", "completed", "failed")
# The picker's own forecast accuracy (lab/picker_policy.py forecast_accuracy), when it has one.
LENGTH_KEYS = tuple(f"length_{k}{s}" for s in ("", "_learned")
                    for k in ("abs_error_median", "rel_error_median", "p90_coverage"))
REPORTED_SEEDS = [0, 1, 2, 3, 4]
TUNING_SEEDS = [100, 101, 102, 103, 104]    # the seeds any tuning of the picker used
BASE = "base"


@dataclass(frozen=True)
class Scenario:
    name: str
    factor: str                        # the factor varied from the base ("-" for the base)
    description: str
    workload: str = "article"
    num_prompts: Optional[int] = None  # None: the workload's
    concurrency: Optional[int] = 30    # None: open loop without a limit
    load: Optional[float] = None       # open loop: fraction of the measured capacity
    burstiness: float = 1.0
    engines: int = 3
    kv_scale: float = 1.0
    slow_group: float = 1.0            # group 0's step-time factor
    small_kv_group: float = 1.0        # group 0's KV-capacity factor
    outages: tuple = ()                # (group, down at s, back at s)
    workload_args: tuple = ()          # (parameter, value) overrides of the workload's settings

    def engine_models(self):
        base = A10_QWQ32B.with_overrides(
            num_gpu_blocks=int(A10_QWQ32B.num_gpu_blocks * self.kv_scale))
        first = base.with_overrides(
            num_gpu_blocks=int(base.num_gpu_blocks * self.small_kv_group),
            stage_base_s=base.stage_base_s * self.slow_group,
            stage_prefill_token_s=base.stage_prefill_token_s * self.slow_group,
            stage_decode_seq_s=base.stage_decode_seq_s * self.slow_group,
            stage_context_token_s=base.stage_context_token_s * self.slow_group)
        return [first] + [base] * (self.engines - 1)

    def config(self, request_rate: float) -> LabConfig:
        """The scenario's pool and client (the seed is set per run)."""
        return LabConfig(num_engines=self.engines, engine_models=self.engine_models(),
                         concurrency=self.concurrency, request_rate=request_rate,
                         burstiness=self.burstiness, outages=self.outages, max_tokens_cap=CAP)


def _open(load: float, bursty: bool) -> Scenario:
    kind = "bursty" if bursty else "poisson"
    shape = "gamma shape 0.25" if bursty else "Poisson"
    return Scenario(f"open-{kind}-{round(load * 100)}", "arrivals",
                    f"open loop, {shape} arrivals at {load:.0%} of capacity, 150 prompts",
                    num_prompts=150, concurrency=None, load=load,
                    burstiness=0.25 if bursty else 1.0)


SCENARIOS: list[Scenario] = [
    Scenario(BASE, "-", "article workload, closed loop 30, 3 A10 groups, KV 1x"),
    Scenario("shared-prefix", "workload", "12 tenants' 4,000-token system prompts, 400 prompts",
             workload="shared-prefix"),
    Scenario("chat-reasoning", "workload", "70 % short chat + 30 % long reasoning, 300 prompts",
             workload="chat-reasoning"),
    Scenario("multi-turn", "workload", "60 chat sessions x 5 turns resending their history",
             workload="multi-turn"),
    Scenario("long-tail", "workload", "lognormal lengths (median 1,000 in / 400 out), 400 prompts",
             workload="long-tail"),
    *[_open(load, bursty) for bursty in (False, True) for load in (0.5, 0.8, 0.95)],
    Scenario("pool-8", "pool", "8 groups, concurrency 80, 400 prompts", engines=8,
             num_prompts=400, concurrency=80),
    Scenario("pool-16", "pool", "16 groups, concurrency 160, 640 prompts", engines=16,
             num_prompts=640, concurrency=160),
    Scenario("kv-0.8x", "KV", "KV capacity 0.8x (1,880 blocks per group)", kv_scale=0.8),
    Scenario("kv-2x", "KV", "KV capacity 2x (4,700 blocks per group)", kv_scale=2.0),
    Scenario("slow-group", "heterogeneous", "group 0 steps 1.5x slower", slow_group=1.5),
    Scenario("small-kv-group", "heterogeneous", "group 0 has half the KV capacity",
             small_kv_group=0.5),
    Scenario("outage", "outage", "group 0 down from 600 s to 900 s, back with an empty cache",
             outages=((0, 600.0, 900.0),)),
    # Answer lengths that differ by class, each class shown only by one field of the request
    # (loadtest/workloads.py), in a KV-starved pool (0.7x), where lengths decide who waits.
    Scenario("client-mix", "lengths", "3 applications' answers (median 150 / 700 / 3,000 tokens) "
             "told apart only by the client id, KV 0.7x", workload="client-mix", kv_scale=0.7),
    Scenario("template-mix", "lengths", "8 system prompts whose answers run from ~80 to ~4,000 "
             "tokens, one client, KV 0.7x", workload="template-mix", kv_scale=0.7),
    Scenario("reasoning-mix", "lengths", "60 % chat (median 200) + 40 % heavy-tailed reasoning "
             "(log-t, median 2,500) told apart by enable_thinking, KV 0.7x",
             workload="reasoning-mix", kv_scale=0.7),
    Scenario("no-signal", "lengths", "lognormal answers (median 700, sigma 1) nothing in the "
             "request predicts, KV 0.7x", workload="no-signal", kv_scale=0.7),
]


def _pressure(tenants: int, prefix: int) -> Scenario:
    share = tenants * prefix / (3 * A10_QWQ32B.num_gpu_blocks * A10_QWQ32B.block_size)
    return Scenario(f"pressure-{tenants}x{prefix}", "cache pressure",
                    f"{tenants} tenants' {prefix:,}-token system prompts ({share:.0%} of the pool's "
                    f"KV), 800-token questions, 400 prompts", workload="shared-prefix",
                    workload_args=(("num_groups", tenants), ("system_prompt_len", prefix)))


# Cache pressure (not in the default matrix; `--scenario pressure-...`, `python -m bench
# cache-pressure`): tenants' prefixes fill 60-80 % of the 3 groups' KV, so every group keeps
# evicting and what each one holds drifts from what a router imitates (the setting of llm-d's
# precise-prefix benchmark: 150 tenants x 6k tokens = 73 % of 8 pods' KV).
PRESSURE_SCENARIOS: list[Scenario] = [_pressure(8, 9000), _pressure(24, 3500), _pressure(48, 1800)]
BY_NAME = {s.name: s for s in SCENARIOS + PRESSURE_SCENARIOS}


def run_one(scenario: Scenario, seed: int, capacity_rps: Optional[float],
            policies: list[str]) -> dict:
    """Every policy on one scenario and seed: policy -> the summary's KEYS (+ CPU seconds)."""
    rate = math.inf
    if scenario.load is not None:
        if not capacity_rps:
            raise ValueError(f"{scenario.name}: open loop needs the measured capacity")
        rate = scenario.load * capacity_rps
    runs = run_policies(named_workload(scenario.workload, scenario.num_prompts,
                                       **dict(scenario.workload_args)), policies, [seed],
                        scenario.config(rate))
    out = {}
    for name, (run,) in runs.items():
        out[name] = {k: float(run.summary[k]) for k in KEYS + OUTAGE_KEYS + LENGTH_KEYS
                     if k in run.summary}
        out[name]["cpu_s"] = run.cpu_s
    return out


REPO = Path(__file__).resolve().parent.parent
# What a run's figures depend on: the lab, the picker it runs, the simulated engines, the workloads.
CODE_DIRS = ("lab", "picker/src/picker", "local/sim", "loadtest")


def code_fingerprint() -> str:
    """A hash of the source a run executes (tests excluded), so --resume never reuses a run
    made by other code."""
    h = hashlib.sha256()
    for top in CODE_DIRS:
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix in (".py", ".yaml", ".json") and "tests" not in path.parts \
                    and path.is_file():
                h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _job(args):
    """One scenario and seed, saved to runs/<scenario>-seed<seed>.json (reused by --resume when
    the policies, the capacity and the code are the same)."""
    scenario, seed, capacity, policies, runs, code = args
    path = runs / f"{scenario}-seed{seed}.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if (saved["policies"] == policies and saved["capacity_rps"] == capacity
                and saved.get("code") == code):
            return scenario, seed, saved["result"], 0.0
    started = time.monotonic()
    result = run_one(BY_NAME[scenario], seed, capacity, policies)
    path.write_text(json.dumps({"policies": policies, "capacity_rps": capacity, "code": code,
                                "result": result}))
    return scenario, seed, result, time.monotonic() - started


def _report(scenario: str, seed: int, result: dict, wall: float, progress: dict) -> None:
    """One progress line per finished job."""
    progress["done"] += 1
    progress["reused"] += wall == 0.0
    elapsed = time.monotonic() - progress["started"]
    done, total = progress["done"], progress["total"]
    eta = elapsed / done * (total - done)
    lr, pk, orc = (result.get(p, {}).get("mean_ttft_ms") for p in
                   ("least-request", "picker", "oracle"))
    print(f"[{done}/{total}] {scenario} seed {seed}: mean TTFT least-request "
          f"{lr or 0:,.0f} ms, picker {pk or 0:,.0f} ms, oracle {orc or 0:,.0f} ms "
          f"({wall:.1f} s); {elapsed:.0f} s elapsed, ~{eta:.0f} s left",
          file=sys.stderr, flush=True)


def _run_jobs(first: list, then, workers: int, progress: dict) -> list:
    """Run the jobs `first` in `workers` processes, in their order; once every base job among
    them has finished, `then(base results)` gives the jobs that needed them, run after the rest.
    Returns (scenario, seed, result) for every job, in the order they finished."""
    results, base_results = [], []
    base_left = sum(job[0] == BASE for job in first)
    finished: queue.SimpleQueue = queue.SimpleQueue()
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(workers) as pool:
        def submit(jobs):
            for job in jobs:
                pool.apply_async(_job, (job,), callback=finished.put,
                                 error_callback=finished.put)
            return len(jobs)
        outstanding = submit(first)
        if not base_left:
            outstanding += submit(then([]))
        while outstanding:
            item = finished.get()
            if isinstance(item, BaseException):
                raise item
            outstanding -= 1
            scenario, seed, result, wall = item
            results.append((scenario, seed, result))
            _report(scenario, seed, result, wall, progress)
            if scenario == BASE:
                base_results.append(result)
                base_left -= 1
                if not base_left:
                    outstanding += submit(then(base_results))
    return results


def run_matrix(scenarios: list[Scenario], seeds: list[int], policies: list[str],
               workers: int, runs: Path) -> dict:
    """The base scenario (its least-request throughput is the capacity the open-loop rates are
    fractions of) and the closed-loop scenarios, then the open-loop ones. Each finished job is
    saved in `runs`; jobs already there (same policies, capacity and code) are not rerun."""
    started = time.monotonic()
    runs.mkdir(parents=True, exist_ok=True)
    names = {s.name for s in scenarios}
    need_base = BASE in names or any(s.load is not None for s in scenarios)
    progress = {"done": 0, "reused": 0, "started": started,
                "total": len(seeds) * (len(names - {BASE}) + (1 if need_base else 0))}
    code = code_fingerprint()
    rest = [s for s in scenarios if s.name != BASE]
    # Longest jobs first, so the workers finish together (the open-loop ones are short).
    weight = lambda s: s.engines * (s.num_prompts or 300)  # noqa: E731
    first = []
    if need_base:
        base_policies = policies if BASE in names else ["least-request"]
        first = [(BASE, seed, None, base_policies, runs, code) for seed in seeds]
    first += [(s.name, seed, None, policies, runs, code)
              for s in sorted(rest, key=weight, reverse=True) if s.load is None for seed in seeds]
    capacity = None

    def open_loop(base_results: list) -> list:
        nonlocal capacity
        if base_results:
            capacity = mean(r["least-request"]["request_throughput"] for r in base_results)
        return [(s.name, seed, capacity, policies, runs, code)
                for s in sorted(rest, key=weight, reverse=True) if s.load is not None
                for seed in seeds]

    results = _run_jobs(first, open_loop, workers, progress)
    per: dict = {}
    for scenario, seed, result in results:
        per.setdefault(scenario, {})[seed] = result
    out = []
    for s in scenarios:
        by_seed = per[s.name]
        keys = KEYS + ("cpu_s",) + (OUTAGE_KEYS if s.outages else ()) + LENGTH_KEYS
        stats = {p: {k: over_seeds(by_seed[seed][p][k] for seed in seeds) for k in keys
                     if all(k in by_seed[seed][p] for seed in seeds)}
                 for p in policies}
        settings = workload_settings(s.workload, num_prompts=s.num_prompts, **dict(s.workload_args))
        out.append({"name": s.name, "factor": s.factor, "description": s.description,
                    "workload": s.workload,
                    "workload_settings": {k: v for k, v in settings.items() if k != "kind"},
                    "concurrency": s.concurrency, "engines": s.engines,
                    "request_rate": s.load * capacity if s.load else None,
                    "policies": stats, "assessment": assess(stats),
                    "assessment_lengths": assess(stats, picker="picker:lengths"),
                    "assessment_flow": assess(stats, picker="picker-flow")})
    return {"seeds": seeds, "policies": policies, "capacity_rps": capacity,
            "wall_s": time.monotonic() - started, "scenarios": out,
            "runs": progress["total"], "reused_runs": progress["reused"]}


def reuse_note(m: dict) -> str:
    """For a report: how many of a matrix's runs --resume took from an earlier run of the same
    code (the wall time covers only the others)."""
    if not m.get("reused_runs"):
        return ""
    return (f"; {m['reused_runs']} of {m['runs']} runs reused from an earlier run of the same "
            "code, not counted in that time")


def assess(stats: dict, picker: str = "picker", baseline: str = "least-request") -> dict:
    """The routing targets for one scenario (means over seeds; spread = the larger seed std)."""
    if picker not in stats or baseline not in stats:
        return {}
    p, b = stats[picker], stats[baseline]
    worse = {}
    for key in HEADLINE_KEYS:
        higher_better = key == "output_throughput"
        diff = p[key]["mean"] - b[key]["mean"]
        spread = max(p[key]["std"], b[key]["std"])
        worse[key] = (-diff if higher_better else diff) > spread
    out = {"change_pct": {k: percent_change(b[k]["mean"], p[k]["mean"]) for k in HEADLINE_KEYS},
           "worse_than_baseline_beyond_spread": worse}
    if "oracle" in stats:
        lr, orc, pk = b["mean_ttft_ms"]["mean"], stats["oracle"]["mean_ttft_ms"]["mean"], \
            p["mean_ttft_ms"]["mean"]
        gain = -(percent_change(lr, orc) or 0.0) / 100    # the oracle's mean TTFT cut, as a fraction
        out["oracle_gain_pct"] = gain * 100
        out["gap_closed_pct"] = (lr - pk) / (lr - orc) * 100 if lr > orc else None
        out["gap_target_applies"] = gain >= 0.20
    if "oracle-dist" in stats:     # the gap to what knowing each class's distribution gives
        dist = stats["oracle-dist"]["mean_ttft_ms"]["mean"]
        lr, pk = b["mean_ttft_ms"]["mean"], p["mean_ttft_ms"]["mean"]
        out["dist_gain_pct"] = -(percent_change(lr, dist) or 0.0)
        out["dist_gap_closed_pct"] = (lr - pk) / (lr - dist) * 100 if lr > dist else None
    if "picker" in stats and picker != "picker":     # against today's default
        d = stats["picker"]
        out["worse_than_default_beyond_spread"] = {
            key: ((d[key]["mean"] - p[key]["mean"]) if key == "output_throughput"
                  else (p[key]["mean"] - d[key]["mean"])) > max(p[key]["std"], d[key]["std"])
            for key in HEADLINE_KEYS}
        out["change_vs_default_pct"] = {k: percent_change(d[k]["mean"], p[k]["mean"])
                                        for k in HEADLINE_KEYS}
    if "picker-upstream" in stats:
        out["default_beats_upstream"] = (p["mean_ttft_ms"]["mean"]
                                         <= stats["picker-upstream"]["mean_ttft_ms"]["mean"])
    return out


def main(args) -> int:
    names = args.scenario or [s.name for s in SCENARIOS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    policies = args.policies or POLICIES
    for name in policies:
        make_policy(name)
    workers = args.jobs or min(2, os.cpu_count() or 1)
    load_start = round(os.getloadavg()[0], 2)
    print(f"lab matrix: {len(names)} scenarios x {len(args.seeds)} seeds x {len(policies)} "
          f"policies, {workers} worker(s)", file=sys.stderr, flush=True)
    runs = args.out / "runs"
    if runs.exists() and not args.resume:
        shutil.rmtree(runs)
    data = run_matrix([BY_NAME[n] for n in names], args.seeds, policies, workers, runs)
    data.update(load_average_start=load_start, load_average_end=round(os.getloadavg()[0], 2),
                tuning_seeds=TUNING_SEEDS, workers=workers)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matrix.json").write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out / 'matrix.json'} ({data['wall_s']:.0f} s)", file=sys.stderr)
    return 0
