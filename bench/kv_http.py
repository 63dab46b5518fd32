"""The `precise-http` benchmark: `make demo` twice on the real data plane, the picker routing on
the simulators' KV-cache events (the local stack's default) and on its approximate index
(`--no-precise-prefix`), both listeners each time. During the precise run the picker's /metrics
is polled for its KV-event lag (receive time minus the batch's timestamp, per endpoint): the
delivery delay the lab models (lab/picker_policy.py KV_EVENTS_DELAY).

Run it under the local stack's lock: `flock /tmp/local-stack.lock python -m bench precise-http`.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import threading
import time
import urllib.request

from bench.common import PY, REPO, RESULTS, load_average, read_json, save, shown, stamp
from bench.markdown import md_table, num, versus

MODES = {"precise": [], "approximate": ["--no-precise-prefix"]}
METRICS_URL = "http://127.0.0.1:9090/metrics"
_LINE = re.compile(r'^(picker_kv_event_lag_seconds|picker_kv_endpoint_in_sync|picker_kv_event_batches_total)'
                   r'\{endpoint="([^"]+)"\} ([0-9.eE+-]+)$')


def _poll(stop: threading.Event, samples: list, interval: float = 0.25) -> None:
    last_batches: dict[str, float] = {}
    while not stop.wait(interval):
        try:
            text = urllib.request.urlopen(METRICS_URL, timeout=1).read().decode()
        except OSError:
            continue
        values: dict = {}
        for line in text.splitlines():
            m = _LINE.match(line)
            if m:
                values.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
        for endpoint, v in values.items():
            batches = v.get("picker_kv_event_batches_total")
            fresh = batches is not None and batches != last_batches.get(endpoint)
            last_batches[endpoint] = batches
            if fresh and "picker_kv_event_lag_seconds" in v:   # a batch arrived since last poll
                samples.append({"endpoint": endpoint, "lag_s": v["picker_kv_event_lag_seconds"],
                                "in_sync": v.get("picker_kv_endpoint_in_sync", 0.0)})


def run() -> dict:
    load_start = load_average()
    out, commands, wall, lag_samples = {}, {}, 0.0, []
    for mode, extra in MODES.items():
        d = RESULTS / "precise-http" / mode
        cmd = [PY, "-m", "local.stack", "demo", "--name", f"bench-{mode}", "--out", str(d), *extra]
        commands[mode] = shown(cmd)
        stop = threading.Event()
        poller = threading.Thread(target=_poll, args=(stop, lag_samples if mode == "precise" else []))
        poller.start()
        started = time.perf_counter()
        log = (RESULTS / f"precise-http-{mode}.log").open("w")
        try:
            subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
        finally:
            stop.set()
            poller.join()
            log.close()
        wall += time.perf_counter() - started
        ports = read_json(d / "dataplane.json")
        out[mode] = {"dataplane": ports, "results": {name: read_json(d / f"{port}.json")
                                                     for name, port in ports["listeners"].items()}}
    lags = sorted(s["lag_s"] for s in lag_samples)
    lag = ({"samples": len(lags), "mean_s": statistics.fmean(lags),
            "median_s": statistics.median(lags), "p99_s": lags[int(0.99 * (len(lags) - 1))],
            "in_sync_share": sum(s["in_sync"] for s in lag_samples) / len(lag_samples)}
           if lags else {"samples": 0})
    data = {"commands": commands, "wall_s": wall, "load_average_start": load_start, "modes": out,
            "lag": lag, **stamp()}
    save("precise-http", data)
    return data


def report(d: dict) -> list[str]:
    first = next(iter(d["modes"].values()))["dataplane"]
    out = [f"Command: `flock /tmp/local-stack.lock python -m bench precise-http` ({d['wall_s']:.0f} s "
           f"wall): `make demo` twice (`{d['commands']['precise']}`, then with `--no-precise-prefix`), "
           f"3 simulator processes publishing KV-cache events, the picker, Envoy Gateway and Envoy, "
           f"`loadtest compare` of both listeners on the `{first['workload']}` workload at speedup "
           f"{first['speedup']:g} (wall-clock ms). `http` is least request in both runs (a control "
           "for run-to-run spread).", ""]
    rows = []
    for mode, m in d["modes"].items():
        for name, r in m["results"].items():
            rows.append([mode, name, num(r["mean_ttft_ms"]), num(r["median_ttft_ms"]),
                         num(r["p99_ttft_ms"]), num(r["output_throughput"], 1), r["completed"],
                         r["failed"]])
    out += md_table(["picker", "listener", "mean TTFT ms", "median TTFT ms", "P99 TTFT ms",
                     "output tok/s", "completed", "failed"], rows)
    p, a = d["modes"].get("precise"), d["modes"].get("approximate")
    if p and a and "llm-gw" in p["results"] and "llm-gw" in a["results"]:
        pk, ak = p["results"]["llm-gw"], a["results"]["llm-gw"]
        out += ["", f"llm-gw, precise vs approximate: mean TTFT {versus(pk['mean_ttft_ms'], ak['mean_ttft_ms'])}, "
                    f"P99 TTFT {versus(pk['p99_ttft_ms'], ak['p99_ttft_ms'])}, output throughput "
                    f"{versus(pk['output_throughput'], ak['output_throughput'])}."]
    lag = d["lag"]
    if lag.get("samples"):
        out += ["", f"KV-event delivery lag in the picker's signals process (`picker_kv_event_lag_seconds`, "
                    f"receive time minus the batch's timestamp, sampled when a new batch had arrived; "
                    f"{lag['samples']} samples): mean {lag['mean_s'] * 1000:.1f} ms, median "
                    f"{lag['median_s'] * 1000:.1f} ms, P99 {lag['p99_s'] * 1000:.1f} ms wall; endpoints in "
                    f"sync in {lag['in_sync_share']:.0%} of the samples. The workers get the index "
                    f"changes within the picker's flush interval on top (10 ms)."]
    return out
