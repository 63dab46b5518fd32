"""BENCHMARKS.md from the JSON summaries in results/bench/ (whatever benchmarks have been run)."""

from __future__ import annotations

import time

from bench import coldstart, crosscheck, phases, robustness
from bench.common import REPO, load, machine, md_table
from bench.suites import git_revision
from lab.article import ARTICLE
from loadtest.metrics import REPORT_KEYS, percent_change
from loadtest.report import change_pct

LABELS = {"mean_ttft_ms": "mean TTFT ms", "median_ttft_ms": "median TTFT ms", "p99_ttft_ms": "P99 TTFT ms",
          "mean_tpot_ms": "mean TPOT ms", "output_throughput": "output tok/s", "duration": "duration s"}
LAB_KEYS = [(k, LABELS[k]) for k in REPORT_KEYS]


def _f(x, digits=0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _pct(new, old) -> str:
    return change_pct(old, new)


def _section(title: str, d: dict | None, body) -> list[str]:
    """A `## title` section: the lines `body(d)` writes, or "(not run)" without results."""
    return [f"## {title}", ""] + (body(d) if d else ["(not run)"]) + [""]


def header() -> list[str]:
    return [
        "# Benchmarks", "",
        f"Written by `python -m bench report` on {time.strftime('%Y-%m-%d %H:%M %Z')} from the runs in "
        f"`results/bench/` (repository at {git_revision()}). Regenerate everything with `make bench` "
        "(30-40 minutes + the lab matrix); each benchmark runs alone with `python -m bench <name>` "
        "(`validation`, `picker`, `lab`, `matrix`, `crosscheck`, `phases`, `coldstart`, `demo`, `picker-scale`, "
        "`prefilter`, `replicas`, `soak`, `dead-backend`), then `python -m bench report`.", ""]


def machine_lines(m: dict, loads: list[float]) -> list[str]:
    """The bullets that say where the runs of this report ran and how busy the machine was."""
    busy = max(loads) if loads else None
    shared = (f"The machine was shared with other work while these ran (1-minute load average "
              f"{min(loads):.1f}-{max(loads):.1f} on {m['nproc']} cores at the start and end of the benchmarks), "
              "so times and the HTTP figures carry that noise." if busy and busy > 0.5 * m["nproc"]
              else "The machine was otherwise idle (load average below half the cores).")
    return [f"- {m['nproc']} CPUs: {m['cpu_model']}", f"- memory: {m['memory_gb']} GB",
            f"- Python {m['python']}, Linux {m['kernel']}", f"- {shared}"]


def machine_section(m: dict, loads: list[float], old: list[str] | None, fresh: list[str]) -> list[str]:
    """`## Machine`. When some sections are kept from the previous report, its machine section
    stays (those figures were measured there) and the sections run now are named with their own
    machine, so that no figure is credited to a machine it did not run on. Rewriting the report
    from the same runs adds nothing."""
    now = machine_lines(m, loads)
    if old is None:
        return ["## Machine", ""] + now + [""]
    kept = old[:-1] if old and not old[-1].strip() else old
    since = ["", f"Since then, {', '.join(fresh)} ran again on:", ""] + now
    if not fresh or "\n".join(since) in "\n".join(kept):
        return kept + [""]
    return kept + since + [""]


def validation_section(d: dict | None) -> list[str]:
    return _section("Validation time", d, lambda d: [
        f"Command: `{d['command']}` (every base, overlay, Argo CD app path and loadtest/k8s: render, "
        "schemas + CRDs with CEL, kubeconform, workflows, Envoy Gateway's translation, the cross-object rules). "
        "One run to warm the caches, then "
        f"{len(d['warm_runs_s'])} timed runs.", "",
        "| | first run | warm median | warm min | target |", "|---|---|---|---|---|",
        f"| wall s | {d['first_run_s']:.1f} | {d['warm_median_s']:.1f} | {d['warm_min_s']:.1f} | <= {d['target_s']:.0f} |"])


def picker_section(d: dict | None) -> list[str]:
    return _section("Picker decision throughput and latency", d, _picker_body)


def _picker_body(d: dict) -> list[str]:
    r = d["result"]
    out = ["Command: `make bench-picker` (`python -m bench.picker`, see picker/README.md): `Router.decide()` in "
           "process; the real gRPC server driven by a compiled ext_proc load client (closed loop: streams back "
           "to back; open loop: a fixed rate of new streams; offered above what the server can decide, the "
           "open-loop latency is queueing); the CPU cost of scraping. The article has no figures for this.", ""]
    out += md_table(["in process", "decisions/s", "p50 ms", "p99 ms"],
                  [[f"{x['endpoints']} endpoints", _f(x["decisions_per_s"]), f"{x['p50_ms']:.3f}", f"{x['p99_ms']:.3f}"]
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
        rows.append([label, x.get("mode", ""), _spread(c, "decisions_per_s", 0),
                     f"{_f(c.get('p50_ms'), 1)} / {_f(c.get('p99_ms'), 1)}", _f(decide, 2) if decide else "-",
                     _f(c.get("server_cpu_ms_per_request"), 2), *(_spread(opens.get(r_), "p99_ms", 1) for r_ in rates),
                     _f(best) + "/s" if best else "none", errors])
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
                    f"{_f(s.get('scrapes_per_s'))} scrapes/s, {_f(s.get('cpu_cores'), 2)} CPU cores, "
                    f"{_f(s.get('cpu_ms_per_scrape'), 2)} ms CPU per scrape."]
    return out


def _spread(run: dict | None, key: str, digits: int) -> str:
    """The reported (median) run's value, then every repeat's in brackets."""
    if not run:
        return "n/a"
    repeats = run.get("repeats") or []
    spread = f" [{' '.join(_f(x[key], digits) for x in repeats)}]" if len(repeats) > 1 else ""
    return _f(run.get(key), digits) + spread


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
            f"- at least 1,000 decisions/s with 64 streams: {_f(c['decisions_per_s'])}/s (median run), "
            f"{yes(c['decisions_per_s'] >= 1000)};",
            f"- decision latency p99 at most 5 ms (the picker's `decide()`, same run): "
            f"{_f(decide, 2)} ms, {yes(decide is not None and decide <= 5)};",
            f"- round-trip p99 (client side, gRPC queueing included) at most 5 ms: up to "
            f"{_f(best) + '/s offered' if best else 'not even the lowest offered rate'}"
            f"{'' if best and best >= 1000 else ', not at 1,000/s'}."]


def _lab_table(summary: dict, article: bool) -> list[str]:
    digits = lambda k: 1 if "tpot" in k or "throughput" in k else 0  # noqa: E731
    rows = [[name, *(f"{_f(stats[k]['mean'], digits(k))} ± {_f(stats[k]['std'], digits(k))}" for k, _ in LAB_KEYS)]
            for name, stats in summary["policies"].items()]
    if article:
        rows += [[f"article {port}", *(_f(ARTICLE[name][k], digits(k)) for k, _ in LAB_KEYS)]
                 for name, port in (("least-request", "8080"), ("picker", "8081"))]
    return md_table(["policy", *(label for _, label in LAB_KEYS)], rows)


CALIBRATION_TOLERANCE_PCT = 25.0  # the simulator's calibration target against the article's 8080 run


def _calibration(lr: dict) -> str:
    changes = {label: percent_change(ARTICLE["least-request"][k], lr[k]["mean"]) for k, label in LAB_KEYS}
    within = all(abs(c) <= CALIBRATION_TOLERANCE_PCT for c in changes.values())
    return ("Calibration of the simulator (local/README.md, `python -m lab calibrate`): the lab's least request "
            "against the article's 8080 run: " + ", ".join(f"{label} {c:+.1f} %" for label, c in changes.items())
            + f"; every one within ±{CALIBRATION_TOLERANCE_PCT:.0f} %: {'yes' if within else 'no'}.")


def lab_section(article: dict | None, shared: dict | None) -> list[str]:
    out = ["## Routing lab (virtual time)", "",
           "Command: `python -m lab run --workload <w> --policy least-request --policy picker --policy "
           "picker-upstream --seeds 0 1 2 3 4 --out results/bench/lab-<w> --plots`: 3 simulated A10 groups "
           "(the simulator's engine model in virtual time), the load tests' workload and closed-loop client, "
           "the picker's real scheduling code fed through its metrics parser at its scrape interval. "
           "Mean ± std over 5 seeds (each seed changes the prompts and the policy's randomness).", ""]
    if article:
        p = article["summary"]["policies"]
        lr, pk = p.get("least-request"), p.get("picker")
        out += [f"### Article workload (300 prompts, prefix 1000, input U[800, 4000], output U[600, 3000], "
                f"concurrency 30; {article['wall_s']:.0f} s wall for all runs)", ""] + _lab_table(article["summary"], True)
        if lr:
            out += ["", _calibration(lr)]
        if lr and pk:
            rows = [("mean TTFT", "mean_ttft_ms", "at least -40 %", -0.40), ("P99 TTFT", "p99_ttft_ms", "at least -25 %", -0.25),
                    ("output tok/s", "output_throughput", "not lower", 0.0)]
            out += ["", "| picker vs least request | ours (lab) | article (8081 vs 8080) | target | met |",
                    "|---|---|---|---|---|"]
            for label, k, target, bound in rows:
                change = percent_change(lr[k]["mean"], pk[k]["mean"]) / 100
                met = change >= bound if bound == 0.0 else change <= bound
                out.append(f"| {label} | {_pct(pk[k]['mean'], lr[k]['mean'])} | "
                           f"{_pct(ARTICLE['picker'][k], ARTICLE['least-request'][k])} | {target} | "
                           f"{'yes' if met else 'no'} |")
            up = p.get("picker-upstream")
            if up:
                better = pk["mean_ttft_ms"]["mean"] < up["mean_ttft_ms"]["mean"]
                out.append(f"| picker default vs upstream-default profile, mean TTFT | "
                           f"{_pct(pk['mean_ttft_ms']['mean'], up['mean_ttft_ms']['mean'])} | | lower | "
                           f"{'yes' if better else 'no'} |")
        out.append("")
    if shared:
        p = shared["summary"]["policies"]
        lr, pk, up = p.get("least-request"), p.get("picker"), p.get("picker-upstream")
        out += [f"### Shared-prefix multi-tenant workload ({shared['wall_s']:.0f} s wall for all runs)", ""]
        out += _lab_table(shared["summary"], False)
        if lr and pk:
            out += ["", f"Least request / picker mean TTFT: **{lr['mean_ttft_ms']['mean'] / pk['mean_ttft_ms']['mean']:.2f} x** "
                        "(target: at least 3 x)"
                    + (f"; picker default vs upstream-default profile: "
                       f"{_pct(pk['mean_ttft_ms']['mean'], up['mean_ttft_ms']['mean'])}." if up else ".")]
        out.append("")
    if not article and not shared:
        out += ["(not run)", ""]
    return out


MATRIX_POLICIES = [("least-request", "least request"), ("round-robin", "round robin"),
                   ("picker-upstream", "upstream-default"), ("picker", "**default**"), ("oracle", "oracle")]


def _cell(stats: dict) -> str:
    return (f"{_f(stats['mean_ttft_ms']['mean'])} / {_f(stats['p99_ttft_ms']['mean'])} / "
            f"{_f(stats['output_throughput']['mean'], 1)}")


def _matrix_targets(scenarios: list[dict]) -> list[str]:
    """Which of the routing targets the measured matrix meets, scenario by scenario."""
    worse = [f"{s['name']} ({', '.join(k for k, v in s['assessment']['worse_than_baseline_beyond_spread'].items() if v)})"
             for s in scenarios if any(s["assessment"].get("worse_than_baseline_beyond_spread", {}).values())]
    gap = [s for s in scenarios if s["assessment"].get("gap_target_applies")]
    short = [f"{s['name']} ({s['assessment']['gap_closed_pct']:.0f} %)" for s in gap
             if (s["assessment"]["gap_closed_pct"] or 0) < 75]
    upstream = [s["name"] for s in scenarios if s["assessment"].get("default_beats_upstream") is False]
    base = next((s for s in scenarios if s["name"] == "base"), None)
    out = ["Targets (picker `default` against least request, means over the seeds; \"worse beyond the seed "
           "spread\" = worse by more than the larger of the two policies' standard deviations over seeds):", ""]
    out.append("- never worse than least request beyond the seed spread in mean TTFT, P99 TTFT or output "
               f"throughput: {'met in every scenario' if not worse else 'not met in ' + '; '.join(worse)};")
    out.append(f"- at least 75 % of the oracle's gap closed where the oracle beats least request by 20 % or more "
               f"({len(gap)} scenarios: {', '.join(s['name'] for s in gap) or 'none'}): "
               f"{'met' if not short else 'not met in ' + ', '.join(short)};")
    if base:
        c = base["assessment"]["change_pct"]
        ok = c["mean_ttft_ms"] <= -40 and c["p99_ttft_ms"] <= -25
        out.append(f"- article workload (base) at or below -40 % mean and -25 % P99 TTFT: "
                   f"{c['mean_ttft_ms']:+.1f} % / {c['p99_ttft_ms']:+.1f} %, {'met' if ok else 'not met'};")
    out.append("- `default` beats `upstream-default` in mean TTFT: "
               + ("in every scenario." if not upstream else f"not in {', '.join(upstream)}."))
    return out


def _cpu_minutes(m: dict) -> float:
    return sum(sum(p.get("cpu_s", {}).get("values", [])) for s in m["scenarios"]
               for p in s["policies"].values()) / 60


def lab_matrix_section(d: dict | None) -> list[str]:
    return _section("Routing lab: scenario matrix", d, _lab_matrix_body)


def _lab_matrix_body(d: dict) -> list[str]:
    m = d["matrix"]
    seeds = " ".join(map(str, m["seeds"]))
    rows = []
    for s in m["scenarios"]:
        a, p = s["assessment"], s["policies"]
        c = a.get("change_pct", {})
        gap = a.get("gap_closed_pct")
        rows.append([f"{s['name']}: {s['description']}", s["factor"],
                     *(_cell(p[name]) if name in p else "-" for name, _ in MATRIX_POLICIES),
                     f"{c['mean_ttft_ms']:+.1f} %, {c['p99_ttft_ms']:+.1f} %, {c['output_throughput']:+.1f} %" if c else "-",
                     _f(-a["oracle_gain_pct"], 1) + " %" if "oracle_gain_pct" in a else "-",
                     _f(gap) + " %" if gap is not None else "-"])
    return [f"Command: `{d['command']}` (lab/matrix.py; {len(m['scenarios'])} scenarios x "
            f"{len(m['policies'])} policies x {len(m['seeds'])} seeds in {m['workers']} processes: "
            f"**{d['wall_s'] / 60:.1f} min wall**, target 15 min; 1-minute load average "
            f"{d['load_average_start']:.1f} at the start, {d['load_average_end']:.1f} at the end, on a machine "
            "shared with other work). Design: a base scenario (the article's run: `article` workload, closed "
            "loop at concurrency 30, 3 `a10-qwq32b` groups, KV 1x) and one-factor variations of it, not the "
            "full cartesian product. Open-loop rates are fractions of the pool's capacity measured in the same "
            f"run (least request's request throughput on the base scenario: {_f(m['capacity_rps'], 4)} "
            f"requests/s). CPU time of all runs: {_cpu_minutes(m):.1f} min. "
            f"Reported seeds {seeds}; the picker's profiles were not tuned on them (tuning seeds: "
            f"{' '.join(map(str, m['tuning_seeds']))}).", "",
            "The oracle is clairvoyant (lab/oracle.py): it knows every engine's exact state and every request's "
            "output length, plays each candidate group forward and sends the request where its first token "
            "comes soonest. Gap closed = (least request - default) / (least request - oracle) in mean TTFT.", "",
            "Cells: mean TTFT ms / P99 TTFT ms / output tok/s, means over the seeds.", ""] + md_table(
        ["scenario", "varied", *(label for _, label in MATRIX_POLICIES),
         "default vs least request (mean, P99, tok/s)", "oracle vs least request", "gap closed"], rows) \
        + [""] + _matrix_targets(m["scenarios"])


def crosscheck_section(d: dict | None) -> list[str]:
    return _section("Scaled HTTP comparison and the lab cross-check", d, lambda d: [
        f"Command: `{d['command']}`: the HTTP part is `python -m local.stack demo` (what `make demo` runs: "
        "3 simulator processes, the picker, Envoy Gateway + Envoy, `loadtest compare` of both listeners); the lab "
        "part runs the same prompts through the same engine model in virtual time. HTTP took "
        f"{d['http_wall_s']:.0f} s wall, the lab {d['lab_wall_s']:.0f} s. HTTP results: "
        f"`{d['http_results_dir'].replace(str(REPO) + '/', '')}/report.md`.", "",
        crosscheck.report(d)])


def phases_section(d: dict | None) -> list[str]:
    return _section("What the picker is sent: request phase only or the response phase too", d, phases.report)


def coldstart_section(d: dict | None) -> list[str]:
    return _section("Cold start: a burst sharing a new prefix at a fresh router", d, coldstart.report)


def soak_section(d: dict | None) -> list[str]:
    return _section("The picker under hostile traffic (soak)", d, robustness.soak_report)


def dead_backend_section(d: dict | None) -> list[str]:
    return _section("A dead or stalled backend on both listeners", d, robustness.dead_backend_report)


def demo_section(d: dict | None) -> list[str]:
    return _section("`make demo` on the real data plane", d, _demo_body)


def _demo_body(d: dict) -> list[str]:
    dp = d["dataplane"]
    out = [f"Command: `{d['command']}`, {d['wall_s']:.0f} s wall (Go tools already built): 3 simulator processes, "
           "the picker, Envoy Gateway v1.9.0 (standalone) and Envoy 1.39.0, `loadtest compare` of listener `http` "
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
        out += ["", f"llm-gw vs http: mean TTFT {_pct(pk['mean_ttft_ms'], lr['mean_ttft_ms'])}, P99 TTFT "
                    f"{_pct(pk['p99_ttft_ms'], lr['p99_ttft_ms'])}, output throughput "
                    f"{_pct(pk['output_throughput'], lr['output_throughput'])}."]
    out += ["", f"CPU of every process during the comparison ({dp['wall_s']:.0f} s, {dp['cores']} cores):", ""]
    out += md_table(["process", "CPU s", "cores"],
                  [[name, f"{cpu:.1f}", f"{cpu / dp['wall_s']:.2f}"] for name, cpu in dp["cpu_s"].items()])
    stats = dp["envoy_listener_stats"]
    out += ["", "Envoy's own counters per listener during the comparison:", ""]
    out += md_table(["listener", *(s.replace("downstream_", "") for s in next(iter(stats.values())))],
                  [[name, *values.values()] for name, values in stats.items()])
    return out


def picker_scale_section(d: dict | None) -> list[str]:
    return _section("Picker at scale: pool size, scraping, worker processes", d, _picker_scale_body)


def _picker_scale_body(d: dict) -> list[str]:
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
                        _f(x["decisions_per_s"]), f"{x['p50_ms']:.3f} / {x['p99_ms']:.3f}",
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
            rows.append([f"{x['endpoints']:,} endpoints", _spread(c, "decisions_per_s", 0),
                         _f(decide, 2) if decide else "-", _f(c.get("server_cpu_ms_per_request"), 2),
                         f"{_f(o.get('offered_per_s'))}/s", _spread(o, "p99_ms", 1)])
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
                    f"{_f(x.get('scrapes_per_s'))} scrapes/s on the deciding loop" if x["mode"] == "in-loop"
                    else f"{_f(x.get('signals_process_cpu_cores'), 2)} cores in the signals process")
            rows.append([labels[x["mode"]], f"{x['p50_ms']:.2f}",
                         f"{x['p99_ms']:.2f} [{' '.join(f'{v:.2f}' for v in x['repeats'])}]",
                         f"{x.get('completed', x['decisions'])} of {x['decisions']}",
                         f"{x.get('decide_cpu_p99_ms', 0):.3f}", f"{x.get('refused_503', 0)} of {x['decisions']}",
                         f"{x['decider_cpu_cores']:.2f}", cost])
        out += ["", f"Decisions at {_f(x0['offered_per_s'])}/s (open loop) on {x0['endpoints']:,} endpoints "
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
                      [[x["workers"], f"{_f(x['decisions_per_s'])} [{' '.join(_f(v['decisions_per_s']) for v in x['repeats'])}]",
                        f"x{x['speedup_vs_first']:.2f}", _f(x["p99_ms"], 1), f"{x['server_cpu_cores']:.2f}",
                        f"{x['server_cpu_ms_per_request']:.2f}"] for x in wk])
    return out


def replicas_section(d: dict | None) -> list[str]:
    return _section("Picker replicas: routing quality with 1, 2 and 4 replicas", d, _replicas_body)


def _replicas_body(d: dict) -> list[str]:
    out = ["Command: `python -m bench replicas` (`python -m lab.replicas`, see lab/README.md): the "
           "lab's workloads on 16 simulated groups at concurrency 160 (the 3-group runs' load per "
           "group); each request goes to one picker replica "
           "drawn at random. Shared: the replicas exchange in-flight counts and prefix additions (what "
           "`--peer-store` does through Redis) every 20 ms, or before every decision; `--peer-store` "
           "sends changes as they happen (about a Redis round trip behind) and the whole table every "
           "20 ms, so these two rows bound it. Independent: nothing shared (plain `replicas: N`). Mean "
           "TTFT, mean ± std over the seeds, and its change against one replica.", ""]
    labels = {"shared-prefix": "shared-prefix workload", "article": "article workload"}
    names = []
    for run in d["runs"].values():
        names += [n for n in run["policies"] if n not in names]
    rows = []
    for name in names:
        cells = []
        for run in d["runs"].values():
            p = run["policies"]
            if name not in p:
                cells.append("-")
                continue
            m, base = p[name]["mean_ttft_ms"], p["picker"]["mean_ttft_ms"]["mean"]
            cells.append(f"{_f(m['mean'])} ± {_f(m['std'])} ({_pct(m['mean'], base)})")
        rows.append([_replica_label(name), *cells])
    return out + md_table(["replicas", *(labels.get(k, k) for k in d["runs"])], rows)


def prefilter_section(d: dict | None) -> list[str]:
    return _section("Picker candidate prefilter: routing quality", d, _prefilter_body)


def _prefilter_body(d: dict) -> list[str]:
    rows = []
    for workload, summary in d["runs"].items():
        p = summary["policies"]
        full = p.get("picker")
        for name, stats in p.items():
            m = stats["mean_ttft_ms"]
            vs = "" if name in ("picker", "least-request") or not full else (
                f"{_pct(m['mean'], full['mean_ttft_ms']['mean'])}; within the seed spread: "
                f"{'yes' if abs(m['mean'] - full['mean_ttft_ms']['mean']) <= max(m['std'], full['mean_ttft_ms']['std']) else 'no'}")
            label = "prefilter forced on" if name.startswith("picker:") else name
            rows.append([workload, label, f"{_f(m['mean'])} ± {_f(m['std'])}",
                         f"{_f(stats['p99_ttft_ms']['mean'])} ± {_f(stats['p99_ttft_ms']['std'])}",
                         _f(stats["output_throughput"]["mean"], 1), vs])
    return ["Command: `python -m bench prefilter`: the lab on 16 simulated groups at concurrency 160, "
            "least request, the default profile (all 16 candidates scored) and "
            "`bench/picker/prefilter-16.yaml` (the same scorers with the prefilter forced on: prefix "
            "owners, least loaded and a random sample, 8 of 16 scored). Mean ± std over the seeds.", ""] + md_table(
        ["workload", "policy", "mean TTFT ms", "P99 TTFT ms", "output tok/s", "vs full scoring (mean TTFT)"], rows)


def _replica_label(policy: str) -> str:
    """`replicas:4:sync=0` -> `4, shared before every decision`."""
    if policy == "picker":
        return "1 (one picker)"
    _, n, *option = policy.split(":")
    if not option:
        return f"{n}, shared every 20 ms"
    if option == ["independent"]:
        return f"{n}, independent"
    interval = float(option[0].partition("=")[2])
    return f"{n}, shared " + ("before every decision" if interval == 0 else f"every {interval * 1000:g} ms")


def _old_sections(text: str) -> dict[str, list[str]]:
    """The `## ` sections of an existing BENCHMARKS.md, by heading."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line, [])
        if current is not None:
            current.append(line)
    return sections


def _previous(lines: list[str], old: dict[str, list[str]]) -> list[str] | None:
    """The previous report's section for a benchmark without results here, if it had figures."""
    previous = old.get(lines[0])
    if "(not run)" in lines and previous and "(not run)" not in previous:
        return previous + ([""] if previous[-1] else [])
    return None


def write() -> str:
    names = ["validation", "picker", "lab-article", "lab-shared-prefix", "lab-matrix", "crosscheck", "phases",
             "coldstart", "demo", "picker-scale", "replicas", "prefilter", "soak", "dead-backend"]
    data = {n: load(n) for n in names}
    loads = [v for d in data.values() if d for v in (d.get("load_average_start"), d.get("load_average_end"))
             if v is not None]
    path = REPO / "BENCHMARKS.md"
    old = _old_sections(path.read_text()) if path.exists() else {}
    sections, fresh, kept_any = [], [], False
    for section in (validation_section(data["validation"]), picker_section(data["picker"]),
                    lab_section(data["lab-article"], data["lab-shared-prefix"]),
                    lab_matrix_section(data["lab-matrix"]), crosscheck_section(data["crosscheck"]),
                    phases_section(data["phases"]), coldstart_section(data["coldstart"]),
                    demo_section(data["demo"]), picker_scale_section(data["picker-scale"]),
                    prefilter_section(data["prefilter"]), replicas_section(data["replicas"]),
                    soak_section(data["soak"]), dead_backend_section(data["dead-backend"])):
        previous = _previous(section, old)
        kept_any |= previous is not None
        if "(not run)" not in section:
            fresh.append(f'"{section[0][3:]}"')
        sections += previous or section
    previous_machine = old.get("## Machine") if kept_any else None
    lines = header() + machine_section(machine(), loads, previous_machine, fresh) + sections
    text = "\n".join(lines).rstrip() + "\n"
    path.write_text(text)
    print(f"wrote {REPO / 'BENCHMARKS.md'}")
    return text
