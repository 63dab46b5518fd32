"""The benchmarks other than the crosscheck: each runs the component's own command and saves a JSON
summary in results/bench/<name>.json (see bench/README.md)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from pathlib import Path

from bench.common import PY, REPO, RESULTS, load_average, run, run_suite, save, shown, stamp

# The lab benchmark's policies: least request (the 8080 route) against the picker's two profiles.
LAB_POLICIES = ["least-request", "picker", "picker-upstream"]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _suite_runs(name: str, runs: dict[str, tuple[list[str], Path]]) -> dict:
    """Several commands timed one after the other (`runs`: key -> (command, the JSON it writes);
    output to results/bench/<name>-<key>.log), saved as results/bench/<name>.json: each command and
    result by key, the total wall time, the load average before and after."""
    load_start = load_average()
    results, commands, wall = {}, {}, 0.0
    for key, (cmd, result) in runs.items():
        wall += run(cmd, log=RESULTS / f"{name}-{key}.log")
        results[key] = _json(result)
        commands[key] = shown(cmd)
    data = {"commands": commands, "wall_s": wall, "load_average_start": load_start, "runs": results,
            **stamp()}
    save(name, data)
    return data


def validation(runs: int = 3) -> dict:
    """`python -m validation` (every overlay, Argo CD app path, loadtest/k8s), warm: one run fills
    the caches, then `runs` timed runs."""
    from validation.cli import default_crds_dir

    cmd = [PY, "-m", "validation", "--crds-dir", str(default_crds_dir(REPO)),
           "--kubeconform", str(REPO / ".tools/bin/kubeconform")]
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
    return run_suite("picker", ["make", "--no-print-directory", "bench-picker"],
                  lambda: {"result": _json(REPO / "results" / "bench-picker.json")},
                  log=RESULTS / "picker.log", command="make bench-picker")


def lab(workload: str, seeds: list[int] | None = None) -> dict:
    """`python -m lab run` on one workload, 5 seeds, least request vs the picker's profiles."""
    seeds = seeds or [0, 1, 2, 3, 4]
    out = RESULTS / f"lab-{workload}"
    if out.exists():
        shutil.rmtree(out)
    cmd = [PY, "-m", "lab", "run", "--workload", workload, *(a for p in LAB_POLICIES for a in ("--policy", p)),
           "--seeds", *map(str, seeds), "--out", str(out), "--plots"]
    return run_suite(f"lab-{workload}", cmd, lambda: {"summary": _json(out / "summary.json")},
                  log=RESULTS / f"lab-{workload}.log", workload=workload, seeds=seeds,
                  results_dir=str(out.relative_to(REPO)))


def lab_matrix(seeds: list[int] | None = None, extra: list[str] | None = None) -> dict:
    """`python -m lab matrix`: every scenario x policy x seed (lab/matrix.py), progress shown;
    `extra`: more options (e.g. from `python -m bench matrix --matrix-args "--jobs 3"`)."""
    extra = extra or []
    seeds = seeds or [0, 1, 2, 3, 4]
    out = RESULTS / "lab-matrix"
    cmd = [PY, "-m", "lab", "matrix", "--out", str(out), "--seeds", *map(str, seeds), *extra]
    # no log: output inherited, one progress line per scenario and seed
    return run_suite("lab-matrix", cmd, lambda: {"matrix": _json(out / "matrix.json")}, seeds=seeds)


def demo() -> dict:
    """`make demo` as a user runs it: the stack on the real data plane, both listeners compared,
    with the CPU of every process and Envoy's own listener counters (local/stack.py demo)."""
    out = RESULTS / "demo"
    cmd = [PY, "-m", "local.stack", "demo", "--name", "bench-demo", "--out", str(out)]

    def results() -> dict:
        ports = _json(out / "dataplane.json")
        return {"dataplane": ports, "results": {name: _json(out / f"{port}.json")
                                                for name, port in ports["listeners"].items()}}
    return run_suite("demo", cmd, results, log=RESULTS / "demo.log", command="make demo (" + shown(cmd) + ")",
                  results_dir=str(out.relative_to(REPO)))


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def picker_scale() -> dict:
    """`make bench-picker-scale` (writes results/bench-picker-scale.json)."""
    return run_suite("picker-scale", ["make", "--no-print-directory", "bench-picker-scale"],
                  lambda: {"result": _json(REPO / "results" / "bench-picker-scale.json")},
                  log=RESULTS / "picker-scale.log", command="make bench-picker-scale")


# The replica experiment: both lab workloads on 16 groups at the same load per group as the
# 3-group runs (concurrency 160). At a low Poisson rate the outcome swings with each replica's
# tie-break draws far more than with sharing, so the closed loop is what is compared.
REPLICA_RUNS = {"shared-prefix": ["--workload", "shared-prefix"], "article": ["--workload", "article"]}


def replicas(seeds: list[int] | None = None) -> dict:
    """`python -m lab.replicas`: routing quality of 1, 2 and 4 picker replicas, shared or not."""
    seeds = seeds or [0, 1, 2, 3, 4]
    runs = {}
    for name, extra in REPLICA_RUNS.items():
        path = RESULTS / f"replicas-{name}.json"
        runs[name] = ([PY, "-m", "lab.replicas", "--engines", "16", "--replicas", "1", "2", "4",
                       "--seeds", *map(str, seeds), *extra, "--json", str(path)], path)
    return _suite_runs("replicas", runs)


PREFILTER_PROFILE = REPO / "bench" / "picker" / "prefilter-16.yaml"


def prefilter(seeds: list[int] | None = None) -> dict:
    """Routing quality with the candidate prefilter: the lab on 16 groups (concurrency 160), the
    default profile (all 16 scored) against the same profile with the prefilter forced on."""
    seeds = seeds or [0, 1, 2, 3, 4]
    runs = {}
    for workload in ("shared-prefix", "article"):
        out = RESULTS / f"prefilter-{workload}"
        runs[workload] = ([PY, "-m", "lab", "run", "--workload", workload, "--engines", "16", "--concurrency", "160",
                           "--policy", "least-request", "--policy", "picker", "--policy",
                           f"picker:{PREFILTER_PROFILE.relative_to(REPO)}", "--seeds", *map(str, seeds),
                           "--out", str(out)], out / "summary.json")
    return _suite_runs("prefilter", runs)
