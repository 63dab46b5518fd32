"""The picker under hostile traffic (soak) and dead or stalled backends on the real data plane.

    python -m bench soak [--soak-seconds 180]   picker/tests/test_abuse.py for that long
    python -m bench dead-backend                tests/e2e/test_e2e_dead_backend.py (both listeners)

Both run the test suite's own scenario, with its assertions, and read the figures each test
records (pytest `record_property`, in a JUnit XML report), so a figure here is one a passing test
measured.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from bench.common import PY, RESULTS, run_suite, shown
from bench.markdown import md_table

SOAK_TEST = "picker/tests/test_abuse.py"
EDGE_ABUSE_TEST = "tests/e2e/test_e2e_edge_abuse.py"
TOKEN_BUDGET_TEST = "tests/e2e/test_e2e_token_budget.py"
DEAD_BACKEND_TEST = "tests/e2e/test_e2e_dead_backend.py"


def recorded(junit_xml) -> dict[str, dict[str, str]]:
    """Test name -> the properties it recorded."""
    out = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if props:
            out[case.get("name")] = props
    return out


def _pytest(name: str, test: str, extra: list[str], read, command: str = "", env: dict[str, str] | None = None,
            **fields) -> dict:
    """Run `test` with pytest, then save what `read(recorded properties)` makes of its figures."""
    xml = RESULTS / f"{name}.junit.xml"
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", test, *extra, f"--junitxml={xml}"]
    return run_suite(name, cmd, lambda: read(recorded(xml)), log=RESULTS / f"{name}.log",
                     command=command + shown(cmd), env=env, **fields)


def soak(seconds: float = 180.0) -> dict:
    return _pytest("soak", SOAK_TEST, ["-m", "soak", "--timeout", str(int(seconds) + 600)],
                   lambda props: {"rounds": json.loads(next(iter(props.values()))["rounds"])},
                   command=f"PICKER_SOAK_SECONDS={seconds:g} ", env={"PICKER_SOAK_SECONDS": f"{seconds:g}"},
                   seconds=seconds)


def dead_backend() -> dict:
    return _pytest("dead-backend", DEAD_BACKEND_TEST, [],
                   lambda props: {"runs": [json.loads(p["figures"]) for p in props.values()]})


def edge_abuse() -> dict:
    return _pytest("edge-abuse", EDGE_ABUSE_TEST, [],
                   lambda props: {"figures": {k: v for p in props.values() for k, v in p.items()}})


def token_budget() -> dict:
    return _pytest("token-budget", TOKEN_BUDGET_TEST, [],
                   lambda props: {"figures": {k: json.loads(v) for p in props.values() for k, v in p.items()}})


# -- BENCHMARKS.md -------------------------------------------------------------------------------

def edge_abuse_report(d: dict) -> list[str]:
    out = [f"Command: `{d['command']}` ({d['wall_s']:.0f} s wall). The local stack with the cluster's edge "
           "(`components/edge-security`, plain HTTP), 2 simulated groups. What was sent, the statuses Envoy "
           "answered, and what reached the picker or a backend (its decision log, Envoy's upstream request "
           "counts): nothing, in every row (the test fails otherwise).", ""]
    rows = [[name, text] for name, text in sorted(d["figures"].items())]
    return out + md_table(["case (listener)", "sent: Envoy's answers"], rows)


def token_budget_report(d: dict) -> list[str]:
    f = d["figures"]
    out = [f"Command: `{d['command']}` ({d['wall_s']:.0f} s wall). The local stack with "
           "`components/token-budget`: Envoy Gateway's global rate limit, the Envoy rate limit service and "
           "Redis; one client (`user`) alternating both listeners.", ""]
    rows = []
    if "sequential" in f:
        s = f["sequential"]
        rows.append(["one at a time, not streamed", s["budget"], s["served"], s["charged"],
                     s["charged"] - s["budget"], f"request #{s['refused_at']} (predicted #{s['predicted']})",
                     "one request's charge"])
    if "streamed" in f:
        s = f["streamed"]
        rows.append([f"{s['workers']} concurrent streams", s["budget"], s["served"], s["charged"],
                     s["overshoot"], "every stream's next request", f"{s['bound']} (workers x largest charge)"])
    out += md_table(["load", "budget (tokens)", "requests served", "tokens charged",
                     "beyond the budget", "first refusal", "bound"], rows)
    if "window_edge" in f:
        w = f["window_edge"]
        out += ["", f"Fixed windows: a budget of {w['budget']} tokens per {w['unit'].lower()}, spent from second 50 "
                    f"of a minute ({w['first_window']} tokens) and again as the next minute began "
                    f"({w['second_window']}): {w['spent']} tokens within {w['span_s']} s, "
                    f"{w['spent'] / w['budget']:.2f} budgets (the bound: 2 budgets plus the request that crosses each)."]
    limits = [(k.removeprefix("request_limit_"), v) for k, v in sorted(f.items()) if k.startswith("request_limit_")]
    if limits:
        out += ["", "The request rate limit beside the budget (a burst at once, budget not reached): "
                + "; ".join(f"{name}: {v['sent']} sent, {v['served']} served, {v['refused']} refused with "
                            f"`{v['body']}`" for name, v in limits) + "."]
    return out

def soak_report(d: dict) -> list[str]:
    rounds = d["rounds"]
    base, abused = rounds[0], rounds[1:]
    out = [f"Command: `{d['command']}` ({d['wall_s']:.0f} s wall, {len(abused)} rounds). One picker process, "
           "two fake vLLM endpoints; each round sends 1,500 requests with distinct unknown model names, 300 "
           "forged `x-request-id`s on streams cut after the decision, 24 unfinished 2 MiB bodies in each body "
           "mode (against a 16 MiB budget), 1 MiB model names and repeated headers, while a well-behaved "
           "client keeps asking for decisions. Figures after each round (round 0: before any abuse):", ""]
    rows = []
    for r in rounds if len(rounds) <= 8 else [*rounds[:4], None, *rounds[-3:]]:
        if r is None:
            rows.append([f"... {len(rounds) - 7} more rounds", *[""] * 7])
            continue
        bodies = r.get("big_bodies") or {}
        during = f"{r['good_during_ms']:.2f}" if "good_during_ms" in r else ""
        refused = f"{bodies.get('buffered 503', 0)} / {bodies.get('full-duplex 503', 0)}" if bodies else ""
        rows.append([r["round"], f"{r['rss_mib']:.0f}", r["series"], f"{r['page_bytes']:,}", f"{r['good_ms']:.2f}",
                     during, f"{r.get('inflight', 0):.0f}", refused])
    out += md_table(["round", "RSS MiB", "/metrics series", "/metrics bytes", "good client ms (after)",
                     "good client ms (during)", "in flight", "big bodies refused (buffered / full-duplex)"], rows)
    rss = [r["rss_mib"] for r in abused]
    during = sorted(r.get("good_during_ms", 0.0) for r in abused)
    out += ["", f"Across all {len(abused)} rounds: RSS {min(rss):.0f}-{max(rss):.0f} MiB (before: {base['rss_mib']:.0f}), series "
                f"{min(r['series'] for r in abused)}-{max(r['series'] for r in abused)} (before: {base['series']}), "
                f"good-client median decision {sorted(r['good_ms'] for r in abused)[len(abused) // 2]:.2f} ms "
                f"(before: {base['good_ms']:.2f} ms); while a round runs the good client waits "
                f"{during[len(during) // 2]:.1f} ms (median), the picker's one event loop being busy with the abuse."]
    return out


def dead_backend_report(d: dict) -> list[str]:
    rate = d["runs"][0].get("load_rate")
    load = f"six clients sending {rate:.0f} requests a second in all" if rate else "six closed-loop clients"
    out = [f"Command: `{d['command']}` ({d['wall_s']:.0f} s wall). The local stack (3 simulated groups, "
           "`overlays/a10` with its health checks, outlier detection and connect-failure retries) under "
           f"{load}, on each listener in turn; one group is killed (SIGKILL) or stalled (SIGSTOP: it accepts "
           "connections and never answers; clients give up after 5 s). \"Late\" = sent more than 15 s after "
           "the fault.", ""]
    rows = [[r["fault"], r["listener"], r["requests_after_fault"], r["failed"],
             "" if r["last_failure_s"] is None else f"{r['last_failure_s']:.1f}", r["late_requests"], r["late_failed"]]
            for r in d["runs"]]
    return out + md_table(["fault", "listener", "requests after the fault", "failed",
                           "last failure (s after the fault)", "late requests", "late failed"], rows)
