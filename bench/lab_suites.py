"""The lab's benchmarks of `python -m bench` (`lab`, `matrix`, `replicas`, `prefilter`): each runs
a lab command (lab/README.md) and turns the JSON it writes into its BENCHMARKS.md section."""

from __future__ import annotations

import shutil

from bench.common import PY, REPO, RESULTS, read_json, run_suite, run_suites
from bench.markdown import md_table, num, versus
from lab.article import ARTICLE
from lab.matrix import reuse_note
from loadtest.metrics import REPORT_KEYS, percent_change

# The lab benchmark's policies: least request (the 8080 route) against the picker's two profiles.
LAB_POLICIES = ["least-request", "picker", "picker-upstream"]
LABELS = {"mean_ttft_ms": "mean TTFT ms", "median_ttft_ms": "median TTFT ms", "p99_ttft_ms": "P99 TTFT ms",
          "mean_tpot_ms": "mean TPOT ms", "output_throughput": "output tok/s", "duration": "duration s"}
LAB_KEYS = [(k, LABELS[k]) for k in REPORT_KEYS]


def run_lab(workload: str, seeds: list[int] | None = None) -> dict:
    """`python -m lab run` on one workload, 5 seeds, least request vs the picker's profiles."""
    seeds = seeds or [0, 1, 2, 3, 4]
    out = RESULTS / f"lab-{workload}"
    if out.exists():
        shutil.rmtree(out)
    cmd = [PY, "-m", "lab", "run", "--workload", workload, *(a for p in LAB_POLICIES for a in ("--policy", p)),
           "--seeds", *map(str, seeds), "--out", str(out), "--plots"]
    return run_suite(f"lab-{workload}", cmd, lambda: {"summary": read_json(out / "summary.json")},
                     log=RESULTS / f"lab-{workload}.log", workload=workload, seeds=seeds,
                     results_dir=str(out.relative_to(REPO)))


def run_matrix(seeds: list[int] | None = None, extra: list[str] | None = None) -> dict:
    """`python -m lab matrix`: every scenario x policy x seed (lab/matrix.py), progress shown;
    `extra`: more options (e.g. from `python -m bench matrix --matrix-args "--jobs 3"`)."""
    extra = extra or []
    seeds = seeds or [0, 1, 2, 3, 4]
    out = RESULTS / "lab-matrix"
    cmd = [PY, "-m", "lab", "matrix", "--out", str(out), "--seeds", *map(str, seeds), *extra]
    # no log: output inherited, one progress line per scenario and seed
    return run_suite("lab-matrix", cmd, lambda: {"matrix": read_json(out / "matrix.json")}, seeds=seeds)


# Where the learned lengths' gap to the oracles goes: the picker told each request's class
# distribution or its true length instead of learning it, beside the learner and both oracles.
LENGTHS_SCENARIOS = ["chat-reasoning", "kv-0.8x", "client-mix", "reasoning-mix"]
LENGTHS_POLICIES = [("least-request", "least request"), ("picker", "default"),
                    ("picker:lengths", "lengths, learned"),
                    ("picker-told-distributions", "lengths, told each class's distribution"),
                    ("picker-told-lengths", "lengths, told each true length"),
                    ("oracle-dist", "oracle knowing distributions"), ("oracle", "oracle")]


def run_lengths_gap(seeds: list[int] | None = None) -> dict:
    """`python -m lab matrix` on LENGTHS_SCENARIOS with LENGTHS_POLICIES."""
    seeds = seeds or [0, 1, 2, 3, 4]
    out = RESULTS / "lengths-gap"
    cmd = [PY, "-m", "lab", "matrix", "--out", str(out), "--seeds", *map(str, seeds),
           *(a for s in LENGTHS_SCENARIOS for a in ("--scenario", s)),
           *(a for p, _ in LENGTHS_POLICIES for a in ("--policy", p))]
    return run_suite("lengths-gap", cmd, lambda: {"matrix": read_json(out / "matrix.json")}, seeds=seeds)


def lengths_gap_report(d: dict) -> list[str]:
    m = d["matrix"]
    rows = []
    for s in m["scenarios"]:
        p = s["policies"]
        lr, orc = p["least-request"]["mean_ttft_ms"]["mean"], p["oracle"]["mean_ttft_ms"]["mean"]
        cells = []
        for name, _ in LENGTHS_POLICIES:
            mean = p[name]["mean_ttft_ms"]["mean"]
            gap = f" ({(lr - mean) / (lr - orc) * 100:.0f} %)" if lr > orc and name != "least-request" else ""
            cells.append(f"{num(mean)} ± {num(p[name]['mean_ttft_ms']['std'])}{gap}")
        rows.append([s["name"], *cells])
    return [f"Command: `{d['command']}` (lab/matrix.py on {', '.join(LENGTHS_SCENARIOS)}; "
            f"{len(m['seeds'])} seeds, {d['wall_s'] / 60:.1f} min wall). The profile `lengths` as "
            "deployed (learning from the outcomes, cold at the start of every run), then told what "
            "the distribution oracle knows (each request's class distribution) or what the clairvoyant "
            "one knows (each request's length) instead of learning it; everything else as deployed (its "
            "view of the engines: a scrape every 0.1 s, which request runs and how far it got "
            "estimated). Cells: mean TTFT ms ± std over the seeds (share of the oracle's gap closed).",
            ""] + md_table(["scenario", *(label for _, label in LENGTHS_POLICIES)], rows)


# The replica experiment: both lab workloads on 16 groups at the same load per group as the
# 3-group runs (concurrency 160). At a low Poisson rate the outcome swings with each replica's
# tie-break draws far more than with sharing, so the closed loop is what is compared.
REPLICA_RUNS = {"shared-prefix": ["--workload", "shared-prefix"], "article": ["--workload", "article"]}


def run_replicas(seeds: list[int] | None = None) -> dict:
    """`python -m lab.replicas`: routing quality of 1, 2 and 4 picker replicas, shared or not."""
    seeds = seeds or [0, 1, 2, 3, 4]
    runs = {}
    for name, extra in REPLICA_RUNS.items():
        path = RESULTS / f"replicas-{name}.json"
        runs[name] = ([PY, "-m", "lab.replicas", "--engines", "16", "--replicas", "1", "2", "4",
                       "--seeds", *map(str, seeds), *extra, "--json", str(path)], path)
    return run_suites("replicas", runs)


PREFILTER_PROFILE = REPO / "bench" / "picker" / "prefilter-16.yaml"


def run_prefilter(seeds: list[int] | None = None) -> dict:
    """Routing quality with the candidate prefilter: the lab on 16 groups (concurrency 160), the
    default profile (all 16 scored) against the same profile with the prefilter forced on."""
    seeds = seeds or [0, 1, 2, 3, 4]
    runs = {}
    for workload in ("shared-prefix", "article"):
        out = RESULTS / f"prefilter-{workload}"
        runs[workload] = ([PY, "-m", "lab", "run", "--workload", workload, "--engines", "16", "--concurrency", "160",
                           "--policy", "least-request", "--policy", "picker", "--policy",
                           f"picker:{PREFILTER_PROFILE.relative_to(REPO)}", "--seeds", *map(str, seeds),
                           "--out", str(out)], out / "summary.json")
    return run_suites("prefilter", runs)


def _lab_table(summary: dict, article: bool) -> list[str]:
    digits = lambda k: 1 if "tpot" in k or "throughput" in k else 0  # noqa: E731
    rows = [[name, *(f"{num(stats[k]['mean'], digits(k))} ± {num(stats[k]['std'], digits(k))}" for k, _ in LAB_KEYS)]
            for name, stats in summary["policies"].items()]
    if article:
        rows += [[f"article {port}", *(num(ARTICLE[name][k], digits(k)) for k, _ in LAB_KEYS)]
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
                out.append(f"| {label} | {versus(pk[k]['mean'], lr[k]['mean'])} | "
                           f"{versus(ARTICLE['picker'][k], ARTICLE['least-request'][k])} | {target} | "
                           f"{'yes' if met else 'no'} |")
            up = p.get("picker-upstream")
            if up:
                better = pk["mean_ttft_ms"]["mean"] < up["mean_ttft_ms"]["mean"]
                out.append(f"| picker default vs upstream-default profile, mean TTFT | "
                           f"{versus(pk['mean_ttft_ms']['mean'], up['mean_ttft_ms']['mean'])} | | lower | "
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
                       f"{versus(pk['mean_ttft_ms']['mean'], up['mean_ttft_ms']['mean'])}." if up else ".")]
        out.append("")
    if not article and not shared:
        out += ["(not run)", ""]
    return out


MATRIX_POLICIES = [("least-request", "least request"), ("picker-upstream", "upstream-default"),
                   ("picker", "**default**"), ("picker:lengths", "**default + learned lengths**"),
                   ("oracle-dist", "oracle knowing length distributions"), ("oracle", "oracle")]
OTHER_POLICIES = [("round-robin", "round robin"), ("picker-flow", "default + flow control"),
                  ("picker-flow-reject", "flow control, reject at bound"),
                  ("oracle-late", "oracle, may hold")]


def _cell(stats: dict) -> str:
    return (f"{num(stats['mean_ttft_ms']['mean'])} / {num(stats['p99_ttft_ms']['mean'])} / "
            f"{num(stats['output_throughput']['mean'], 1)}")


def _matrix_targets(scenarios: list[dict], who: str = "`default`") -> list[str]:
    """Which of the routing targets the measured matrix meets, scenario by scenario."""
    worse = [f"{s['name']} ({', '.join(k for k, v in s['assessment']['worse_than_baseline_beyond_spread'].items() if v)})"
             for s in scenarios if any(s["assessment"].get("worse_than_baseline_beyond_spread", {}).values())]
    gap = [s for s in scenarios if s["assessment"].get("gap_target_applies")]
    short = [f"{s['name']} ({s['assessment']['gap_closed_pct']:.0f} %)" for s in gap
             if (s["assessment"]["gap_closed_pct"] or 0) < 75]
    upstream = [s["name"] for s in scenarios if s["assessment"].get("default_beats_upstream") is False]
    base = next((s for s in scenarios if s["name"] == "base"), None)
    out = [f"Targets (picker {who} against least request, means over the seeds; \"worse beyond the seed "
           "spread\" = worse by more than the larger of the two policies' standard deviations over seeds):", ""]
    out.append("- never worse than least request beyond the seed spread in mean TTFT, P99 TTFT or output "
               f"throughput: {'met in every scenario' if not worse else 'not met in ' + '; '.join(worse)};")
    out.append(f"- at least 75 % of the oracle's gap closed where the oracle beats least request by 20 % or more "
               f"({len(gap)} scenarios: {', '.join(s['name'] for s in gap) or 'none'}): "
               f"{'met' if not short else 'not met in ' + ', '.join(short)};")
    if base and base["assessment"].get("change_pct"):
        c = base["assessment"]["change_pct"]
        ok = c["mean_ttft_ms"] <= -40 and c["p99_ttft_ms"] <= -25
        out.append(f"- article workload (base) at or below -40 % mean and -25 % P99 TTFT: "
                   f"{c['mean_ttft_ms']:+.1f} % / {c['p99_ttft_ms']:+.1f} %, {'met' if ok else 'not met'};")
    out.append(f"- {who} beats `upstream-default` in mean TTFT: "
               + ("in every scenario." if not upstream else f"not in {', '.join(upstream)}."))
    return out


def _flow_targets(scenarios: list[dict]) -> list[str]:
    """The same targets for the picker with flow control (when the matrix ran it)."""
    if not any(s.get("assessment_flow") for s in scenarios):
        return []
    return [""] + _matrix_targets([{**s, "assessment": s.get("assessment_flow") or {}} for s in scenarios],
                                  "`default` + flow control")


def _cpu_minutes(m: dict) -> float:
    return sum(sum(p.get("cpu_s", {}).get("values", [])) for s in m["scenarios"]
               for p in s["policies"].values()) / 60


def _pct(value) -> str:
    return "-" if value is None else num(value) + " %"


def _changes(c: dict) -> str:
    return (f"{c['mean_ttft_ms']:+.1f} %, {c['p99_ttft_ms']:+.1f} %, {c['output_throughput']:+.1f} %"
            if c else "-")


def _routing_rows(scenarios: list[dict]) -> list[list[str]]:
    rows = []
    for s in scenarios:
        a, al, p = s["assessment"], s.get("assessment_lengths") or {}, s["policies"]
        rows.append([f"{s['name']}: {s['description']}", s["factor"],
                     *(_cell(p[name]) if name in p else "-" for name, _ in MATRIX_POLICIES),
                     _changes(a.get("change_pct")), _changes(al.get("change_vs_default_pct")),
                     f"{_pct(a.get('gap_closed_pct'))} / {_pct(al.get('gap_closed_pct'))}",
                     f"{_pct(a.get('dist_gap_closed_pct'))} / {_pct(al.get('dist_gap_closed_pct'))}"])
    return rows


def _other_rows(scenarios: list[dict]) -> list[list[str]]:
    rows = []
    for s in scenarios:
        p, f = s["policies"], s.get("assessment_flow") or {}
        failed = [p[n]["failed"]["mean"] for n in ("picker-flow", "picker-flow-reject") if n in p]
        rows.append([s["name"], *(_cell(p[name]) if name in p else "-" for name, _ in OTHER_POLICIES),
                     _changes(f.get("change_pct")), _pct(f.get("gap_closed_pct")),
                     " / ".join(num(v, 1) for v in failed) if failed else "-"])
    return rows


def _accuracy_rows(scenarios: list[dict], policy: str = "picker:lengths") -> list[list[str]]:
    rows = []
    for s in scenarios:
        p = s["policies"].get(policy, {})
        if "length_abs_error_median" not in p:
            continue
        cell = lambda key, pct=False: (num(100 * p[key]["mean"]) + " %" if pct  # noqa: E731
                                       else num(p[key]["mean"])) if key in p else "-"
        rows.append([s["name"], cell("length_abs_error_median"),
                     cell("length_rel_error_median", True), cell("length_p90_coverage", True),
                     cell("length_abs_error_median_learned"),
                     cell("length_rel_error_median_learned", True),
                     cell("length_p90_coverage_learned", True)])
    return rows


def _lengths_targets(scenarios: list[dict]) -> list[str]:
    """Issue targets of routing on learned lengths (picker:lengths), scenario by scenario."""
    if not any(s.get("assessment_lengths") for s in scenarios):
        return []
    hard = {"chat-reasoning", "kv-0.8x", "open-bursty-80", "open-bursty-95", "outage"}
    mixes = [s for s in scenarios if s["factor"] == "lengths"]
    short, short_mix, worse = [], [], []
    for s in scenarios:
        al = s.get("assessment_lengths") or {}
        gap, dist = al.get("gap_closed_pct"), al.get("dist_gap_closed_pct")
        label = f"{s['name']} ({_pct(gap)} of the oracle's gap, {_pct(dist)} of the distribution oracle's)"
        if s["name"] in hard and not ((gap or 0) >= 75 or (dist or 0) >= 90):
            short.append(label)
        if s in mixes and (dist or 0) < 90 and s["name"] != "no-signal":
            short_mix.append(label)
        bad = [f"{k} vs {who}" for who, key in (("least request", "worse_than_baseline_beyond_spread"),
                                                ("default", "worse_than_default_beyond_spread"))
               for k, v in (al.get(key) or {}).items() if v]
        if bad:
            worse.append(f"{s['name']} ({', '.join(bad)})")
    return ["", "Targets of routing on learned lengths (`default + learned lengths` = profile `lengths`, "
            "means over the seeds; spread as above):", "",
            "- chat-reasoning, kv-0.8x, open-bursty-80, open-bursty-95, outage: each closes at least 75 % of "
            "the oracle's gap or at least 90 % of the distribution oracle's: "
            + ("met;" if not short else "not met in " + "; ".join(short) + ";"),
            "- the observable-field mixes (client-mix, template-mix, reasoning-mix): at least 90 % of the "
            "distribution oracle's gap: " + ("met;" if not short_mix else "not met in " + "; ".join(short_mix) + ";"),
            "- never worse than `default` nor than least request beyond the seed spread (mean TTFT, P99 TTFT, "
            "output tok/s), no-signal and KV-starved pools included: "
            + ("met in every scenario." if not worse else "not met in " + "; ".join(worse) + ".")]


def matrix_report(d: dict) -> list[str]:
    m = d["matrix"]
    seeds = " ".join(map(str, m["seeds"]))
    scenarios = m["scenarios"]
    out = [f"Command: `{d['command']}` (lab/matrix.py; {len(scenarios)} scenarios x "
           f"{len(m['policies'])} policies x {len(m['seeds'])} seeds in {m['workers']} processes: "
           f"**{d['wall_s'] / 60:.1f} min wall**{reuse_note(m)}, target 15 min; 1-minute load average "
           f"{d['load_average_start']:.1f} at the start, {d['load_average_end']:.1f} at the end). Design: a "
           "base scenario (the article's run: `article` workload, closed loop at concurrency 30, 3 "
           "`a10-qwq32b` groups, KV 1x) and one-factor variations of it, not the full cartesian product. "
           "Open-loop rates are fractions of the pool's capacity measured in the same run (least request's "
           f"request throughput on the base scenario: {num(m['capacity_rps'], 4)} requests/s). Every client "
           "sends `max_tokens` as a cap (16,384, or its workload's own), never its answer's length. CPU time "
           f"of all runs: {_cpu_minutes(m):.1f} min. Reported seeds {seeds}; the picker's profiles were not "
           f"tuned on them (tuning seeds: {' '.join(map(str, m['tuning_seeds']))}).", "",
           "The oracle is clairvoyant (lab/oracle.py): it knows every engine's exact state and every request's "
           "output length, plays each candidate group forward and sends the request where its first token "
           "comes soonest. The distribution oracle (lab/distribution_oracle.py) does the same with every "
           "length replaced by what its class's distribution says (a running request's expected residual "
           "given what it produced): the best any length learner could know. Gap closed = (least request - "
           "policy) / (least request - oracle) in mean TTFT; to the distribution oracle likewise.", "",
           "Cells: mean TTFT ms / P99 TTFT ms / output tok/s, means over the seeds.", ""]
    out += md_table(["scenario", "varied", *(label for _, label in MATRIX_POLICIES),
                     "default vs least request (mean, P99, tok/s)",
                     "learned lengths vs default (mean, P99, tok/s)",
                     "oracle's gap closed (default / learned lengths)",
                     "distribution oracle's gap closed (default / learned lengths)"],
                    _routing_rows(scenarios))
    out += ["", "The other policies, and flow control with the default profile:", ""]
    out += md_table(["scenario", *(label for _, label in OTHER_POLICIES),
                     "flow control vs least request (mean, P99, tok/s)", "gap closed with flow control",
                     "failed with flow control (of the scenario's prompts; dispatch / reject at bound)"],
                    _other_rows(scenarios))
    accuracy = _accuracy_rows(scenarios)
    if accuracy:
        out += ["", "The predictor's accuracy (profile `lengths`; every decision's forecast against the "
                "answer's true length; \"once learned\": the decisions after the first 50):", ""]
        out += md_table(["scenario", "median abs error (tokens)", "median relative error",
                         "true length <= forecast 0.9 quantile", "once learned: median abs error",
                         "median relative error", "0.9-quantile coverage"], accuracy)
    return out + [""] + _matrix_targets(scenarios) + _lengths_targets(scenarios) \
        + _flow_targets(scenarios)


def replicas_report(d: dict) -> list[str]:
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
            cells.append(f"{num(m['mean'])} ± {num(m['std'])} ({versus(m['mean'], base)})")
        rows.append([_replica_label(name), *cells])
    return out + md_table(["replicas", *(labels.get(k, k) for k in d["runs"])], rows)


def prefilter_report(d: dict) -> list[str]:
    rows = []
    for workload, summary in d["runs"].items():
        p = summary["policies"]
        full = p.get("picker")
        for name, stats in p.items():
            m = stats["mean_ttft_ms"]
            vs = "" if name in ("picker", "least-request") or not full else (
                f"{versus(m['mean'], full['mean_ttft_ms']['mean'])}; within the seed spread: "
                f"{'yes' if abs(m['mean'] - full['mean_ttft_ms']['mean']) <= max(m['std'], full['mean_ttft_ms']['std']) else 'no'}")
            label = "prefilter forced on" if name.startswith("picker:") else name
            rows.append([workload, label, f"{num(m['mean'])} ± {num(m['std'])}",
                         f"{num(stats['p99_ttft_ms']['mean'])} ± {num(stats['p99_ttft_ms']['std'])}",
                         num(stats["output_throughput"]["mean"], 1), vs])
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
