"""The `demo` benchmark: `make demo` as a user runs it, on the real data plane."""

from __future__ import annotations

from bench.common import PY, REPO, RESULTS, read_json, run_suite, shown
from bench.markdown import md_table, versus
from local.dataplane import EG_VERSION, ENVOY_VERSION


def run() -> dict:
    """`make demo` as a user runs it: the stack on the real data plane, both listeners compared,
    with the CPU of every process and Envoy's own listener counters (`python -m local.stack demo`)."""
    out = RESULTS / "demo"
    cmd = [PY, "-m", "local.stack", "demo", "--name", "bench-demo", "--out", str(out)]

    def results() -> dict:
        ports = read_json(out / "dataplane.json")
        return {"dataplane": ports, "results": {name: read_json(out / f"{port}.json")
                                                for name, port in ports["listeners"].items()}}
    return run_suite("demo", cmd, results, log=RESULTS / "demo.log", command="make demo (" + shown(cmd) + ")",
                     results_dir=str(out.relative_to(REPO)), envoy_gateway=EG_VERSION, envoy=ENVOY_VERSION)


def report(d: dict) -> list[str]:
    dp = d["dataplane"]
    versions = f"Envoy Gateway {d.get('envoy_gateway', EG_VERSION)} (standalone) and Envoy {d.get('envoy', ENVOY_VERSION)}"
    out = [f"Command: `{d['command']}`, {d['wall_s']:.0f} s wall (Go tools already built): 3 simulator processes, "
           f"the picker, {versions}, `loadtest compare` of listener `http` "
           f"(least request) vs `llm-gw` (picker) on the `{dp['workload']}` workload, speedup {dp['speedup']:g} "
           "(times are wall-clock ms at that speedup). Results: "
           f"`{d['results_dir']}/report.md`.", ""]
    out += md_table(["listener", "mean TTFT ms", "median TTFT ms", "P99 TTFT ms", "mean TPOT ms", "output tok/s",
                   "completed", "failed"],
                  [[f"{name} ({dp['listeners'][name]})", f"{r['mean_ttft_ms']:,.0f}", f"{r['median_ttft_ms']:,.0f}",
                    f"{r['p99_ttft_ms']:,.0f}", f"{r['mean_tpot_ms']:.1f}", f"{r['output_throughput']:.1f}",
                    r["completed"], r["failed"]] for name, r in d["results"].items()])
    lr, pk = d["results"].get("http"), d["results"].get("llm-gw")
    if lr and pk:
        out += ["", f"llm-gw vs http: mean TTFT {versus(pk['mean_ttft_ms'], lr['mean_ttft_ms'])}, P99 TTFT "
                    f"{versus(pk['p99_ttft_ms'], lr['p99_ttft_ms'])}, output throughput "
                    f"{versus(pk['output_throughput'], lr['output_throughput'])}."]
    out += ["", f"CPU of every process during the comparison ({dp['wall_s']:.0f} s, {dp['cores']} cores):", ""]
    out += md_table(["process", "CPU s", "cores"],
                  [[name, f"{cpu:.1f}", f"{cpu / dp['wall_s']:.2f}"] for name, cpu in dp["cpu_s"].items()])
    stats = dp["envoy_listener_stats"]
    out += ["", "Envoy's own counters per listener during the comparison:", ""]
    out += md_table(["listener", *(s.replace("downstream_", "") for s in next(iter(stats.values())))],
                  [[name, *values.values()] for name, values in stats.items()])
    return out

