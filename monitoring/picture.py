"""`python -m monitoring.picture`: a dashboard's queries graphed from a real Prometheus during a demo-like run.

Starts the local stack on free loopback ports with the demo's simulators (KV / DEMO_SCALE), a Prometheus
scraping it (monitoring/local_prometheus.py), sends the demo workload to 8080 and then to 8081 (as `make demo`
does, with `python -m loadtest compare`), then asks Prometheus for every query of the dashboard
over the run and draws the panels where the dashboard places them (matplotlib). The shaded spans
show which listener carried the load.

    python -m monitoring.picture                      # -> monitoring/routing-dashboard.png
    python -m monitoring.picture --dashboard inference-pool --out /tmp/pool.png
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest.workloads import DEMO_SCALE
from local.stack import StackConfig
from local.stack.api_keys import read_api_keys
from local.stack.config import REPO
from local.stack.processes import python_env
from monitoring import dashboards
from monitoring import local_prometheus

DEFAULT_OUT = REPO / "monitoring/routing-dashboard.png"
RATE_WINDOW = "30s"
STEP = 2.0


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or json.dumps(labels)


def run_load(config: StackConfig, out: Path, num_prompts: int, seed: int) -> list[tuple[str, float, float]]:
    spans = []
    for port, name in ((config.http_port, "8080"), (config.llm_port, "8081")):
        start = time.time()
        cmd = [sys.executable, "-m", "loadtest", "compare", "--host", config.host, "--ports", str(port),
               "--workload", "demo", "--num-prompts", str(num_prompts), "--seed", str(seed),
               "--out", str(out / name)]
        env = python_env() | {"OPENAI_API_KEY": read_api_keys(config.api_keys_file).get("loadtest", "")}
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        spans.append((name, start, time.time()))
    return spans


def collect(prom: local_prometheus.Prometheus, panels: list[dict], start: float, end: float) -> list[dict]:
    out = []
    for panel in panels:
        lines = []
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", RATE_WINDOW)
            for series in prom.query_range(expr, start, end, STEP):
                points = [(float(t), float(v)) for t, v in series["values"]]
                lines.append((legend(target.get("legendFormat", ""), series["metric"]), points))
        out.append({**panel, "lines": lines})
    return out


def draw(title: str, panels: list[dict], spans, start: float, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graphs = [p for p in panels if p["type"] != "row"]
    row_ys = [p["gridPos"]["y"] for p in panels if p["type"] == "row"]

    def top(p):  # the dashboard's grid without its one-unit row headers
        return p["gridPos"]["y"] - sum(1 for y in row_ys if y < p["gridPos"]["y"])

    bottom = max(top(p) + p["gridPos"]["h"] for p in graphs)
    fig = plt.figure(figsize=(16, bottom * 0.42))
    grid = fig.add_gridspec(bottom, 24, hspace=2.2, wspace=1.5, top=0.95)
    for p in graphs:
        pos, y = p["gridPos"], top(p)
        ax = fig.add_subplot(grid[y:y + pos["h"] - 1, pos["x"]:pos["x"] + pos["w"]])
        ax.set_title(p["title"], fontsize=10, loc="left")
        for name, t0, t1 in spans:
            ax.axvspan((t0 - start) / 60, (t1 - start) / 60, alpha=0.08,
                       color="tab:blue" if name == "8080" else "tab:orange")
        for label, points in p["lines"]:
            ax.plot([(t - start) / 60 for t, _ in points], [v for _, v in points], label=label, lw=1.2)
        if p["lines"]:
            ax.legend(fontsize=7, loc="upper left", ncol=2)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("minutes (blue: load on 8080, orange: load on 8081)", fontsize=7)
    fig.suptitle(title, fontsize=13, y=0.98)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m monitoring.picture", description=__doc__.split("\n")[0])
    p.add_argument("--dashboard", default="inference-routing", help="uid of a generated dashboard")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--num-prompts", type=int, default=90, help="demo workload prompts per listener")
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    doc = json.loads((dashboards.OUT / f"{args.dashboard}.json").read_text())
    with tempfile.TemporaryDirectory(prefix="picture-") as tmp:
        with local_prometheus.observed_stack("picture", Path(tmp), groups=3, speedup=args.speedup, seed=args.seed,
                                    kv_scale=DEMO_SCALE) as (stack, prom):
            start = time.time()
            spans = run_load(stack.config, Path(tmp) / "results", args.num_prompts, args.seed)
            time.sleep(2)
            panels = collect(prom, doc["panels"], start - 10, time.time())
    draw(f"{doc['title']}: demo workload on 8080, then 8081 (local stack, speedup {args.speedup:g})",
         panels, spans, start, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
