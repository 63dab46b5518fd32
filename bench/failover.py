"""The picker's failover through the real Envoy (`python -m bench failover`).

Runs tests/e2e/test_e2e_failover.py with FAILOVER_BENCH=1: the local stack as base/picker and
base/gateway deploy the picker (2 replicas active-passive on a real API server's Lease, linked,
both health-checked by Envoy), steady streamed completions on 8081 (50/s), and a minute around
each fault: SIGTERM of the acting leader (a rolling update), SIGKILL (a crash), SIGSTOP for 10 s
(a hung replica), the API server stopped for 30 s. Both body modes for the faults that cut
streams. Every figure is one a test recorded (pytest record_property) before checking its
targets: a run whose targets failed is a failed benchmark run, except the one the test marks as
not met yet (requests sent after a SIGKILL that failed: its own column).
"""

from __future__ import annotations

import json

from bench.markdown import md_table
from bench.robustness import _pytest

TEST = "tests/e2e/test_e2e_failover.py"


def run() -> dict:
    return _pytest("failover", TEST, ["--timeout", "1800"],
                   lambda props: {"cases": [json.loads(p["figures"]) for p in props.values()]},
                   command="FAILOVER_BENCH=1 ", env={"FAILOVER_BENCH": "1"})


def _s(v) -> str:
    return "" if v is None else f"{v:.2f}"


def report(d: dict) -> list[str]:
    out = [f"Command: `{d['command']}` ({d['wall_s']:.0f} s wall). The local stack with `pickers=2` "
           "(`make up PICKERS=2`): 3 simulated groups (speedup 100), the picker's 2 replicas "
           "active-passive on a Lease of a real kube-apiserver (test-sized: lease 2 s, renew "
           "deadline 1.5 s, retry 0.25 s), linked (`--peers`), both in the gateway's picker Backend "
           "with base/gateway's health checks (gRPC, every 100 ms) and retries; 50 streamed "
           "completions a second on 8081; 30 s before and after each fault. \"Open at the fault\": "
           "requests sent before it and not finished; \"affected\": running at the fault or sent "
           "until 5 s after it ended, and failed or with a first token later than twice the "
           "steady P99 + 100 ms; the degraded window runs from the first affected request's "
           "send to the last one's end. Unrouted: Envoy's count of requests let through "
           "without the picker (failOpen; 0 by design with FailClose). TTFT in wall ms "
           "(x 100 = model time).", ""]
    rows = [[c["case"], c["body_mode"], c["requests"], c["failed"], c["failed_arriving_after"],
             f"{c['open_at_fault_failed']} of {c['open_at_fault']}", c["unrouted"],
             _s(c["degraded_window_s"]), _s(c["longest_request_s"]), c["mean_ttft_ms"], c["p99_ttft_ms"]]
            for c in d["cases"]]
    return out + md_table(["fault", "body mode", "requests", "failed", "failed, sent after the fault",
                           "failed of open at the fault", "unrouted", "degraded window (s)",
                           "longest request (s)", "mean TTFT ms", "P99 TTFT ms"], rows)
