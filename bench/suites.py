"""The benchmarks other than the crosscheck: each runs the component's own command and saves a JSON
summary in results/bench/<name>.json (see bench/README.md)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from pathlib import Path

from bench.common import PY, REPO, RESULTS, load_average, run, save, shown, stamp

# Issue 6 targets for the lab (article workload: picker default vs least request).
LAB_POLICIES = ["least-request", "picker", "picker-upstream"]


def validation(runs: int = 3) -> dict:
    """`python -m validation` (every overlay, Argo CD app path, loadtest/k8s), warm: one run fills
    the caches, then `runs` timed runs."""
    crds = REPO.parent / "shared" / "crds"
    crds_dir = crds if (crds / "README.md").exists() else REPO / ".cache" / "crds"
    cmd = [PY, "-m", "validation", "--crds-dir", str(crds_dir), "--kubeconform", str(REPO / ".tools/bin/kubeconform")]
    log = RESULTS / "validation.log"
    load_start = load_average()
    cold = run(cmd, log=log)
    walls = [run(cmd, log=log) for _ in range(runs)]
    data = {"command": shown(cmd),
            "first_run_s": cold, "warm_runs_s": walls, "warm_median_s": statistics.median(walls),
            "warm_min_s": min(walls), "target_s": 20.0, "load_average_start": load_start, **stamp()}
    save("validation", data)
    return data


def picker() -> dict:
    """`make bench-picker` (builds the Go load client, writes results/bench-picker.json)."""
    load_start = load_average()
    wall = run(["make", "--no-print-directory", "bench-picker"], log=RESULTS / "picker.log")
    result = json.loads((REPO / "results" / "bench-picker.json").read_text())
    data = {"command": "make bench-picker", "wall_s": wall, "load_average_start": load_start,
            "result": result, **stamp()}
    save("picker", data)
    return data


def lab(workload: str, seeds: list[int] | None = None) -> dict:
    """`python -m lab run` on one workload, 5 seeds, least request vs the picker's profiles."""
    seeds = seeds or [0, 1, 2, 3, 4]
    out = RESULTS / f"lab-{workload}"
    if out.exists():
        shutil.rmtree(out)
    cmd = [PY, "-m", "lab", "run", "--workload", workload, *(a for p in LAB_POLICIES for a in ("--policy", p)),
           "--seeds", *map(str, seeds), "--out", str(out), "--plots"]
    load_start = load_average()
    wall = run(cmd, log=RESULTS / f"lab-{workload}.log")
    summary = json.loads((out / "summary.json").read_text())
    data = {"command": shown(cmd), "workload": workload,
            "seeds": seeds, "wall_s": wall, "load_average_start": load_start, "summary": summary,
            "results_dir": str(out.relative_to(REPO)), **stamp()}
    save(f"lab-{workload}", data)
    return data


def demo() -> dict:
    """`make demo` as a user runs it: the stack on the real data plane, both listeners compared,
    with the CPU of every process and Envoy's own listener counters (local/stack.py demo)."""
    out = RESULTS / "demo"
    load_start = load_average()
    cmd = [PY, "-m", "local.stack", "demo", "--name", "bench-demo", "--out", str(out)]
    wall = run(cmd, log=RESULTS / "demo.log")
    ports = json.loads((out / "dataplane.json").read_text())
    results = {name: json.loads((out / f"{port}.json").read_text()) for name, port in ports["listeners"].items()}
    data = {"command": "make demo (" + shown(cmd) + ")", "wall_s": wall, "load_average_start": load_start,
            "dataplane": ports, "results": results, "results_dir": str(out.relative_to(REPO)), **stamp()}
    save("demo", data)
    return data


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
