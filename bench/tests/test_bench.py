"""bench: conversion of HTTP results to model time, the crosscheck verdict, the report from saved JSONs."""

from __future__ import annotations

import json
import sys

import pytest

from bench import common, crosscheck, lab_suites, report
from bench.registry import BY_NAME
from bench.picker.service import latency_bounded_rate
from loadtest.metrics import REPORT_KEYS


def http_result(mean_ttft_ms: float) -> dict:
    return {"num_prompts": 150, "completed": 300, "failed": 0, "unfinished": 0, "duration": 80.0,
            "output_throughput": 1000.0, "mean_ttft_ms": mean_ttft_ms, "median_ttft_ms": 100.0,
            "p99_ttft_ms": 2000.0, "mean_tpot_ms": 25.0}


def test_http_results_are_converted_to_model_time_per_run():
    r = crosscheck.to_model_time(http_result(400.0), speedup=5)
    assert r["mean_ttft_ms"] == 2000.0 and r["mean_tpot_ms"] == 125.0
    assert r["output_throughput"] == 200.0
    assert r["duration"] == 200.0  # 80 s wall over 2 repetitions, x 5


def stats(mean_ttft: float) -> dict:
    return {k: mean_ttft if k == "mean_ttft_ms" else 100.0 for k in REPORT_KEYS}


def test_verdict_checks_order_and_tolerance():
    http = {"least-request": stats(3000), "picker": stats(2000)}
    ok = crosscheck.verdict(http, {"least-request": stats(2500), "picker": stats(1600)})
    assert ok["same_order"] and ok["within_tolerance"]
    assert ok["lab_vs_http_mean_ttft"]["picker"] == pytest.approx(-0.2)
    far = crosscheck.verdict(http, {"least-request": stats(2000), "picker": stats(1400)})
    assert far["same_order"] and not far["within_tolerance"]  # least request -33 %
    flipped = crosscheck.verdict(http, {"least-request": stats(2000), "picker": stats(2500)})
    assert not flipped["same_order"]
    assert ok["lab_vs_http_mean_ttft"]["least-request"] == pytest.approx(-1 / 6)


def test_report_puts_the_article_beside_the_lab(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "REPO", tmp_path)
    agg = lambda v: {k: {"mean": v, "std": 1.0} for k, _ in lab_suites.LAB_KEYS}  # noqa: E731
    summary = {"policies": {"least-request": agg(10000.0), "picker": agg(5000.0)}}
    (tmp_path / "lab-article.json").write_text(json.dumps({"summary": summary, "wall_s": 60.0}))
    text = report.write()
    assert "| article 8080 | 10,909 |" in text and "| article 8081 | 7,336 |" in text
    assert "| mean TTFT | -50.0 % | -32.8 % | at least -40 % | yes |" in text
    assert "| output tok/s | -50.0 % | +1.7 % | not lower | no |" in text
    assert "## Validation time\n\n(not run)" in text
    assert "## `make demo` on the real data plane\n\n(not run)" in text
    assert (tmp_path / "BENCHMARKS.md").read_text() == text


def test_a_partial_rerun_keeps_the_machine_of_the_sections_it_keeps(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "REPO", tmp_path)
    monkeypatch.setattr(report, "machine", lambda: {"nproc": 2, "cpu_model": "New CPU", "memory_gb": 8,
                                                    "python": "3", "kernel": "6"})
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n\n## Machine\n\n- 2 CPUs: Old CPU\n\n"
                                            "## Validation time\n\nold figures\n")
    runs = [{"fault": "killed", "listener": "http", "requests_after_fault": 9, "failed": 0,
             "last_failure_s": None, "late_requests": 5, "late_failed": 0, "load_rate": 60.0}]
    (tmp_path / "dead-backend.json").write_text(json.dumps({"command": "c", "wall_s": 1, "runs": runs}))
    text = report.write()
    assert "## Validation time\n\nold figures" in text
    machine = text[text.index("## Machine"):text.index("## Validation time")]
    assert machine.index("- 2 CPUs: Old CPU") < machine.index(
        'Since then, "A dead or stalled backend on both listeners" ran again on:') < machine.index("New CPU")
    assert "six clients sending 60 requests a second in all" in text
    again = report.write()  # from the same runs: nothing added
    assert again[again.index("## Machine"):again.index("## Validation time")] == machine
    # without an earlier report there is nothing to keep: one machine
    (tmp_path / "BENCHMARKS.md").unlink()
    text = report.write()
    assert "Old CPU" not in text and "Since then" not in text


def test_suites_save_each_command_its_wall_time_and_what_it_wrote(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "REPO", tmp_path)

    def writes(path, value) -> list[str]:
        return [sys.executable, "-c", f"import json; json.dump({{'v': {value}}}, open({str(path)!r}, 'w'))"]

    one = common.run_suite("one", writes(tmp_path / "r.json", 1), lambda: {"result": common.read_json(tmp_path / "r.json")},
                        log=tmp_path / "one.log", seeds=[3])
    assert json.loads((tmp_path / "one.json").read_text()) == one
    assert one["result"] == {"v": 1} and one["seeds"] == [3] and one["command"].startswith("python -c ")
    assert one["wall_s"] > 0 and {"load_average_start", "load_average_end", "finished_at"} <= one.keys()
    runs = common.run_suites("two", {"a": (writes(tmp_path / "a.json", 2), tmp_path / "a.json"),
                                     "b": (writes(tmp_path / "b.json", 3), tmp_path / "b.json")})
    assert json.loads((tmp_path / "two.json").read_text()) == runs
    assert runs["runs"] == {"a": {"v": 2}, "b": {"v": 3}} and list(runs["commands"]) == ["a", "b"]
    assert (tmp_path / "two-a.log").exists() and (tmp_path / "two-b.log").exists()
    with pytest.raises(RuntimeError, match="exited with 3"):
        common.run_suite("fails", [sys.executable, "-c", "raise SystemExit(3)"], dict, log=tmp_path / "f.log")
    assert not (tmp_path / "fails.json").exists()


def grpc_run(endpoints, closed_per_s: float, decide_p99: float, open_p99: dict[float, float]) -> dict:
    opens = [{"offered_per_s": rate, "decisions_per_s": rate, "p50_ms": 1.0, "p99_ms": p99, "errors": 0}
             for rate, p99 in open_p99.items()]
    return {"endpoints": endpoints, "mode": "buffered", "open_loops": opens,
            "max_rate_p99_within_target": latency_bounded_rate(opens),
            "closed_loop": {"decisions_per_s": closed_per_s, "p50_ms": 30.0, "p99_ms": 50.0, "errors": 0,
                            "server_cpu_ms_per_request": 0.6,
                            "decide": {"count": 10, "p50_ms": 0.1, "p99_ms": decide_p99}}}


def test_picker_section_states_each_part_of_the_target_separately():
    met = {"result": {"grpc": [grpc_run(None, 2000, 0, {500: 3.0, 1000: 4.0}),
                               grpc_run(16, 1500, 0.3, {500: 2.0, 1000: 4.5})]}}
    text = "\n".join(BY_NAME["picker"].section(met))
    assert "| 16 endpoints | Python | buffered | 1,500 | 30.0 / 50.0 | 0.30 | 0.60 | 2.0 | 4.5 | 1,000/s | 0 |" in text
    met["result"]["grpc"][1]["open_loops"][0]["repeats"] = [{"p99_ms": 2.0, "errors": 0}, {"p99_ms": 7.5, "errors": 0}]
    assert "| 2.0 [2.0 7.5] | 4.5 |" in "\n".join(BY_NAME["picker"].section(met))
    assert "1,500/s (median run), met;" in text and "0.30 ms, met;" in text and "up to 1,000/s offered." in text
    nothing = {"result": {"grpc": [grpc_run(16, 900, 6.0, {250: 6.0, 1000: 27.0})]}}
    assert "not even the lowest offered rate, not at 1,000/s." in "\n".join(BY_NAME["picker"].section(nothing))
    missed = {"result": {"grpc": [grpc_run(16, 900, 6.0, {500: 4.0, 1000: 27.0})]}}
    text = "\n".join(BY_NAME["picker"].section(missed))
    assert "900/s (median run), not met;" in text and "6.00 ms, not met;" in text
    assert "up to 500/s offered, not at 1,000/s." in text


def test_picker_section_sets_the_two_servers_side_by_side_and_states_their_targets():
    def run(endpoints, server, cpu, per_s):
        r = grpc_run(endpoints, per_s, 0.3, {500: 2.0})
        r["server"], r["closed_loop"]["server_cpu_ms_per_request"] = server, cpu
        return r
    long = {"chunk_bytes": 16384, "held_requests": 128, "endpoints": 16,
            "inprocess": [{"tokens": t, "body_bytes": 5 * t, "prompt_tokens": t, "cpu_ms_per_decision": c,
                           "cpu_p50_ms": c, "held_bytes_per_request": 5 * t + 500, "held_overhead_bytes": 500}
                          for t, c in ((1000, 0.3), (100_000, 1.8))],
            "grpc": [{"server": srv, "tokens": t, "held": 128, "held_bytes_per_request": 6 * t,
                      "closed_loop": {"decisions_per_s": 100.0, "server_cpu_ms_per_request": c, "errors": 0}}
                     for srv, t, c in (("native", 1000, 0.5), ("native", 100_000, 1.4),
                                       ("python", 1000, 1.0), ("python", 100_000, 5.0))]}
    d = {"result": {"grpc": [run(None, "native", 0.25, 4000), run(None, "python", 0.9, 1400),
                             run(16, "native", 0.6, 2500), run(16, "python", 1.3, 900)], "long": long}}
    text = "\n".join(BY_NAME["picker"].section(d))
    assert "| 16 endpoints | buffered | 0.60 | 1.30 | 0.46 | 2,500 | 900 | 2.78 |" in text
    assert "- null server, buffered: CPU per request at most a third of the Python server's: 0.25 against " \
           "0.90 ms (0.28), met." in text
    assert "- 16 endpoints, buffered: CPU per request at most half of the Python server's: 0.60 against " \
           "1.30 ms (0.46), met." in text
    assert "| 100,000 tokens | compiled | 100 | 1.40 | 2.80 | 128 | 586 | 0 |" in text
    assert "- target, compiled server: a 100k-token prompt at most 3x the CPU of a 1k-token one: 2.8x, met." in text
    assert "- target, Python server: a 100k-token prompt at most 3x the CPU of a 1k-token one: 5.0x, not met." in text
    assert "Target at 16 endpoints (buffered), compiled server:" in text
    assert "Go endpoint picker" in text and "1,725-2,234 decisions/s" in text
    pod = lambda server, w, per_s, p50, p99: {"server": server, "workers": w, "decisions_per_s": per_s,  # noqa: E731
                                              "p50_ms": p50, "p99_ms": p99, "server_cpu_cores": 1.5,
                                              "server_cpu_ms_per_request": 0.5,
                                              "repeats": [{"decisions_per_s": per_s}]}
    d["result"]["pod"] = [pod("python", 2, 800, 80.0, 120.0), pod("native", 1, 2000, 30.0, 50.0),
                          pod("native", 2, 2600, 24.0, 45.0)]
    text = "\n".join(BY_NAME["picker"].section(d))
    assert "| compiled server, 2 workers | 2,600 [2,600] | 3.25 | 24.0 / 45.0 | 1.50 | 0.50 |" in text
    assert "- target: one pod at least 2x today's decisions/s: 3.25x (2 workers), met;" in text
    assert "24.0 / 45.0 ms at 2,600/s, not met." in text  # p50 above the Go picker's 19 ms


def test_demo_section_shows_both_listeners_cpu_and_envoy_counters():
    result = lambda ttft: {"mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,  # noqa: E731
                           "mean_tpot_ms": 20.0, "output_throughput": 100.0, "completed": 150, "failed": 0}
    stats = {"downstream_rq_total": 300, "downstream_rq_2xx": 300}
    demo = {"command": "make demo", "wall_s": 200.0, "results_dir": "results/bench/demo",
            "results": {"http": result(400.0), "llm-gw": result(300.0)},
            "dataplane": {"workload": "demo", "speedup": 5, "wall_s": 180.0, "cores": 2,
                          "listeners": {"http": 18080, "llm-gw": 18081},
                          "cpu_s": {"picker": 18.0, "envoy-gateway": 9.0},
                          "envoy_listener_stats": {"http": stats, "llm-gw": stats}}}
    text = "\n".join(BY_NAME["demo"].section(demo))
    assert "| http (18080) | 400 | 400 | 800 |" in text and "| llm-gw (18081) | 300 |" in text
    assert "mean TTFT -25.0 %" in text
    assert "| picker | 18.0 | 0.10 |" in text and "| envoy-gateway | 9.0 | 0.05 |" in text
    assert "| llm-gw | 300 | 300 |" in text


def test_coldstart_report_shows_lab_and_http_spreads():
    from bench import coldstart

    trial = lambda per_group: {"per_group": per_group, "groups_used": sum(1 for n in per_group if n),  # noqa: E731
                               "mean_ttft_ms": 100.0, "max_ttft_ms": 200.0}
    row = lambda trials: {"trials": trials, "mean_largest_share": max(t["per_group"][0] for t in trials) / 30,  # noqa: E731
                          "all_on_one_group": sum(t["groups_used"] == 1 for t in trials),
                          "mean_ttft_ms": 100.0, "mean_max_ttft_ms": 200.0}
    d = {"command": "python -m bench coldstart", "trials": 2, "burst": 30, "prefix_tokens": 2000,
         "question_tokens": 200, "output_tokens": 300, "http_speedup": 20,
         "lab": {"picker-upstream": row([trial([30, 0, 0]), trial([30, 0, 0])])},
         "http": {"picker": row([trial([10, 10, 10])])}}
    text = "\n".join(coldstart.report(d))
    assert "| lab picker-upstream | 100% | 2 of 2 | 30/0/0 30/0/0 |" in text
    assert "| HTTP picker | 33% | 0 of 1 | 10/10/10 |" in text


def test_scale_sections_state_the_1024_endpoint_target_and_the_replica_changes():
    row = {"decisions_per_s": 2000.0, "p50_ms": 0.2, "p99_ms": 3.0, "cpu_p50_ms": 0.17,
           "cpu_ms_per_decision": 0.2}
    inp = [{**row, "endpoints": 1024, "prefilter": True, "cpu_p99_ms": 0.6},
           {**row, "endpoints": 1024, "prefilter": False, "cpu_p99_ms": 4.0}]
    text = "\n".join(BY_NAME["picker-scale"].section({"result": {"inprocess": inp}}))
    assert "CPU p99 0.600 ms, met" in text and "off (every candidate scored)" in text
    inp[0]["cpu_p99_ms"] = 1.2
    assert "CPU p99 1.200 ms, not met" in "\n".join(BY_NAME["picker-scale"].section({"result": {"inprocess": inp}}))
    ttft = lambda m, s=10.0: {"mean_ttft_ms": {"mean": m, "std": s}}  # noqa: E731
    runs = {"shared-prefix": {"policies": {"picker": ttft(1000), "replicas:2": ttft(1100),
                                           "replicas:2:independent": ttft(1500)}}}
    text = "\n".join(BY_NAME["replicas"].section({"runs": runs}))
    assert "| 2, shared every 20 ms | 1,100 ± 10 (+10.0 %) |" in text
    assert "| 2, independent | 1,500 ± 10 (+50.0 %) |" in text
    assert lab_suites._replica_label("replicas:4:sync=0") == "4, shared before every decision"
    lab = lambda m, s: {**ttft(m, s), "p99_ttft_ms": {"mean": 1.0, "std": 0.0},  # noqa: E731
                        "output_throughput": {"mean": 1.0}}
    pf = {"runs": {"article": {"policies": {"picker": lab(1000, 50), "picker:x.yaml": lab(1040, 60)}}}}
    assert "+4.0 %; within the seed spread: yes" in "\n".join(BY_NAME["prefilter"].section(pf))
    pf["runs"]["article"]["policies"]["picker:x.yaml"] = lab(1200, 60)
    assert "within the seed spread: no" in "\n".join(BY_NAME["prefilter"].section(pf))


def test_robustness_figures_come_from_what_the_tests_recorded(tmp_path):
    """A test's record_property lands in the JUnit XML; the soak and dead-backend sections show it."""
    import json
    import subprocess
    import sys

    from bench import robustness
    test = tmp_path / "test_recording.py"
    test.write_text("import json\n"
                    "def test_one(record_property):\n"
                    "    record_property('figures', json.dumps({'failed': 2}))\n"
                    "def test_silent():\n"
                    "    pass\n")
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test),
                    f"--junitxml={xml}", "--rootdir", str(tmp_path)], check=True, capture_output=True)
    assert robustness.recorded(xml) == {"test_one": {"figures": json.dumps({"failed": 2})}}

    rounds = [{"round": 0, "rss_mib": 150.0, "series": 60, "page_bytes": 9000, "good_ms": 0.9},
              {"round": 1, "rss_mib": 190.0, "series": 66, "page_bytes": 9500, "good_ms": 1.1,
               "good_during_ms": 3.0, "inflight": 0.0, "big_bodies": {"buffered 503": 16, "full-duplex 503": 8}}]
    soak = "\n".join(robustness.soak_report({"command": "c", "wall_s": 10, "rounds": rounds}))
    assert "| 1 | 190 | 66 | 9,500 | 1.10 | 3.00 | 0 | 16 / 8 |" in soak
    assert "RSS 190-190 MiB (before: 150)" in soak and "(before: 0.90 ms)" in soak
    runs = [{"fault": "killed", "listener": "http", "requests_after_fault": 300, "failed": 2,
             "last_failure_s": 0.4, "late_requests": 120, "late_failed": 0}]
    dead = "\n".join(robustness.dead_backend_report({"command": "c", "wall_s": 60, "runs": runs}))
    assert "| killed | http | 300 | 2 | 0.4 | 120 | 0 |" in dead


def test_every_registered_benchmark_has_its_own_results_and_section(tmp_path, monkeypatch):
    from bench.registry import BENCHMARKS

    results = [r for b in BENCHMARKS for r in b.result_names]
    assert len(results) == len(set(results)) and len(BY_NAME) == len(BENCHMARKS)
    empty = {b.name: b.section(*(None for _ in b.result_names)) for b in BENCHMARKS}
    titles = [lines[0] for lines in empty.values()]
    assert all(t.startswith("## ") for t in titles) and len(set(titles)) == len(titles)
    assert all("(not run)" in lines for lines in empty.values())
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "REPO", tmp_path)
    text = report.write()  # nothing run: every section in the registry's order, each named in the header
    assert [line for line in text.splitlines() if line in titles] == titles
    assert all(f"`{b.name}`" in text.split("## Machine")[0] for b in BENCHMARKS)


def test_a_section_run_again_leaves_the_earlier_machine_block_that_named_it(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "REPO", tmp_path)
    old = ["## Machine", "", "- 2 CPUs: Old CPU", "",
           'Since then, "A", "B: x, y" ran again on:', "", "- 2 CPUs: Mid CPU", "",
           'Since then, "C" ran again on:', "", "- 2 CPUs: Other CPU", ""]
    m = {"nproc": 2, "cpu_model": "New CPU", "memory_gb": 8, "python": "3", "kernel": "6"}
    lines = report.machine_section(m, [], old, ['"C"', '"B: x, y"'])
    text = "\n".join(lines)
    assert 'Since then, "A" ran again on:\n\n- 2 CPUs: Mid CPU' in text
    assert "Other CPU" not in text and text.count("Since then") == 2
    assert text.index("Old CPU") < text.index("Mid CPU") < text.index('Since then, "C", "B: x, y"')
    assert report.machine_section(m, [], lines, ['"C"', '"B: x, y"']) == lines


def test_failover_section_shows_each_fault_as_the_test_recorded_it():
    from bench import failover
    case = {"case": "SIGKILL (crash)", "body_mode": "full-duplex", "requests": 3000, "failed": 2,
            "failed_arriving_after": 0, "open_at_fault": 9, "open_at_fault_failed": 2,
            "open_at_fault_failed_within_s": 0.01, "unrouted": 0, "degraded_from_s": -0.2,
            "degraded_window_s": 0.31, "affected": 5, "longest_request_s": 0.9,
            "mean_ttft_ms": 12.5, "p99_ttft_ms": 40.1, "errors": [], "failed_statuses": [503]}
    text = "\n".join(failover.report({"command": "FAILOVER_BENCH=1 pytest", "wall_s": 600,
                                      "cases": [case]}))
    assert "| SIGKILL (crash) | full-duplex | 3000 | 2 | 0 | 2 of 9 | 0 | 0.31 | 0.90 | 12.5 | 40.1 |" in text
    assert "FAILOVER_BENCH=1 pytest" in text


def test_replicas_precise_rows_span_workloads_whose_failover_counts_differ():
    from bench.kv_suites import replicas_precise_report

    def run(k, ttft):
        mean = lambda m: {"mean_ttft_ms": {"mean": m, "std": 1.0}}  # noqa: E731
        return {"policies": {"picker": mean(100.0), "picker+precise": mean(100.0),
                             f"replicas:2:active-passive:failover={k}+precise": mean(ttft)}}
    text = "\n".join(replicas_precise_report({"runs": {"shared-prefix": run(200, 100.0),
                                                        "article": run(150, 110.0)}}))
    assert "| replicas:2:active-passive:failover=half+precise | 100 ± 1 (+0.0 %) | 110 ± 1 (+10.0 %) |" in text
    assert "article 2 replicas active-passive failover=half +10.0 % (not met)" in text
    assert "shared-prefix 2 replicas active-passive failover=half +0.0 % (met)" in text
