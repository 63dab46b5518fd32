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


SERVER_LABEL = {"native": "compiled", "python": "Python"}


def _label(x: dict) -> str:
    return "null server" if x.get("endpoints") is None else f"{x['endpoints']} endpoints"


def service_report(d: dict) -> list[str]:
    r = d["result"]
    out = ["Command: `make bench-picker` (`python -m bench.picker`, see picker/README.md): `Router.decide()` in "
           "process; the real gRPC server driven by a compiled ext_proc load client (closed loop: streams back "
           "to back; open loop: a fixed rate of new streams; offered above what the server can decide, the "
           "open-loop latency is queueing); the CPU cost of scraping. Both ext_proc servers run side by side "
           "in the same run, each configuration on one then the other: `compiled` (`--ext-proc-server native`, "
           "the default) and `Python` (`--ext-proc-server python`, grpc.aio). The article has no figures for this."
           + (f" 1-minute load average {d['load_average_start']:.1f} at the start and "
              f"{d.get('load_average_end', 0):.1f} at the end: every figure here, the null "
              "server's included, is what other processes left of the machine."
              if d.get("load_average_start") is not None else ""), ""]
    if r.get("inprocess"):
        out += md_table(["in process", "decisions/s", "p50 ms", "p99 ms"],
                        [[f"{x['endpoints']} endpoints", num(x["decisions_per_s"]), f"{x['p50_ms']:.3f}",
                          f"{x['p99_ms']:.3f}"] for x in r["inprocess"]])
    grpc = r.get("grpc", [])
    rates = sorted({o["offered_per_s"] for x in grpc for o in x.get("open_loops", [])})
    rows = []
    for x in grpc:
        c = x.get("closed_loop") or {}
        opens = {o["offered_per_s"]: o for o in x.get("open_loops", [])}
        decide = (c.get("decide") or {}).get("p99_ms")
        best = x.get("max_rate_p99_within_target")
        errors = (c.get("errors") or 0) + sum(o.get("errors") or 0 for o in opens.values())
        rows.append([_label(x), SERVER_LABEL.get(x.get("server", "python"), x.get("server")), x.get("mode", ""),
                     spread(c, "decisions_per_s", 0),
                     f"{num(c.get('p50_ms'), 1)} / {num(c.get('p99_ms'), 1)}", num(decide, 2) if decide else "-",
                     num(c.get("server_cpu_ms_per_request"), 2), *(spread(opens.get(r_), "p99_ms", 1) for r_ in rates),
                     num(best) + "/s" if best else "none", errors])
    if grpc:
        out += ["", "Through gRPC: closed loop = 64 streams back to back; open loop = p99 round trip (stream "
                    "opened -> routing answer, as the client sees it) at each offered rate. Each is run 3 times, "
                    "interleaved: shown is the median run (closed loop: by throughput; open loop: by p99), then "
                    "every run in brackets. decide = the server's own `decide()` time in the reported closed-loop "
                    "run (what `picker_decision_duration_seconds` observes). The null server decides nothing: "
                    "`Python` is a bare grpc.aio servicer answering prebuilt messages (what Python gRPC itself "
                    "costs), `compiled` is the compiled transport with the picker's own Python side over a "
                    "Router that decides nothing (everything around `decide()`).", ""]
        out += md_table(["through gRPC", "server", "mode", "closed decisions/s", "closed p50 / p99 ms",
                         "decide p99 ms", "server CPU ms/decision", *(f"open {r_:,.0f}/s p99 ms" for r_ in rates),
                         "p99 <= 5 ms at every rate up to", "errors"], rows)
        out += _side_by_side(grpc)
    out += _picker_target(grpc)
    out += _profile_report(r.get("profile"))
    out += _pod_report(r.get("pod"))
    out += _long_report(r.get("long"))
    out += _upstream(grpc)
    s = r.get("scrape")
    if s:
        out += ["", f"Scraping {s.get('endpoints')} endpoints every {s.get('interval_s')} s: "
                    f"{num(s.get('scrapes_per_s'))} scrapes/s, {num(s.get('cpu_cores'), 2)} CPU cores, "
                    f"{num(s.get('cpu_ms_per_scrape'), 2)} ms CPU per scrape."]
    return out


def _pairs(grpc: list[dict]):
    """(configuration, mode, compiled run, Python run) for every configuration both servers ran."""
    by = {(x.get("endpoints"), x.get("mode"), x.get("server", "python")): x for x in grpc}
    for (n, mode, server), x in by.items():
        if server == "native" and (n, mode, "python") in by:
            yield n, mode, x, by[(n, mode, "python")]


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "n/a"


def _side_by_side(grpc: list[dict]) -> list[str]:
    rows = []
    for n, mode, nat, py in _pairs(grpc):
        cn, cp = nat.get("closed_loop") or {}, py.get("closed_loop") or {}
        rows.append([_label(nat), mode, num(cn.get("server_cpu_ms_per_request"), 2),
                     num(cp.get("server_cpu_ms_per_request"), 2),
                     _ratio(cn.get("server_cpu_ms_per_request"), cp.get("server_cpu_ms_per_request")),
                     num(cn.get("decisions_per_s")), num(cp.get("decisions_per_s")),
                     _ratio(cn.get("decisions_per_s"), cp.get("decisions_per_s"))])
    if not rows:
        return []
    return ["", "The two servers side by side (closed loop, the reported runs): server CPU per decision and "
                "decisions/s, compiled against Python.", ""] + md_table(
        ["through gRPC", "mode", "compiled CPU ms/decision", "Python CPU ms/decision", "CPU compiled / Python",
         "compiled decisions/s", "Python decisions/s", "throughput compiled / Python"], rows)


def _picker_target(grpc: list[dict]) -> list[str]:
    """The picker's target at 16 endpoints, buffered mode: >= 1,000 decisions/s and p99 <= 5 ms;
    and the compiled transport's: half the Python server's CPU per decision, a third for the null
    server."""
    out = []
    yes = lambda ok: "met" if ok else "not met"  # noqa: E731
    for x in grpc:
        if x.get("endpoints") != 16 or x.get("mode") != "buffered" or not x.get("closed_loop"):
            continue
        c = x["closed_loop"]
        decide = (c.get("decide") or {}).get("p99_ms")
        best = x.get("max_rate_p99_within_target")
        server = SERVER_LABEL.get(x.get("server", "python"), x.get("server"))
        out += ["", f"Target at 16 endpoints (buffered), {server} server:", "",
                f"- at least 1,000 decisions/s with 64 streams: {num(c['decisions_per_s'])}/s (median run), "
                f"{yes(c['decisions_per_s'] >= 1000)};",
                f"- decision latency p99 at most 5 ms (the picker's `decide()`, same run): "
                f"{num(decide, 2)} ms, {yes(decide is not None and decide <= 5)};",
                f"- round-trip p99 (client side, gRPC queueing included) at most 5 ms: up to "
                f"{num(best) + '/s offered' if best else 'not even the lowest offered rate'}"
                f"{'' if best and best >= 1000 else ', not at 1,000/s'}."]
    lines = []
    for n, mode, nat, py in _pairs(grpc):
        cn = (nat.get("closed_loop") or {}).get("server_cpu_ms_per_request")
        cp = (py.get("closed_loop") or {}).get("server_cpu_ms_per_request")
        if cn and cp and (n is None or n == 16):
            bound, what = (1 / 3, "a third") if n is None else (1 / 2, "half")
            lines.append(f"- {_label(nat)}, {mode}: CPU per request at most {what} of the Python server's: "
                         f"{cn:.2f} against {cp:.2f} ms ({cn / cp:.2f}), {yes(cn <= bound * cp)}.")
    if lines:
        out += ["", "Targets of the compiled transport against the Python server (same run):", "", *lines]
    return out


def _pod_report(pod: list[dict] | None) -> list[str]:
    """One pod on 2 cores: `python -m picker --workers N` (the signals process included), each
    server, against today's deployment (the Python server, 2 workers); the Go picker's latency."""
    if not pod:
        return []
    today = next((x for x in pod if x.get("server") == "python" and x["workers"] == 2), None)
    rows = [[f"{SERVER_LABEL.get(x['server'], x['server'])} server, {x['workers']} worker{'s' if x['workers'] > 1 else ''}",
             f"{num(x['decisions_per_s'])} [{' '.join(num(v['decisions_per_s']) for v in x['repeats'])}]",
             _ratio(x["decisions_per_s"], today and today["decisions_per_s"]),
             f"{num(x['p50_ms'], 1)} / {num(x['p99_ms'], 1)}", f"{x['server_cpu_cores']:.2f}",
             f"{x['server_cpu_ms_per_request']:.2f}"] for x in pod]
    out = ["", "One picker pod (`python -m picker --workers N`, static discovery, 16 fake vLLM endpoints "
               "really scraped by the signals process; 64 streams closed loop over 4 connections, buffered; "
               "CPU of the whole process tree; the load client shares the 2 cores):", ""]
    out += md_table(["pod", "decisions/s [repeats]", "vs today's (Python, 2 workers)", "p50 / p99 ms",
                     "server cores", "server CPU ms/decision"], rows)
    best = max((x for x in pod if x.get("server") == "native"), key=lambda x: x["decisions_per_s"], default=None)
    if best and today:
        g = GO_MEASURED
        ratio = best["decisions_per_s"] / today["decisions_per_s"]
        out += ["", f"- target: one pod at least 2x today's decisions/s: {ratio:.2f}x "
                    f"({best['workers']} worker{'s' if best['workers'] > 1 else ''}), {'met' if ratio >= 2 else 'not met'};",
                f"- target: round trip p50 / p99 at or below the Go picker's ({g['p50_ms'][0]}-{g['p50_ms'][1]} / "
                f"{g['p99_ms'][0]}-{g['p99_ms'][1]} ms at 64 streams, {g['decisions_per_s'][0]:,}-"
                f"{g['decisions_per_s'][1]:,}/s): {num(best['p50_ms'], 1)} / {num(best['p99_ms'], 1)} ms at "
                f"{num(best['decisions_per_s'])}/s, "
                f"{'met' if best['p50_ms'] <= g['p50_ms'][1] and best['p99_ms'] <= g['p99_ms'][1] else 'not met'}."]
    return out


def _profile_report(prof: list[dict] | None) -> list[str]:
    """Where each server's CPU per decision goes: perf samples by shared object and by thread."""
    if not prof:
        return []
    buckets = list(dict.fromkeys(k for p in prof for k in p["by_dso_ms"]))
    threads = list(dict.fromkeys(k for p in prof for k in p["by_thread_ms"]))
    rows = [[_label(p), SERVER_LABEL.get(p["server"], p["server"]), num(p["decisions_per_s"]),
             f"{p['server_cpu_ms_per_request']:.3f}",
             *(f"{p['by_dso_ms'].get(b, 0):.3f}" for b in buckets),
             " / ".join(f"{p['by_thread_ms'].get(t, 0):.3f}" for t in threads)] for p in prof]
    return ["", "Where the server's CPU goes (`--parts profile`, bench/picker/profile.py): `perf record -e "
                "cpu-clock` on the server process (every thread) during a closed loop (buffered, 64 streams), "
                "each sample counted in the shared object it was taken in; shares x the run's CPU per decision "
                "= ms of CPU per decision. The kernel's share is syscalls, loopback TCP and the wake-ups "
                "between threads (in this VM, time around a context switch is sampled as kernel time).", ""] + \
        md_table(["profile", "server", "decisions/s", "CPU ms/decision", *buckets,
                  "by thread: " + " / ".join(threads)], rows)


def _long_report(long: dict | None) -> list[str]:
    if not long:
        return []
    out = ["", "Long prompts (`python -m bench.picker --parts long`, bench/picker/longprompt.py): chat "
               "requests of 8 tenants (a 1,000-token system prompt + the rest in the user message), precise "
               "prefix routing on (the tiny model's tokenizer; each tenant's system prompt cached on one of the "
               f"{long.get('endpoints', 16)} endpoints per its KV-cache events), every body seen before (the "
               "tokenizer's window cache warm, as in an agentic session that re-sends its context). In process: "
               "`decide()` CPU per decision, and what one request held in flow control keeps (tracemalloc). "
               f"Through gRPC: FULL_DUPLEX_STREAMED, the body in {long.get('chunk_bytes', 0) // 1024} KiB "
               "messages, 8 streams closed loop: the server's CPU per decision; and "
               f"{long.get('held_requests')} requests held at once by flow control (no endpoint has room): the "
               "server's RSS growth per held request.", ""]
    inp = long.get("inprocess") or []
    base = next((x["cpu_ms_per_decision"] for x in inp if x["tokens"] == 1000), None)
    out += md_table(["in process", "body KiB", "prompt tokens", "decide() CPU ms/decision (p50)", "vs 1k tokens",
                     "held: KiB per request (beyond its body)"],
                    [[f"{x['tokens']:,} tokens", num(x["body_bytes"] / 1024), num(x["prompt_tokens"]),
                      f"{x['cpu_ms_per_decision']:.2f} ({x['cpu_p50_ms']:.2f})", _ratio(x["cpu_ms_per_decision"], base),
                      f"{num(x['held_bytes_per_request'] / 1024)} ({num(x['held_overhead_bytes'] / 1024, 1)})"]
                     for x in inp])
    rows = []
    base_by = {x["server"]: x["closed_loop"]["server_cpu_ms_per_request"] for x in long.get("grpc", [])
               if x["tokens"] == 1000}
    for x in long.get("grpc", []):
        c = x["closed_loop"]
        rows.append([f"{x['tokens']:,} tokens", SERVER_LABEL.get(x["server"], x["server"]),
                     num(c["decisions_per_s"]), num(c["server_cpu_ms_per_request"], 2),
                     _ratio(c["server_cpu_ms_per_request"], base_by.get(x["server"])),
                     f"{x['held']}", num(x["held_bytes_per_request"] / 1024), c.get("errors", 0)])
    if rows:
        out += [""] + md_table(["through gRPC", "server", "decisions/s", "server CPU ms/decision", "vs 1k tokens",
                                "held", "RSS KiB per held request", "errors"], rows)
        targets = []
        for server, b in base_by.items():
            top = next((x for x in long["grpc"] if x["server"] == server and x["tokens"] == 100_000), None)
            if top and b:
                ratio = top["closed_loop"]["server_cpu_ms_per_request"] / b
                targets.append(f"- target, {SERVER_LABEL.get(server, server)} server: a 100k-token prompt at "
                               f"most 3x the CPU of a 1k-token one: {ratio:.1f}x, {'met' if ratio <= 3 else 'not met'}.")
        out += [""] + targets if targets else []
    return out


# The upstream Go endpoint picker, for scale. Measured: the figures the issue that asked for the
# compiled transport gives (same machine, same load client, 16 endpoints, 64 streams, full-duplex,
# three interleaved rounds). Published: llm-d-router docs/operations.md ("Container Sizing Guide",
# EPP image 0.9.0, llm-d-simulator, 100 model-server pods, approximate prefix matching) and the
# Gateway API Inference Extension's "EPP Resource Tuning" guide.
GO_MEASURED = {"decisions_per_s": (1725, 2234), "cpu_ms": (0.71, 0.92), "cores": 1.57, "p50_ms": (14, 19),
               "p99_ms": (39, 60)}
GO_PUBLISHED = [
    "llm-d-router's sizing guide (EPP 0.9.0, 100 simulated pods, approximate prefix matching, 100k-token "
    "prompts with 1k-token outputs, response phase included): 0.5-1.0 CPU cores per request/s; 35.2 peak "
    "cores at 98.7 requests/s (~356 ms of CPU per request) with a 4,096-token prefix match, 46.5 cores "
    "(~471 ms) matching 100k tokens; 17.5 cores at 50 requests/s with 1k-token outputs; 4-6 GiB at 50-100 "
    "requests/s; ~7.5 idle cores for scraping 100 pods",
    "the Gateway API Inference Extension's EPP resource guide: 4 cores and 8 GiB requested by default, "
    "validated up to 5,000 requests/s of 72-token prompts with p90 scheduling latency within 100 ms",
]


def _upstream(grpc: list[dict]) -> list[str]:
    g = GO_MEASURED
    mine = {x.get("server", "python"): x.get("closed_loop") or {} for x in grpc
            if x.get("endpoints") == 16 and x.get("mode") == "full-duplex"}
    out = ["", "The upstream Go endpoint picker (not runnable here). Measured on another machine with this "
               f"load client (16 endpoints, 64 streams, full-duplex): {g['decisions_per_s'][0]:,}-"
               f"{g['decisions_per_s'][1]:,} decisions/s at {g['cpu_ms'][0]}-{g['cpu_ms'][1]} ms of server CPU "
               f"per decision on {g['cores']} cores, p50 {g['p50_ms'][0]}-{g['p50_ms'][1]} ms, p99 "
               f"{g['p99_ms'][0]}-{g['p99_ms'][1]} ms."]
    for server, c in mine.items():
        if c.get("server_cpu_ms_per_request"):
            cpu = c["server_cpu_ms_per_request"]
            out[-1] += (f" Here, {SERVER_LABEL.get(server, server)} server, same configuration: "
                        f"{cpu:.2f} ms per decision, {cpu / g['cpu_ms'][1]:.2f}-{cpu / g['cpu_ms'][0]:.2f}x the "
                        f"Go picker's.")
    out[-1] += " Published: " + "; ".join(GO_PUBLISHED) + "."
    return out


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
    lengths = r.get("lengths") or []
    if lengths:
        labels = {"off": "off (`--no-lengths`)", "learning": "learning (default profile)",
                  "routing": "routing on them (`lengths` profile)"}
        out += ["", "Output lengths (picker/README.md, \"Output lengths\"): decide() with the predictor "
                    "off, learning (outcomes flowing: a forecast per decision, each outcome learned, "
                    "counted in the decision's CPU) and the `lengths` profile (a projection per candidate "
                    "over 20 requests tracked per endpoint):", ""]
        out += md_table(["in process", "output lengths", "CPU p50 / p99 ms", "CPU ms/decision"],
                        [[f"{x['endpoints']:,} endpoints", labels[x["mode"]],
                          f"{x['cpu_p50_ms']:.3f} / {x['cpu_p99_ms']:.3f}", f"{x['cpu_ms_per_decision']:.3f}"]
                         for x in lengths])
        big = [x for x in lengths if x["endpoints"] >= 1024]
        if big:
            worst = max(x["cpu_p99_ms"] for x in big)
            out += ["", f"Target p99 CPU per decision at 1,024 endpoints <= 1 ms with output lengths on: "
                        f"{worst:.3f} ms at most, {'met' if worst <= 1 else 'not met'}."]
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
                      [[f"{x['workers']} ({SERVER_LABEL.get(x.get('server', 'python'))} server)", f"{num(x['decisions_per_s'])} [{' '.join(num(v['decisions_per_s']) for v in x['repeats'])}]",
                        f"x{x['speedup_vs_first']:.2f}", num(x["p99_ms"], 1), f"{x['server_cpu_cores']:.2f}",
                        f"{x['server_cpu_ms_per_request']:.2f}"] for x in wk])
    return out
