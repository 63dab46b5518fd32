"""Live per-port statistics of a running load test, for the web UI (no locust/gevent imports).

Percentiles come from the raw samples with numpy, as in the result JSONs; the series over time
bin requests by the time they finished, counted from the start of the phase that sent them, so
in A/B mode both ports' curves start at 0 and overlay.
"""
from __future__ import annotations

import numpy as np

from loadtest.metrics import METRICS, RequestSample, meets_slos, metric_values
from loadtest.targets import routing

LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E"}


def _pkey(p: float) -> str:
    return f"p{int(p) if int(p) == p else p}"


def table_structure(percentiles, goodput: bool) -> list[dict]:
    """Columns of the per-port table (locust's extended-table structure)."""
    cols = [("port", "Port (routing)"), ("state", "Phase / state"), ("requests", "Requests"),
            ("failures", "Failures"), ("rps", "Req/s"), ("outtoks", "Output tok/s")]
    if goodput:
        cols.append(("goodput", "Goodput req/s"))
    for name in METRICS:
        cols.append((f"{name}mean", f"{LABELS[name]} mean (ms)"))
        cols += [(f"{name}{_pkey(p)}", f"{LABELS[name]} {_pkey(p).upper()} (ms)")
                 for p in percentiles]
    return [{"key": key, "title": title} for key, title in cols]


def port_row(port: str, samples: list[RequestSample], state: str, percentiles,
             goodput: dict | None, name: str | None = None) -> dict:
    ok = [s for s in samples if s.success]
    duration = (max(s.end for s in samples) - min(s.start for s in samples)) if samples else 0.0
    row = {"port": name or routing(port or None), "state": state, "requests": len(samples),
           "failures": len(samples) - len(ok),
           "rps": round(len(ok) / duration, 3) if duration > 0 else 0.0,
           "outtoks": round(sum(s.output_tokens for s in ok) / duration, 1) if duration > 0
           else 0.0}
    if goodput:
        good = sum(meets_slos(s, goodput) for s in ok)
        row["goodput"] = round(good / duration, 3) if duration > 0 else 0.0
    values = metric_values(samples)
    for name in METRICS:
        ms = np.asarray(values[name], dtype=float) * 1000.0
        row[f"{name}mean"] = round(float(ms.mean()), 1) if ms.size else "-"
        for p in percentiles:
            row[f"{name}{_pkey(p)}"] = round(float(np.percentile(ms, p)), 1) if ms.size else "-"
    return row


def series(samples: list[RequestSample], t0: float, percentiles, bins: int = 30) -> dict:
    """{metric: {"t": [...], "pXX": [...]}}: per time bin (by finish time - t0), ms."""
    ok = [s for s in samples if s.success]
    if not ok:
        return {}
    ends = np.array([s.end - t0 for s in ok])
    width = max(float(ends.max()) / bins, 1.0)
    index = np.minimum((ends / width).astype(int), bins - 1)
    out: dict = {}
    for name in METRICS:
        per_bin: dict[int, list[float]] = {}
        for i, s in zip(index, ok):
            vals = s.itl if name == "itl" else [{"ttft": s.ttft, "tpot": s.tpot,
                                                  "e2el": s.latency}[name]]
            per_bin.setdefault(int(i), []).extend(v for v in vals if v is not None)
        keys = sorted(k for k, v in per_bin.items() if v)
        if not keys:
            continue
        entry = {"t": [round((k + 1) * width, 2) for k in keys]}
        for p in percentiles:
            entry[_pkey(p)] = [round(float(np.percentile(per_bin[k], p)) * 1000.0, 2)
                               for k in keys]
        out[name] = entry
    return out
