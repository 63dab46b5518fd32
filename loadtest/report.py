"""Markdown report and PNG plots of a comparison results folder (see loadtest/compare.py).

Folder layout (written by compare, read back here so a report can be regenerated):
    compare.json                  settings and the list of runs (port, rep, stem) in run order
    <port>.json                   vLLM result over all repetitions of that port
    <port>-rep<k>.json            one run's vLLM result
    <port>-rep<k>.samples.jsonl   its raw per-request samples
    <port>-rep<k>.load.jsonl      its /metrics scrapes {t, endpoint, running, waiting, kv_usage}
    report.md, ttft_cdf.png, latency_over_time.png, endpoint_load.png
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loadtest.metrics import RequestSample, read_samples

# (label, result key, decimals): the article's table plus a few companions.
TABLE_ROWS = [
    ("Mean TTFT (ms)", "mean_ttft_ms", 1),
    ("Median TTFT (ms)", "median_ttft_ms", 1),
    ("P99 TTFT (ms)", "p99_ttft_ms", 1),
    ("Mean TPOT (ms)", "mean_tpot_ms", 1),
    ("Median TPOT (ms)", "median_tpot_ms", 1),
    ("P99 TPOT (ms)", "p99_tpot_ms", 1),
    ("Mean ITL (ms)", "mean_itl_ms", 1),
    ("Median ITL (ms)", "median_itl_ms", 1),
    ("P99 ITL (ms)", "p99_itl_ms", 1),
    ("Mean E2E latency (ms)", "mean_e2el_ms", 1),
    ("Output token throughput (tok/s)", "output_throughput", 2),
    ("Total token throughput (tok/s)", "total_token_throughput", 2),
    ("Request throughput (req/s)", "request_throughput", 3),
    ("Completed requests", "completed", 0),
    ("Failed requests", "failed", 0),
    ("Duration (s)", "duration", 1),
]


def _fmt(value, decimals: int) -> str:
    if value is None:
        return "-"
    return f"{value:,.{decimals}f}"


def change_pct(base: float | None, other: float | None) -> str:
    if base is None or other is None or base == 0 or not np.isfinite(base):
        return "-"
    return f"{(other - base) / base * 100:+.1f} %"


def comparison_table(results: dict[str, dict]) -> str:
    """Markdown table: one column per port, and the change of each port against the first."""
    ports = list(results)
    head = "| Metric | " + " | ".join(f"port {p}" for p in ports)
    head += "".join(f" | change {p} vs {ports[0]}" for p in ports[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(ports) - 1)]
    for label, key, decimals in TABLE_ROWS:
        values = [results[p].get(key) for p in ports]
        cells = [_fmt(v, decimals) for v in values]
        cells += [change_pct(values[0], v) for v in values[1:]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def load_folder(out: Path) -> tuple[dict, dict[str, dict], list[dict]]:
    meta = json.loads((out / "compare.json").read_text())
    results = {str(p): json.loads((out / f"{p}.json").read_text()) for p in meta["ports"]}
    runs = []
    for run in meta["runs"]:
        stem = out / run["stem"]
        load_path = stem.with_name(stem.name + ".load.jsonl")
        load = [json.loads(l) for l in load_path.read_text().splitlines() if l.strip()] \
            if load_path.exists() else []
        runs.append({**run, "samples": read_samples(stem.with_name(stem.name + ".samples.jsonl")),
                     "load": load})
    return meta, results, runs


def markdown(meta: dict, results: dict[str, dict], runs: list[dict]) -> str:
    order = ", ".join(f"{r['port']} (rep {r['rep']})" for r in runs)
    settings = ", ".join(f"{k}={v}" for k, v in meta.get("workload_settings", {}).items())
    errors = {p: r.get("errors_by_reason") or {} for p, r in results.items()}
    lines = [
        f"# Load-test comparison: ports {' vs '.join(map(str, meta['ports']))}", "",
        f"- host: `{meta['host']}`, endpoint `{meta['endpoint']}`, model `{meta['model']}`",
        f"- workload: `{meta['workload']}` ({settings}), seed {meta['seed']}, "
        f"concurrency {meta['concurrency']}, request rate {meta['request_rate'] or 'inf'}",
        f"- run order (same prompts for every run): {order}",
        f"- started {meta['started']}", "",
        "Statistics follow vLLM's serving benchmark (raw samples, numpy; tokens from the "
        "server's `usage`). Change is relative to the first port; for latencies negative is "
        "better, for throughput positive is better.", "",
        comparison_table(results),
    ]
    for port, r in results.items():
        if r.get("unfinished"):
            lines += [f"**Port {port}: {r['unfinished']} requests did not finish before the run "
                      "timeout; they are in neither count.**", ""]
    if any(errors.values()):
        lines += ["## Failures", ""]
        for port, counts in errors.items():
            for reason, n in sorted(counts.items(), key=lambda kv: -kv[1]):
                lines.append(f"- port {port}: {n} x {reason}")
        lines.append("")
    lines += ["## Plots", "",
              "![TTFT CDF](ttft_cdf.png)", "",
              "![TTFT and TPOT over time](latency_over_time.png)", "",
              "![Per-endpoint load](endpoint_load.png)", ""]
    scrape_errors = meta.get("scrape_errors") or {}
    if scrape_errors:
        lines += ["Endpoint scrape problems: " +
                  "; ".join(f"{e}: {m}" for e, m in scrape_errors.items()), ""]
    return "\n".join(lines)


def plot_all(out: Path, meta: dict, runs: list[dict]) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [out / "ttft_cdf.png", out / "latency_over_time.png", out / "endpoint_load.png"]
    by_port: dict[str, list[RequestSample]] = {}
    for run in runs:
        by_port.setdefault(str(run["port"]), []).extend(run["samples"])

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for port, samples in by_port.items():
        ttft = np.sort([s.ttft for s in samples if s.success])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=f"port {port}")
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for run in runs:
        ok = [s for s in run["samples"] if s.success]
        if not ok:
            continue
        t0 = min(s.start for s in run["samples"])
        label = f"port {run['port']} rep {run['rep']}"
        axes[0].scatter([s.start - t0 for s in ok], [s.ttft for s in ok], s=8, label=label)
        tp = [s for s in ok if s.tpot is not None]
        axes[1].scatter([s.start - t0 for s in tp], [s.tpot * 1000 for s in tp], s=8,
                        label=label)
    axes[0].set(ylabel="TTFT (s)", title="TTFT and TPOT by request send time")
    axes[1].set(ylabel="TPOT (ms)", xlabel="seconds since the run started")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    series = [("running", "running requests"), ("waiting", "waiting requests"),
              ("kv_usage", "KV cache usage")]
    fig, axes = plt.subplots(3, len(runs), figsize=(4.5 * len(runs), 8), squeeze=False,
                             sharey="row")
    for col, run in enumerate(runs):
        t0 = min((s.start for s in run["samples"]), default=0.0)
        endpoints = sorted({row["endpoint"] for row in run["load"]})
        for row_i, (key, label) in enumerate(series):
            ax = axes[row_i][col]
            for endpoint in endpoints:
                rows = [r for r in run["load"] if r["endpoint"] == endpoint
                        and r.get(key) is not None]
                ax.plot([r["t"] - t0 for r in rows], [r[key] for r in rows],
                        label=endpoint.replace("http://", ""))
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel(label)
            if row_i == 0:
                ax.set_title(f"port {run['port']} rep {run['rep']}")
                if endpoints:
                    ax.legend(fontsize=7)
            if row_i == 2:
                ax.set_xlabel("seconds since the run started")
            if not endpoints and row_i == 0:
                ax.text(0.5, 0.5, "no /metrics scraped", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=100)
    plt.close(fig)
    return paths


def write_report(out: str | Path) -> str:
    """(Re)write report.md and the plots of a results folder; returns the Markdown text."""
    out = Path(out)
    meta, results, runs = load_folder(out)
    text = markdown(meta, results, runs)
    (out / "report.md").write_text(text, encoding="utf-8")
    plot_all(out, meta, runs)
    return text
