"""The `validation` benchmark: how long `python -m validation` takes, warm."""

from __future__ import annotations

import statistics

from bench.common import PY, REPO, RESULTS, load_average, run, save, shown, stamp


def run_warm(runs: int = 3) -> dict:
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


def report(d: dict) -> list[str]:
    return [
        f"Command: `{d['command']}` (every base, overlay, Argo CD app path and loadtest/k8s: render, "
        "schemas + CRDs with CEL, kubeconform, workflows, Envoy Gateway's translation, the cross-object rules). "
        "One run to warm the caches, then "
        f"{len(d['warm_runs_s'])} timed runs.", "",
        "| | first run | warm median | warm min | target |", "|---|---|---|---|---|",
        f"| wall s | {d['first_run_s']:.1f} | {d['warm_median_s']:.1f} | {d['warm_min_s']:.1f} | <= {d['target_s']:.0f} |"]
