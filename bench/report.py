"""BENCHMARKS.md from the JSON summaries in results/bench/ (whatever benchmarks have been run)."""

from __future__ import annotations

import time

from bench import crosscheck, phases
from bench.common import REPO, load, machine
from bench.suites import git_revision

# The article's table (REFERENCE.md §10): 8080 = Envoy Gateway least request, 8081 = the EPP.
ARTICLE = {
    "least-request": {"mean_ttft_ms": 10909, "median_ttft_ms": 2446, "p99_ttft_ms": 119309,
                      "mean_tpot_ms": 114.2, "output_throughput": 227.6, "duration": 2362.7},
    "picker": {"mean_ttft_ms": 7336, "median_ttft_ms": 2413, "p99_ttft_ms": 106624,
               "mean_tpot_ms": 117.3, "output_throughput": 231.5, "duration": 2325.1},
}
LAB_KEYS = [("mean_ttft_ms", "mean TTFT ms"), ("median_ttft_ms", "median TTFT ms"), ("p99_ttft_ms", "P99 TTFT ms"),
            ("mean_tpot_ms", "mean TPOT ms"), ("output_throughput", "output tok/s"), ("duration", "duration s")]


def _f(x, digits=0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _pct(new, old) -> str:
    return "n/a" if not old or new is None else f"{(new / old - 1) * 100:+.1f} %"


def header(m: dict, loads: list[float]) -> list[str]:
    busy = max(loads) if loads else None
    shared = (f"The machine was shared with other work while these ran (1-minute load average "
              f"{min(loads):.1f}-{max(loads):.1f} on {m['nproc']} cores at the start and end of the benchmarks), "
              "so times and the HTTP figures carry that noise." if busy and busy > 0.5 * m["nproc"]
              else "The machine was otherwise idle (load average below half the cores).")
    return [
        "# Benchmarks", "",
        f"Written by `python -m bench report` on {time.strftime('%Y-%m-%d %H:%M %Z')} from the runs in "
        f"`results/bench/` (repository at {git_revision()}). Regenerate everything with `make bench` "
        "(15-25 minutes); each benchmark runs alone with `python -m bench <name>` "
        "(`validation`, `picker`, `lab`, `crosscheck`, `phases`, `demo`), then `python -m bench report`.", "",
        "## Machine", "",
        f"- {m['nproc']} CPUs: {m['cpu_model']}", f"- memory: {m['memory_gb']} GB",
        f"- Python {m['python']}, Linux {m['kernel']}", f"- {shared}", ""]


def validation_section(d: dict | None) -> list[str]:
    if not d:
        return ["## Validation time", "", "(not run)", ""]
    return ["## Validation time", "",
            f"Command: `{d['command']}` (every base, overlay, Argo CD app path and loadtest/k8s: render, "
            "schemas + CRDs with CEL, kubeconform, workflows). One run to warm the caches, then "
            f"{len(d['warm_runs_s'])} timed runs.", "",
            "| | first run | warm median | warm min | target |", "|---|---|---|---|---|",
            f"| wall s | {d['first_run_s']:.1f} | {d['warm_median_s']:.1f} | {d['warm_min_s']:.1f} | <= {d['target_s']:.0f} |",
            ""]


def picker_section(d: dict | None) -> list[str]:
    if not d:
        return ["## Picker decision throughput and latency", "", "(not run)", ""]
    r = d["result"]
    out = ["## Picker decision throughput and latency", "",
           "Command: `make bench-picker` (`python -m picker.bench`, see picker/README.md): `Router.decide()` in "
           "process; the real gRPC server driven by a compiled ext_proc load client (closed loop: streams back "
           "to back; open loop: a fixed rate of new streams; offered above what the server can decide, the "
           "open-loop latency is queueing); the CPU cost of scraping. The article has no figures for this.", "",
           "| in process | decisions/s | p50 ms | p99 ms |", "|---|---|---|---|"]
    for x in r.get("inprocess", []):
        out.append(f"| {x['endpoints']} endpoints | {_f(x['decisions_per_s'])} | {x['p50_ms']:.3f} | {x['p99_ms']:.3f} |")
    grpc = r.get("grpc", [])
    rates = sorted({o["offered_per_s"] for x in grpc for o in x.get("open_loops", [])})
    out += ["", "Through gRPC: closed loop = 64 streams back to back; open loop = p99 round trip (stream opened "
                "-> routing answer, as the client sees it) at each offered rate. Each is run 3 times, interleaved: "
                "shown is the median run (closed loop: by throughput; open loop: by p99), then every run in "
                "brackets. decide = the server's own `decide()` time in the reported closed-loop run (what "
                "`picker_decision_duration_seconds` observes).", "",
            "| through gRPC | mode | closed decisions/s | closed p50 / p99 ms | decide p99 ms | server CPU ms/decision | "
            + " | ".join(f"open {r_:,.0f}/s p99 ms" for r_ in rates) + " | p99 <= 5 ms at every rate up to | errors |",
            "|---" * (8 + len(rates)) + "|"]
    for x in grpc:
        c = x.get("closed_loop") or {}
        opens = {o["offered_per_s"]: o for o in x.get("open_loops", [])}
        label = "null server" if x.get("endpoints") is None else f"{x['endpoints']} endpoints"
        decide = (c.get("decide") or {}).get("p99_ms")
        best = x.get("max_rate_p99_within_target")
        errors = (c.get("errors") or 0) + sum(o.get("errors") or 0 for o in opens.values())
        out.append(f"| {label} | {x.get('mode', '')} | {_spread(c, 'decisions_per_s', 0)} | "
                   f"{_f(c.get('p50_ms'), 1)} / {_f(c.get('p99_ms'), 1)} | {_f(decide, 2) if decide else '-'} | "
                   f"{_f(c.get('server_cpu_ms_per_request'), 2)} | "
                   + " | ".join(_spread(opens.get(r_), "p99_ms", 1) for r_ in rates)
                   + f" | {_f(best) + '/s' if best else 'none'} | {errors} |")
    out += _picker_target(grpc)
    s = r.get("scrape")
    if s:
        out += ["", f"Scraping {s.get('endpoints')} endpoints every {s.get('interval_s')} s: "
                    f"{_f(s.get('scrapes_per_s'))} scrapes/s, {_f(s.get('cpu_cores'), 2)} CPU cores, "
                    f"{_f(s.get('cpu_ms_per_scrape'), 2)} ms CPU per scrape."]
    return out + [""]


def _spread(run: dict | None, key: str, digits: int) -> str:
    """The reported (median) run's value, then every repeat's in brackets."""
    if not run:
        return "n/a"
    repeats = run.get("repeats") or []
    spread = f" [{' '.join(_f(x[key], digits) for x in repeats)}]" if len(repeats) > 1 else ""
    return _f(run.get(key), digits) + spread


def _picker_target(grpc: list[dict]) -> list[str]:
    """Issue 3's target at 16 endpoints, buffered mode: >= 1,000 decisions/s and p99 <= 5 ms."""
    x = next((x for x in grpc if x.get("endpoints") == 16 and x.get("mode") == "buffered"), None)
    if not x or not x.get("closed_loop"):
        return []
    c = x["closed_loop"]
    decide = (c.get("decide") or {}).get("p99_ms")
    best = x.get("max_rate_p99_within_target")
    yes = lambda ok: "met" if ok else "not met"
    return ["", "Issue 3 target at 16 endpoints (buffered):", "",
            f"- at least 1,000 decisions/s with 64 streams: {_f(c['decisions_per_s'])}/s (median run), "
            f"{yes(c['decisions_per_s'] >= 1000)};",
            f"- decision latency p99 at most 5 ms (the picker's `decide()`, same run): "
            f"{_f(decide, 2)} ms, {yes(decide is not None and decide <= 5)};",
            f"- round-trip p99 (client side, gRPC queueing included) at most 5 ms: up to "
            f"{_f(best) + '/s offered' if best else 'not even the lowest offered rate'}"
            f"{'' if best and best >= 1000 else ', not at 1,000/s'}."]


def _lab_table(summary: dict, article: bool) -> list[str]:
    policies = summary["policies"]
    out = ["| policy | " + " | ".join(label for _, label in LAB_KEYS) + " |", "|---" * (len(LAB_KEYS) + 1) + "|"]
    for name, stats in policies.items():
        cells = [f"{_f(stats[k]['mean'], 1 if 'tpot' in k or 'throughput' in k else 0)} ± "
                 f"{_f(stats[k]['std'], 1 if 'tpot' in k or 'throughput' in k else 0)}" for k, _ in LAB_KEYS]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    if article:
        for name, port in (("least-request", "8080"), ("picker", "8081")):
            a = ARTICLE[name]
            out.append(f"| article {port} | " + " | ".join(_f(a[k], 1 if 'tpot' in k or 'throughput' in k else 0)
                                                          for k, _ in LAB_KEYS) + " |")
    return out


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
        if lr and pk:
            rows = [("mean TTFT", "mean_ttft_ms", "at least -40 %", -0.40), ("P99 TTFT", "p99_ttft_ms", "at least -25 %", -0.25),
                    ("output tok/s", "output_throughput", "not lower", 0.0)]
            out += ["", "| picker vs least request | ours (lab) | article (8081 vs 8080) | issue 6 target | met |",
                    "|---|---|---|---|---|"]
            for label, k, target, bound in rows:
                change = pk[k]["mean"] / lr[k]["mean"] - 1
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
                        "(issue 6 target: at least 3 x)"
                    + (f"; picker default vs upstream-default profile: "
                       f"{_pct(pk['mean_ttft_ms']['mean'], up['mean_ttft_ms']['mean'])}." if up else ".")]
        out.append("")
    if not article and not shared:
        out += ["(not run)", ""]
    return out


def crosscheck_section(d: dict | None) -> list[str]:
    out = ["## Scaled HTTP comparison and the lab cross-check", ""]
    if not d:
        return out + ["(not run)", ""]
    out += [f"Command: `{d['command']}`: the HTTP part is `python -m local.stack demo` (what `make demo` runs: "
            "3 simulator processes, the picker, Envoy Gateway + Envoy, `loadtest compare` of both listeners); the lab "
            "part runs the same prompts through the same engine model in virtual time. HTTP took "
            f"{d['http_wall_s']:.0f} s wall, the lab {d['lab_wall_s']:.0f} s. HTTP results: "
            f"`{d['http_results_dir'].replace(str(REPO) + '/', '')}/report.md`.", "",
            crosscheck.report(d), ""]
    return out


def phases_section(d: dict | None) -> list[str]:
    out = ["## What the picker is sent: request phase only or the response phase too", ""]
    if not d:
        return out + ["(not run)", ""]
    return out + phases.report(d) + [""]


def demo_section(d: dict | None) -> list[str]:
    out = ["## `make demo` on the real data plane", ""]
    if not d:
        return out + ["(not run)", ""]
    dp = d["dataplane"]
    out += [f"Command: `{d['command']}`, {d['wall_s']:.0f} s wall (Go tools already built): 3 simulator processes, "
            "the picker, Envoy Gateway v1.9.0 (standalone) and Envoy 1.39.0, `loadtest compare` of listener `http` "
            f"(least request) vs `llm-gw` (picker) on the `{dp['workload']}` workload, speedup {dp['speedup']:g} "
            "(times are wall-clock ms at that speedup). Results: "
            f"`{d['results_dir']}/report.md`.", "",
            "| listener | mean TTFT ms | median TTFT ms | P99 TTFT ms | mean TPOT ms | output tok/s | completed | failed |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in d["results"].items():
        out.append(f"| {name} ({dp['listeners'][name]}) | {r['mean_ttft_ms']:,.0f} | {r['median_ttft_ms']:,.0f} | "
                   f"{r['p99_ttft_ms']:,.0f} | {r['mean_tpot_ms']:.1f} | {r['output_throughput']:.1f} | "
                   f"{r['completed']} | {r['failed']} |")
    lr, pk = d["results"].get("http"), d["results"].get("llm-gw")
    if lr and pk:
        out += ["", f"llm-gw vs http: mean TTFT {_pct(pk['mean_ttft_ms'], lr['mean_ttft_ms'])}, P99 TTFT "
                    f"{_pct(pk['p99_ttft_ms'], lr['p99_ttft_ms'])}, output throughput "
                    f"{_pct(pk['output_throughput'], lr['output_throughput'])}."]
    out += ["", f"CPU of every process during the comparison ({dp['wall_s']:.0f} s, {dp['cores']} cores):", "",
            "| process | CPU s | cores |", "|---|---|---|"]
    for name, cpu in dp["cpu_s"].items():
        out.append(f"| {name} | {cpu:.1f} | {cpu / dp['wall_s']:.2f} |")
    out += ["", "Envoy's own counters per listener during the comparison:", "",
            "| listener | " + " | ".join(s.replace("downstream_", "") for s in next(iter(dp["envoy_listener_stats"].values()))) + " |",
            "|---|" + "---|" * len(next(iter(dp["envoy_listener_stats"].values())))]
    for name, stats in dp["envoy_listener_stats"].items():
        out.append(f"| {name} | " + " | ".join(str(v) for v in stats.values()) + " |")
    return out + [""]


def write() -> str:
    names = ["validation", "picker", "lab-article", "lab-shared-prefix", "crosscheck", "phases", "demo"]
    data = {n: load(n) for n in names}
    loads = [v for d in data.values() if d for v in (d.get("load_average_start"), d.get("load_average_end"))
             if v is not None]
    lines = header(machine(), loads)
    lines += validation_section(data["validation"]) + picker_section(data["picker"])
    lines += lab_section(data["lab-article"], data["lab-shared-prefix"])
    lines += crosscheck_section(data["crosscheck"]) + phases_section(data["phases"]) + demo_section(data["demo"])
    text = "\n".join(lines).rstrip() + "\n"
    (REPO / "BENCHMARKS.md").write_text(text)
    print(f"wrote {REPO / 'BENCHMARKS.md'}")
    return text
