"""The `picker` and `picker-scale` benchmarks of `python -m bench`: each runs its make target
(`service.py`, `scale.py` here) and turns the JSON it writes into its BENCHMARKS.md section."""

from __future__ import annotations

from bench.common import REPO, RESULTS, read_json, run_suite
from bench.markdown import md_table, num, spread


def run_service() -> dict:
    """`make bench-picker` (builds the Go load client, writes results/bench-picker.json)."""
    return run_suite("picker", ["make", "--no-print-directory", "bench-picker"],
                     lambda: {"result": read_json(REPO / "results" / "bench-picker.json")},
                     log=RESULTS / "picker.log", command="make bench-picker")


def run_scale() -> dict:
    """`make bench-picker-scale` (writes results/bench-picker-scale.json)."""
    return run_suite("picker-scale", ["make", "--no-print-directory", "bench-picker-scale"],
                     lambda: {"result": read_json(REPO / "results" / "bench-picker-scale.json")},
                     log=RESULTS / "picker-scale.log", command="make bench-picker-scale")


def service_report(d: dict) -> list[str]:
    r = d["result"]
    out = ["Command: `make bench-picker` (`python -m bench.picker`, see picker/README.md): `Router.decide()` in "
           "process; the real gRPC server driven by a compiled ext_proc load client (closed loop: streams back "
           "to back; open loop: a fixed rate of new streams; offered above what the server can decide, the "
           "open-loop latency is queueing); the CPU cost of scraping. The article has no figures for this."
           + (f" 1-minute load average {d['load_average_start']:.1f} at the start and "
              f"{d.get('load_average_end', 0):.1f} at the end: every figure here, the null "
              "server's included, is what other processes left of the machine."
              if d.get("load_average_start") is not None else ""), ""]
    out += md_table(["in process", "decisions/s", "p50 ms", "p99 ms"],
                  [[f"{x['endpoints']} endpoints", num(x["decisions_per_s"]), f"{x['p50_ms']:.3f}", f"{x['p99_ms']:.3f}"]
                   for x in r.get("inprocess", [])])
    grpc = r.get("grpc", [])
    rates = sorted({o["offered_per_s"] for x in grpc for o in x.get("open_loops", [])})
    rows = []
    for x in grpc:
        c = x.get("closed_loop") or {}
        opens = {o["offered_per_s"]: o for o in x.get("open_loops", [])}
        label = "null server" if x.get("endpoints") is None else f"{x['endpoints']} endpoints"
        decide = (c.get("decide") or {}).get("p99_ms")
        best = x.get("max_rate_p99_within_target")
        errors = (c.get("errors") or 0) + sum(o.get("errors") or 0 for o in opens.values())
        rows.append([label, x.get("mode", ""), spread(c, "decisions_per_s", 0),
                     f"{num(c.get('p50_ms'), 1)} / {num(c.get('p99_ms'), 1)}", num(decide, 2) if decide else "-",
                     num(c.get("server_cpu_ms_per_request"), 2), *(spread(opens.get(r_), "p99_ms", 1) for r_ in rates),
                     num(best) + "/s" if best else "none", errors])
    out += ["", "Through gRPC: closed loop = 64 streams back to back; open loop = p99 round trip (stream opened "
                "-> routing answer, as the client sees it) at each offered rate. Each is run 3 times, interleaved: "
                "shown is the median run (closed loop: by throughput; open loop: by p99), then every run in "
                "brackets. decide = the server's own `decide()` time in the reported closed-loop run (what "
                "`picker_decision_duration_seconds` observes).", ""]
    out += md_table(["through gRPC", "mode", "closed decisions/s", "closed p50 / p99 ms", "decide p99 ms",
                   "server CPU ms/decision", *(f"open {r_:,.0f}/s p99 ms" for r_ in rates),
                   "p99 <= 5 ms at every rate up to", "errors"], rows)
    out += _picker_target(grpc)
    s = r.get("scrape")
    if s:
        out += ["", f"Scraping {s.get('endpoints')} endpoints every {s.get('interval_s')} s: "
                    f"{num(s.get('scrapes_per_s'))} scrapes/s, {num(s.get('cpu_cores'), 2)} CPU cores, "
                    f"{num(s.get('cpu_ms_per_scrape'), 2)} ms CPU per scrape."]
    return out


def _picker_target(grpc: list[dict]) -> list[str]:
    """The picker's target at 16 endpoints, buffered mode: >= 1,000 decisions/s and p99 <= 5 ms."""
    x = next((x for x in grpc if x.get("endpoints") == 16 and x.get("mode") == "buffered"), None)
    if not x or not x.get("closed_loop"):
        return []
    c = x["closed_loop"]
    decide = (c.get("decide") or {}).get("p99_ms")
    best = x.get("max_rate_p99_within_target")
    yes = lambda ok: "met" if ok else "not met"
    return ["", "Target at 16 endpoints (buffered):", "",
            f"- at least 1,000 decisions/s with 64 streams: {num(c['decisions_per_s'])}/s (median run), "
            f"{yes(c['decisions_per_s'] >= 1000)};",
            f"- decision latency p99 at most 5 ms (the picker's `decide()`, same run): "
            f"{num(decide, 2)} ms, {yes(decide is not None and decide <= 5)};",
            f"- round-trip p99 (client side, gRPC queueing included) at most 5 ms: up to "
            f"{num(best) + '/s offered' if best else 'not even the lowest offered rate'}"
            f"{'' if best and best >= 1000 else ', not at 1,000/s'}."]


def scale_report(d: dict) -> list[str]:
    r = d["result"]
    out = ["Command: `make bench-picker-scale` (`python -m bench.picker.scale`, see picker/README.md "
           "\"Scale\"). CPU = the deciding thread's CPU time per decision (on a shared machine the "
           "wall-time tail is mostly preemption by other processes); wall = perf_counter."
           + (f" 1-minute load average {r['machine']['load_avg_1m_start']:.1f} at the start and "
              f"{r['machine'].get('load_avg_1m_end', 0):.1f} at the end, on {r['machine']['cpus']} CPUs: "
              "throughput and wall times here are what was left of a shared machine."
              if r.get("machine") else ""), ""]
    for part, how in (r.get("runs") or {}).items():
        out[-1:-1] = [f"- {part}: {how}"]
    if r.get("runs"):
        out.insert(-1, "")
    inp = r.get("inprocess") or []
    if inp:
        out += md_table(["in process", "prefilter", "decisions/s", "wall p50 / p99 ms", "CPU p50 / p99 ms",
                       "CPU ms/decision"],
                      [[f"{x['endpoints']:,} endpoints", "on" if x["prefilter"] else "off (every candidate scored)",
                        num(x["decisions_per_s"]), f"{x['p50_ms']:.3f} / {x['p99_ms']:.3f}",
                        f"{x['cpu_p50_ms']:.3f} / {x['cpu_p99_ms']:.3f}", f"{x['cpu_ms_per_decision']:.3f}"]
                       for x in inp])
        big = [x for x in inp if x["prefilter"] and x["endpoints"] >= 1024]
        if big:
            x = big[0]
            out += ["", f"Target 1,024 endpoints at <= 1 ms p99 in process: CPU p99 {x['cpu_p99_ms']:.3f} ms, "
                        f"{'met' if x['cpu_p99_ms'] <= 1 else 'not met'} (wall p99 {x['p99_ms']:.3f} ms)."]
    grpc = r.get("grpc") or []
    if grpc:
        rows = []
        for x in grpc:
            c = x.get("closed_loop") or {}
            o = (x.get("open_loops") or [{}])[0]
            decide = (c.get("decide") or {}).get("p99_ms")
            rows.append([f"{x['endpoints']:,} endpoints", spread(c, "decisions_per_s", 0),
                         num(decide, 2) if decide else "-", num(c.get("server_cpu_ms_per_request"), 2),
                         f"{num(o.get('offered_per_s'))}/s", spread(o, "p99_ms", 1)])
        out += ["", "Through gRPC, one worker, buffered, 64 streams closed loop and one open-loop rate "
                    "(median of the repeats, every repeat in brackets):", ""]
        out += md_table(["through gRPC", "closed decisions/s", "decide p99 ms", "server CPU ms/decision",
                       "open-loop rate", "open p99 ms"], rows)
    sl = r.get("scrape_load") or []
    if sl:
        x0 = sl[0]
        labels = {"none": "none (metrics fed once)", "in-loop": "on the deciding event loop",
                  "signals-process": "signals process (the picker's design)"}
        rows = []
        for x in sl:
            cost = ("-" if x["mode"] == "none" else
                    f"{num(x.get('scrapes_per_s'))} scrapes/s on the deciding loop" if x["mode"] == "in-loop"
                    else f"{num(x.get('signals_process_cpu_cores'), 2)} cores in the signals process")
            rows.append([labels[x["mode"]], f"{x['p50_ms']:.2f}",
                         f"{x['p99_ms']:.2f} [{' '.join(f'{v:.2f}' for v in x['repeats'])}]",
                         f"{x.get('completed', x['decisions'])} of {x['decisions']}",
                         f"{x.get('decide_cpu_p99_ms', 0):.3f}", f"{x.get('refused_503', 0)} of {x['decisions']}",
                         f"{x['decider_cpu_cores']:.2f}", cost])
        out += ["", f"Decisions at {num(x0['offered_per_s'])}/s (open loop) on {x0['endpoints']:,} endpoints "
                    f"whose /metrics pages are really scraped (every {x0['scrape_interval_s']:g} s, the "
                    "interval adapted to the pool); latency = when the decision was due -> decided, so "
                    "event-loop time spent scraping counts:", ""]
        out += md_table(["scraping", "p50 ms", "p99 ms [repeats]", "decided within 3 x the run", "decide() CPU p99 ms",
                       "refused (503: no endpoint ready)", "deciding process cores", "scraping cost"], rows)
    wk = r.get("workers") or []
    if wk:
        out += ["", "`python -m picker --workers N` (16 endpoints, closed loop, 64 streams over 4 connections; "
                    "CPU of the whole process tree: workers and the signals process):", ""]
        out += md_table(["workers", "decisions/s [repeats]", "vs 1 worker", "p99 ms", "server cores",
                       "server CPU ms/decision"],
                      [[x["workers"], f"{num(x['decisions_per_s'])} [{' '.join(num(v['decisions_per_s']) for v in x['repeats'])}]",
                        f"x{x['speedup_vs_first']:.2f}", num(x["p99_ms"], 1), f"{x['server_cpu_cores']:.2f}",
                        f"{x['server_cpu_ms_per_request']:.2f}"] for x in wk])
    return out
