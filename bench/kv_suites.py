"""Benchmarks of precise prefix routing (the engines' KV-cache events), lab side:

- `kv-rate`: how many events the simulator's engine publishes under the demo workload
  (`python -m lab.kv_rate`), the input of the picker's event-cost benchmark;
- `cache-pressure`: the lab's cache-pressure scenarios (lab/matrix.py PRESSURE_SCENARIOS), one
  picker and 2 / 4 independent replicas, approximate vs precise vs the oracle;
- `matrix-precise`: every scenario of the routing matrix, the picker approximate vs precise;
- `replicas-precise`: `python -m lab.replicas --precise` on 16 groups, both lab workloads.

Each runs a lab command and turns the JSON it writes into its BENCHMARKS.md section.
"""

from __future__ import annotations

import re
import subprocess
import time

from bench.common import (PY, REPO, RESULTS, load_average, read_json, run_suite, save, shown,
                          stamp)
from bench.markdown import md_table, num, versus
from lab.matrix import BY_NAME, SCENARIOS, reuse_note
from lab.simulation import OUTAGE_KEYS

SEEDS = [0, 1, 2, 3, 4]
PRESSURE_POLICIES = ["least-request", "picker", "picker+precise", "replicas:2:independent",
                     "replicas:2:independent+precise", "replicas:4:independent",
                     "replicas:4:independent+precise", "oracle"]
MATRIX_SCENARIOS = [s.name for s in SCENARIOS]          # every scenario of the routing matrix
PRESSURE_SCENARIOS = ["pressure-8x9000", "pressure-24x3500", "pressure-48x1800"]
MATRIX_POLICIES = ["least-request", "picker", "picker+precise", "oracle"]


def run_kv_rate(seeds: list[int] | None = None) -> dict:
    seeds = seeds or SEEDS
    path = RESULTS / "kv-rate-lab.json"
    cmd = [PY, "-m", "lab.kv_rate", "--workload", "demo", "--seeds", *map(str, seeds),
           "--json", str(path)]
    return run_suite("kv-rate", cmd, lambda: {"rate": read_json(path)}, log=RESULTS / "kv-rate.log")


def _matrix(name: str, scenarios: list[str], policies: list[str], seeds: list[int] | None,
            jobs: int = 2) -> dict:
    seeds = seeds or SEEDS
    out = RESULTS / f"lab-{name}"
    cmd = [PY, "-m", "lab", "matrix", "--out", str(out), "--seeds", *map(str, seeds),
           "--jobs", str(jobs), "--resume",
           *(a for s in scenarios for a in ("--scenario", s)),
           *(a for p in policies for a in ("--policy", p))]
    return run_suite(name, cmd, lambda: {"matrix": read_json(out / "matrix.json")}, seeds=seeds)


def run_pressure(seeds: list[int] | None = None) -> dict:
    return _matrix("cache-pressure", PRESSURE_SCENARIOS, PRESSURE_POLICIES, seeds)


def run_matrix_precise(seeds: list[int] | None = None) -> dict:
    return _matrix("matrix-precise", MATRIX_SCENARIOS, MATRIX_POLICIES, seeds)


def run_replicas_precise(seeds: list[int] | None = None) -> dict:
    """Both workloads at once (two processes: the machine has two cores)."""
    seeds = seeds or SEEDS
    load_start = load_average()
    procs, paths, commands = {}, {}, {}
    started = time.perf_counter()
    for workload in ("shared-prefix", "article"):
        paths[workload] = RESULTS / f"replicas-precise-{workload}.json"
        cmd = [PY, "-m", "lab.replicas", "--engines", "16", "--replicas", "1", "2", "4",
               "--precise", "--failover", "0.5", "--workload", workload, "--seeds", *map(str, seeds),
               "--json", str(paths[workload])]
        commands[workload] = shown(cmd)
        log = (RESULTS / f"replicas-precise-{workload}.log").open("w")
        procs[workload] = (subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log)
    for workload, (proc, log) in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"{commands[workload]} failed (exit {proc.returncode}); see {log.name}")
        log.close()
    data = {"commands": commands, "wall_s": time.perf_counter() - started,
            "load_average_start": load_start,
            "runs": {w: read_json(p) for w, p in paths.items()}, **stamp()}
    save("replicas-precise", data)
    return data


# ---------------------------------------------------------------- report sections

def kv_rate_report(d: dict) -> list[str]:
    r = d["rate"]
    mean, peak = r["per_engine_per_model_s"]["mean"], r["per_engine_per_model_s"]["max"]
    rows = [[label, num(mean[k], 1), num(peak[k], 1), num(mean[k] * 5, 1)]
            for k, label in (("batches", "batches (ZMQ messages)"), ("events", "events"),
                             ("blocks_stored", "blocks stored"), ("blocks_removed", "blocks removed"),
                             ("payload_bytes", "payload bytes"))]
    return [f"Command: `{d['command']}` (lab/kv_rate.py; {d['wall_s']:.0f} s wall). The simulator's "
            f"engine core (the code `python -m local.sim` runs, which publishes one batch per engine "
            f"step that produced events) under the `demo` workload on the local stack's pool: "
            f"{r['engines']} groups of {r['num_gpu_blocks']} blocks x {r['block_size']} tokens "
            f"(`a10-qwq32b` KV / 6), closed loop {r['concurrency']}, least request, seeds "
            f"{' '.join(map(str, r['seeds']))}. Per engine and model second (mean over engines and "
            "seeds, and the busiest engine-seed); the local stack at speedup 5 publishes 5 times as "
            "many per wall second.", ""] + md_table(
        ["per engine", "per model s (mean)", "max", "per wall s at speedup 5"], rows)


def _cell(stats: dict) -> str:
    m = stats["mean_ttft_ms"]
    return f"{num(m['mean'])} ± {num(m['std'])}"


def _gap(p: dict, name: str) -> float | None:
    lr, orc = p["least-request"]["mean_ttft_ms"]["mean"], p["oracle"]["mean_ttft_ms"]["mean"]
    if name not in p or lr <= orc:
        return None
    return (lr - p[name]["mean_ttft_ms"]["mean"]) / (lr - orc) * 100


def _matrix_lines(d: dict, title: str) -> list[str]:
    m = d["matrix"]
    return [f"Command: `{d['command']}` (lab/matrix.py; {len(m['scenarios'])} scenarios x "
            f"{len(m['policies'])} policies x {len(m['seeds'])} seeds: {d['wall_s'] / 60:.1f} min "
            f"wall{reuse_note(m)}, 1-minute load average {d['load_average_start']:.1f} at the start, "
            f"{d['load_average_end']:.1f} at the end). {title} Reported seeds "
            f"{' '.join(map(str, m['seeds']))}; nothing was tuned on them (tuning seeds "
            f"{' '.join(map(str, m['tuning_seeds']))}). Cells: mean TTFT ms, mean ± std over the "
            "seeds; gap closed = (least request - policy) / (least request - oracle).", ""]


def pressure_report(d: dict) -> list[str]:
    m = d["matrix"]
    out = _matrix_lines(d, "Tenants' system prompts fill 64-77 % of the 3 groups' KV; each "
                           "request goes to one picker replica drawn at random; `+precise`: every "
                           "replica follows every engine's KV-cache events on its own.")
    policies = [p for p in PRESSURE_POLICIES if p in m["policies"]]
    rows = []
    for s in m["scenarios"]:
        p = s["policies"]
        rows.append([f"{s['name']}: {s['description']}", *(_cell(p[n]) for n in policies)])
    out += md_table(["scenario", *policies], rows) + [""]
    rows = []
    for s in m["scenarios"]:
        p = s["policies"]
        cells = []
        for n in ("picker", "replicas:2:independent", "replicas:4:independent"):
            if n in p and f"{n}+precise" in p:
                a, q = p[n]["mean_ttft_ms"]["mean"], p[f"{n}+precise"]["mean_ttft_ms"]["mean"]
                gap_a, gap_q = _gap(p, n), _gap(p, f"{n}+precise")
                cells.append(f"{versus(q, a)}; gap closed {num(gap_a)} % -> {num(gap_q)} %")
        rows.append([s["name"], *cells])
    out += ["Precise against approximate (mean TTFT change; gap closed approximate -> precise):", ""]
    out += md_table(["scenario", "1 picker", "2 replicas", "4 replicas"], rows)
    worse = [s["name"] for s in m["scenarios"] for n in ("picker", "replicas:2:independent",
                                                        "replicas:4:independent")
             if n in s["policies"] and f"{n}+precise" in s["policies"]
             and s["policies"][f"{n}+precise"]["mean_ttft_ms"]["mean"]
             > s["policies"][n]["mean_ttft_ms"]["mean"]]
    keep = []
    for s in m["scenarios"]:
        p = s["policies"]
        if "picker+precise" in p:
            one = p["picker+precise"]["mean_ttft_ms"]["mean"]
            for n in ("replicas:2:independent+precise", "replicas:4:independent+precise",
                  "replicas:2:active-passive+precise", "replicas:4:active-passive+precise"):
                if n in p:
                    keep.append(f"{s['name']} {n.split(':')[1]} replicas {versus(p[n]['mean_ttft_ms']['mean'], one)}")
    return out + ["", "Target: precise never worse than approximate (mean TTFT): "
                  + ("met" if not worse else f"not met in {', '.join(sorted(set(worse)))}") + ".",
                  "Replicas with precise routing against one precise picker: " + "; ".join(keep) + "."]


def matrix_precise_report(d: dict) -> list[str]:
    m = d["matrix"]
    out = _matrix_lines(d, "The picker's default profile with and without the engines' "
                           "KV-cache events, on scenarios of the routing matrix.")
    rows = []
    for s in m["scenarios"]:
        p = s["policies"]
        rows.append([f"{s['name']}: {s['description']}", *(_cell(p[n]) for n in MATRIX_POLICIES),
                     versus(p["picker+precise"]["mean_ttft_ms"]["mean"], p["picker"]["mean_ttft_ms"]["mean"]),
                     f"{num(_gap(p, 'picker'))} % -> {num(_gap(p, 'picker+precise'))} %"])
    out += md_table(["scenario", *MATRIX_POLICIES, "precise vs approximate", "gap closed"], rows)
    outage = next((s for s in m["scenarios"] if s["name"] == "outage"), None)
    if outage:
        gap = _gap(outage["policies"], "picker+precise")
        out += ["", f"Target: the `outage` scenario closes >= 85 % of the oracle gap with precise "
                    f"routing: {num(gap, 1)} %, {'met' if gap is not None and gap >= 85 else 'not met'}."]
        out += _outage_windows(outage["policies"])
    return out


def _outage_windows(p: dict) -> list[str]:
    """The outage scenario's mean TTFT by when requests were sent, and the gap closed in each."""
    _, down, up = BY_NAME["outage"].outages[0]
    titles = [f"before (0-{down:g} s)", f"during ({down:g}-{up:g} s, 2 groups)",
              f"after ({up:g} s on, group 0 back empty)"]
    if any(key not in p[n] for key in OUTAGE_KEYS for n in MATRIX_POLICIES):
        return []
    value = lambda n, key: p[n][key]["mean"]  # noqa: E731
    rows = [[n, *(num(value(n, key)) for key in OUTAGE_KEYS)] for n in MATRIX_POLICIES]
    closed = []
    for key in OUTAGE_KEYS:
        lr, orc = value("least-request", key), value("oracle", key)
        closed.append(num((lr - value("picker+precise", key)) / (lr - orc) * 100) + " %"
                      if lr > orc else "- (the oracle is not ahead)")
    rows.append(["gap closed by picker+precise", *closed])
    return ["", "The outage scenario by when requests were sent (mean TTFT ms of the requests that "
                "succeeded, mean over the seeds): where the picker loses to the oracle.", "",
            *md_table(["policy", *titles], rows)]


def _shown(policy: str) -> str:
    """`failover=K` as `failover=half` (the report's rows span workloads of different sizes)."""
    return re.sub(r"failover=\d+", "failover=half", policy)


def replicas_precise_report(d: dict) -> list[str]:
    out = ["Command: `python -m bench replicas-precise` (`python -m lab.replicas --precise`, "
           "lab/README.md): the lab's workloads on 16 simulated groups at concurrency 160; each "
           "request goes to one picker replica drawn at random; replicas share nothing (no Redis). "
           "`+precise`: every replica follows every engine's KV-cache events. `active-passive`: "
           "one leader decides every request, the standbys only follow the events (base/picker's "
           "`--leader-election`); `failover=K`: the leader is gone after K decisions (half the "
           "requests) and the standby decides the rest, with the leader's in-flight counts, "
           "prefix additions and relayed outcomes from the peer link (`--peers`), or without "
           "them (`:cold`). Mean TTFT, mean ± std "
           "over the seeds, change against one picker with the same signals (for `picker+precise`: "
           "against `picker`).", ""]
    rows = []
    names = []   # as shown: K of failover=K is half of each workload's requests, so it differs
    for run in d["runs"].values():
        names += [n for n in map(_shown, run["policies"]) if n not in names]
    for name in names:
        cells = []
        for run in d["runs"].values():
            p = {_shown(n): v for n, v in run["policies"].items()}
            if name not in p:
                cells.append("-")
                continue
            # replicas against one picker with the same signals; one precise picker against one
            # approximate picker
            base = p["picker+precise" if name.endswith("+precise") and name != "picker+precise"
                     else "picker"]["mean_ttft_ms"]["mean"]
            m = p[name]["mean_ttft_ms"]
            cells.append(f"{num(m['mean'])} ± {num(m['std'])} ({versus(m['mean'], base)})")
        rows.append([name, *cells])
    out += md_table(["policy", *d["runs"]], rows)
    verdict = []
    for workload, run in d["runs"].items():
        p = {_shown(n): v for n, v in run["policies"].items()}
        one = p["picker+precise"]["mean_ttft_ms"]["mean"]
        for n in ("replicas:2:independent+precise", "replicas:4:independent+precise",
                  "replicas:2:active-passive+precise", "replicas:4:active-passive+precise",
                  "replicas:2:active-passive:failover=half+precise",
                  "replicas:2:active-passive:failover=half:cold+precise"):
            if n in p:
                change = (p[n]["mean_ttft_ms"]["mean"] / one - 1) * 100
                how = n.split(":", 2)[2].rsplit("+", 1)[0].replace(":", " ")
                verdict.append(f"{workload} {n.split(':')[1]} replicas {how} {change:+.1f} % "
                               f"({'met' if change <= 3 else 'not met'})")
    return out + ["", "Target: with precise routing, 2 and 4 replicas within +3 % mean TTFT of one "
                  "picker: " + "; ".join(verdict) + "."]
