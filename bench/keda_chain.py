"""The `keda-chain` benchmark: tests/autoscaling/test_keda_chain.py (Prometheus -> KEDA -> HPA ->
LeaderWorkerSet -> simulated groups -> the picker, on loopback) with its assertions, and the
timeline it records: how long from the load's rise to the new group serving, how long the count
holds while the signal is wrong or gone (Prometheus stopped, no series, NaN then +Inf) and through a
picker restart, how long the way down takes. Needs `make autoscaling-tools`."""

from __future__ import annotations

import json
import re

from bench.markdown import md_table
from bench.robustness import _pytest

TEST = "tests/autoscaling/test_keda_chain.py"


def run() -> dict:
    return _pytest("keda-chain", TEST, ["-s"],
                   lambda props: {"timeline": json.loads(next(iter(props.values()))["timeline"])})


def report(d: dict) -> list[str]:
    t = d["timeline"]
    # The test's Prometheus listens on a free port: the address says where, not which port.
    changes = "; ".join(f"`{k}` {a} -> {re.sub(r':[0-9]+$', ':<free port>', str(b))}"
                        for k, (a, b) in t["changes"].items())
    out = [f"Command: `{d['command']}` ({d['wall_s']:.0f} s wall, load average {d['load_average_start']} at "
           "the start). The real KEDA (operator + metrics API server), kube-controller-manager's HPA controller "
           "and kube-apiserver, Debian's Prometheus; simulated groups started and stopped by the test's "
           "stand-in for the LeaderWorkerSet controller and the kubelet; requests through the picker "
           f"(Kubernetes discovery) by the test's stand-in for Envoy. The ScaledObject as rendered, but: {changes}; "
           "HPA sync 1 s, scrape 1 s. Seconds from each phase's start:", ""]
    rows = [["load rises (2 -> 11 in flight)", f"spec.replicas {t['spec_up_s']:.1f}", f"picker lists the new group "
             f"{t['listed_s']:.1f}", f"first request sent to it {t['routed_s']:.1f}, answered {t['served_s']:.1f}"],
            *case_rows(t),
            ["load falls, signal right", f"first group removed {t['first_down_s']:.1f}",
             f"minimum {t['min_s']:.1f}", f"removed group drained and gone {t['gone_s']:.1f}"]]
    return out + md_table(["phase", "", "", ""], rows) + [
        "", f"{t['requests']} requests, {t['failed']} failed (all while the picker was down)."]


CASES = {"prometheus_stopped": "Prometheus stopped, then load falls",
         "no_series": "every leader's /metrics failing (no series), then load falls",
         "nan_then_inf": "one leader's gauge NaN, then +Inf; load falls"}


def case_rows(t: dict) -> list[list[str]]:
    """One row per wrong-signal case (each timed from the load's fall) and the picker restart."""
    cases = t.get("cases", {})
    rows = [[what, f"query wrong after {c['wrong_s']:.1f}; KEDA fallback active {c['fallback_s']:.1f} after the fall",
             f"count held at {t['raised_to']} for {c['held_s']:.1f} (HPA: {c['hpa_reason']})",
             f"signal read again {c['mended_s']:.1f} after mending"]
            for key, what in CASES.items() if (c := cases.get(key))]
    if (p := cases.get("picker_restart")):
        rows.append(["picker killed and started again (load high)", f"serving {p['serving_s']:.1f}",
                     f"lists every group {p['listed_s']:.1f}",
                     f"count held, no fallback; lowest signal {p['lowest_signal']:g} in flight"])
    return rows
