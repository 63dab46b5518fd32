"""Markdown report and PNG plots of a comparison results folder (see loadtest/compare.py).

Folder layout (written by compare, read back here so a report can be regenerated):
    compare.json                  settings and the list of runs (port, rep, stem) in run order
    <port>.json                   vLLM result over all repetitions of that port
    <port>-rep<k>.json            one run's vLLM result (with one repetition the run is <port>.*)
    <port>-rep<k>.samples.jsonl   its raw per-request samples
    <port>-rep<k>.load.jsonl      its /metrics scrapes {t, endpoint, running, waiting, kv_usage}
    report.md, ttft_cdf.png, latency_over_time.png, endpoint_load.png
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np

from loadtest.metrics import RequestSample, percent_change, read_samples, summarize
from loadtest.targets import clock_note, routing

LATENCIES = [("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2el")]
TAIL_ROWS = [
    ("Output token throughput (tok/s)", "output_throughput", 2),
    ("Total token throughput (tok/s)", "total_token_throughput", 2),
    ("Request throughput (req/s)", "request_throughput", 3),
    ("Goodput (req/s within SLOs)", "request_goodput", 3),
    ("Completed requests", "completed", 0),
    ("Failed requests", "failed", 0),
    ("Duration (s)", "duration", 1),
]


def _pkey(p: float) -> str:
    return f"p{int(p) if int(p) == p else p}"


def table_rows(percentiles=(99,)) -> list[tuple[str, str, int]]:
    """(label, result key, decimals): mean, median and the chosen percentiles of each latency
    (the article's table: mean, median, P99 TTFT), then throughputs and counts."""
    rows = []
    for name, key in LATENCIES:
        rows += [(f"Mean {name} (ms)", f"mean_{key}_ms", 1),
                 (f"Median {name} (ms)", f"median_{key}_ms", 1)]
        rows += [(f"{_pkey(p).upper()} {name} (ms)", f"{_pkey(p)}_{key}_ms", 1)
                 for p in percentiles if p != 50]
    return rows + TAIL_ROWS


TABLE_ROWS = table_rows()


def _fmt(value, decimals: int) -> str:
    if value is None:
        return "-"
    return f"{value:,.{decimals}f}"


def change_pct(base: float | None, other: float | None) -> str:
    change = percent_change(base, other)
    return "-" if change is None else f"{change:+.1f} %"


def named(meta: dict, port) -> str:
    """The port's routing label as recorded when the runs were made."""
    return (meta.get("routing") or {}).get(str(port)) or routing(port)


def comparison_table(results: dict[str, dict], percentiles=None,
                     spreads: dict[str, dict] | None = None) -> str:
    """Markdown table: one column per port, and the change of each port against the first.

    spreads: {port: {key: (min, max)}} over repetitions, shown as "value (min-max)"."""
    ports = list(results)
    head = "| Metric | " + " | ".join(results[p].get("routing") or routing(p) for p in ports)
    head += "".join(f" | change {p} vs {ports[0]}" for p in ports[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(ports) - 1)]
    for label, key, decimals in table_rows(percentiles or (99,)):
        values = [results[p].get(key) for p in ports]
        if key == "request_goodput" and all(v is None for v in values):
            continue
        cells = []
        for p, v in zip(ports, values):
            cell = _fmt(v, decimals)
            low_high = (spreads or {}).get(p, {}).get(key)
            if low_high and v is not None:
                cell += f" ({_fmt(low_high[0], decimals)}-{_fmt(low_high[1], decimals)})"
            cells.append(cell)
        cells += [change_pct(values[0], v) for v in values[1:]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def spread(meta: dict, runs: list[dict]) -> dict[str, dict]:
    """{port: {result key: (min, max) over its repetitions}}; {} with one repetition."""
    if meta.get("repetitions", 1) < 2:
        return {}
    stats = {"percentiles": meta.get("percentiles") or (99,), "goodput": meta.get("goodput")}
    by_port: dict[str, list[dict]] = {}
    for run in runs:
        by_port.setdefault(str(run["port"]), []).append(summarize(run["samples"], **stats))
    out = {}
    for port, results in by_port.items():
        out[port] = {key: (min(r[key] for r in results), max(r[key] for r in results))
                     for key in results[0] if isinstance(results[0][key], (int, float))}
    return out


def headline(meta: dict) -> str:
    """One sentence that says what was run and how to read the times."""
    settings = meta.get("workload_settings", {})
    label = f"{meta['label']}: " if meta.get("label") else ""
    reps = meta.get("repetitions", 1)
    return (f"{label}workload {meta['workload']} ({settings.get('num_prompts', '?')} prompts, "
            f"concurrency {meta['concurrency']}, request rate {meta['request_rate'] or 'inf'}), "
            f"{' vs '.join(named(meta, p) for p in meta['ports'])}; {reps} repetition"
            f"{'s' if reps != 1 else ''} per port{' (value and min-max)' if reps > 1 else ''}; "
            f"{clock_note(meta.get('speedup'))}")


def plot_subtitle(meta: dict) -> str:
    """Workload, clock and routing of each port, for every plot title."""
    speed = meta.get("speedup")
    if speed is None:
        clock = "wall clock, speedup unknown"
    else:
        clock = "wall clock" if speed == 1 else f"wall clock at speedup {speed:g}"
    lines = [meta["label"]] if meta.get("label") else []
    lines += [f"workload {meta['workload']}, {clock}", " vs ".join(named(meta, p) for p in meta["ports"])]
    # wrapped, so that the titles of side-by-side plots do not run into each other
    return "\n".join(textwrap.fill(line, 60) for line in lines)


def port_colors(ports) -> dict[str, str]:
    return {str(p): f"C{i}" for i, p in enumerate(ports)}


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
    ports = " vs ".join(named(meta, p) for p in meta["ports"])
    title = f"{meta['label']}: " if meta.get("label") else ""
    goodput = meta.get("goodput") or {}
    lines = [
        f"# {title}{ports}, workload {meta['workload']}", "",
        f"**{headline(meta)}.**", "",
        f"- host: `{meta['host']}`, endpoint `{meta['endpoint']}`, model `{meta['model']}`",
        "- routing: " + "; ".join(f"port {named(meta, p)}" for p in meta["ports"]),
        f"- workload: `{meta['workload']}` ({settings}), seed {meta['seed']}, "
        f"concurrency {meta['concurrency']}, request rate {meta['request_rate'] or 'inf'}",
        f"- run order (same prompts for every run): {order}",
        f"- started {meta['started']}",
    ]
    if goodput:
        lines.append("- goodput SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in goodput.items()))
    lines += ["",
        "Statistics follow vLLM's serving benchmark (raw samples, numpy; tokens from the "
        "server's `usage`). Change is relative to the first port; for latencies negative is "
        "better, for throughput positive is better. With several repetitions a value is over "
        "all of them, and (min-max) is the spread of the single runs.", "",
        comparison_table(results, meta.get("percentiles"), spread(meta, runs)),
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

    colors = port_colors(meta["ports"])
    subtitle = plot_subtitle(meta)
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for port, samples in by_port.items():
        ttft = np.sort([s.ttft for s in samples if s.success])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=named(meta, port),
                    color=colors.get(port))
    ax.set(xlabel="TTFT (s, wall clock)", ylabel="fraction of requests",
           title=f"TTFT CDF\n{subtitle}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    markers = "o^sDv"
    for run in runs:
        ok = [s for s in run["samples"] if s.success]
        if not ok:
            continue
        t0 = min(s.start for s in run["samples"])
        label = f"{named(meta, run['port'])} rep {run['rep']}"
        style = {"s": 8, "color": colors.get(str(run["port"])), "label": label,
                 "marker": markers[(run["rep"] - 1) % len(markers)], "alpha": 0.7}
        axes[0].scatter([s.start - t0 for s in ok], [s.ttft for s in ok], **style)
        tp = [s for s in ok if s.tpot is not None]
        axes[1].scatter([s.start - t0 for s in tp], [s.tpot * 1000 for s in tp], **style)
    axes[0].set(ylabel="TTFT (s)", title=f"TTFT and TPOT by request send time\n{subtitle}")
    axes[1].set(ylabel="TPOT (ms)", xlabel="seconds since the run started (wall clock)")
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
                ax.set_title(f"{named(meta, run['port'])} rep {run['rep']}", fontsize=9)
                if endpoints:
                    ax.legend(fontsize=7)
            if row_i == 2:
                ax.set_xlabel("seconds since the run started (wall clock)")
            if not endpoints and row_i == 0:
                ax.text(0.5, 0.5, "no /metrics scraped", ha="center", transform=ax.transAxes)
    fig.suptitle(f"Per-endpoint load during each run ({subtitle.replace(chr(10), '; ')})",
                 fontsize=9)
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


# --- rate sweep (loadtest/sweep.py) --------------------------------------------------------------

def load_sweep(out: Path) -> tuple[dict, list[dict]]:
    meta = json.loads((out / "sweep.json").read_text())
    points = []
    for run in meta["runs"]:
        result = json.loads((out / f"{run['stem']}.json").read_text())
        points.append({**run, "result": result})
    return meta, points


def sweep_table(out: str | Path) -> str:
    meta, points = load_sweep(Path(out))
    goodput = bool(meta.get("goodput"))
    head = ["Rate (req/s)", "Port (routing)", "Completed", "Failed", "Req/s",
            *(["Goodput (req/s)"] if goodput else []), "Mean TTFT (ms)", "Median TTFT (ms)",
            "P99 TTFT (ms)", "Mean TPOT (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in sorted(points, key=lambda p: (p["rate"], meta["ports"].index(p["port"]))):
        r = p["result"]
        cells = [f"{p['rate']:g}", named(meta, p["port"]), _fmt(r["completed"], 0),
                 _fmt(r["failed"], 0), _fmt(r["request_throughput"], 3)]
        if goodput:
            cells.append(_fmt(r.get("request_goodput"), 3))
        cells += [_fmt(r["mean_ttft_ms"], 1), _fmt(r["median_ttft_ms"], 1),
                  _fmt(r.get("p99_ttft_ms"), 1), _fmt(r["mean_tpot_ms"], 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_sweep_report(out: str | Path) -> str:
    """(Re)write report.md and sweep.png of a sweep folder; returns the Markdown text."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    meta, points = load_sweep(out)
    slos = meta.get("goodput") or {}
    colors = port_colors(meta["ports"])
    subtitle = plot_subtitle(meta)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for port in meta["ports"]:
        mine = sorted((p for p in points if p["port"] == port), key=lambda p: p["rate"])
        rates = [p["rate"] for p in mine]
        style = {"color": colors[str(port)], "marker": "o"}
        axes[0].plot(rates, [p["result"]["median_ttft_ms"] for p in mine],
                     label=f"{named(meta, port)} median", **style)
        axes[0].plot(rates, [p["result"].get("p99_ttft_ms", np.nan) for p in mine],
                     label=f"{named(meta, port)} P99", linestyle="--", **style)
        key = "request_goodput" if slos else "request_throughput"
        axes[1].plot(rates, [p["result"].get(key, np.nan) for p in mine],
                     label=named(meta, port), **style)
    top = max(meta["rates"]) if meta["rates"] else 1
    axes[1].plot([0, top], [0, top], color="grey", linewidth=0.8, label="offered rate")
    axes[0].set(xlabel="request rate (req/s)", ylabel="TTFT (ms, wall clock)",
                title=f"TTFT against request rate\n{subtitle}")
    slo_text = ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items())
    axes[1].set(xlabel="request rate (req/s)",
                ylabel="goodput (req/s within SLOs)" if slos else "completed req/s",
                title=(f"Goodput ({slo_text}) against request rate" if slos else
                       "Throughput against request rate (no --goodput SLOs)") + f"\n{subtitle}")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=110)
    plt.close(fig)
    settings = ", ".join(f"{k}={v}" for k, v in meta.get("workload_settings", {}).items())
    title = f"{meta['label']}: " if meta.get("label") else ""
    text = "\n".join([
        f"# {title}Rate sweep: {' vs '.join(named(meta, p) for p in meta['ports'])}, "
        f"workload {meta['workload']}", "",
        f"**Rates {', '.join(f'{r:g}' for r in meta['rates'])} req/s (gamma gaps, burstiness "
        f"{meta.get('burstiness', 1):g}), at most {meta['concurrency']} in flight; "
        f"{clock_note(meta.get('speedup'))}.**", "",
        f"- host `{meta['host']}`, endpoint `{meta['endpoint']}`, model `{meta['model']}`",
        f"- workload `{meta['workload']}` ({settings}), seed {meta['seed']}; every run sends "
        "the same prompts at the same send times; the port order alternates between rates",
        f"- goodput SLOs: {slo_text or 'none (pass --goodput ttft:MS tpot:MS)'}",
        f"- started {meta['started']}", "",
        sweep_table(out), "![TTFT and goodput against rate](sweep.png)", ""])
    (out / "report.md").write_text(text, encoding="utf-8")
    return text
