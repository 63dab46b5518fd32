"""BENCHMARKS.md: the lab matrix section and sections kept for benchmarks not run."""

from __future__ import annotations

import json

from bench import common, report
from bench.registry import BY_NAME
from lab.matrix import assess


def stats(mean, p99, tput, std=50.0):
    return {"mean_ttft_ms": {"mean": mean, "std": std}, "p99_ttft_ms": {"mean": p99, "std": std},
            "output_throughput": {"mean": tput, "std": 1.0}, "cpu_s": {"values": [30.0, 30.0]}}


def scenario(name, policies, factor="-"):
    return {"name": name, "factor": factor, "description": name + " desc", "policies": policies,
            "assessment": assess(policies),
            "assessment_lengths": assess(policies, picker="picker:lengths")}


def matrix_bench():
    base = {"least-request": stats(10000, 90000, 230), "round-robin": stats(15000, 99000, 225),
            "picker-upstream": stats(20000, 400000, 220), "picker": stats(5000, 50000, 236),
            "picker:lengths": stats(4800, 48000, 236), "oracle-dist": stats(4500, 40000, 232),
            "oracle": stats(4000, 30000, 232)}
    mixed = {"least-request": stats(18000, 200000, 170), "round-robin": stats(40000, 300000, 140),
             "picker-upstream": stats(17000, 210000, 171), "picker": stats(15000, 180000, 165),
             "picker:lengths": stats(13000, 190000, 166), "oracle-dist": stats(12000, 150000, 175),
             "oracle": stats(11000, 90000, 180)}
    mixed["picker:lengths"].update({f"length_{k}": {"mean": v, "std": 0.0} for k, v in (
        ("abs_error_median", 120.0), ("rel_error_median", 0.31), ("p90_coverage", 0.87))})
    m = {"seeds": [0, 1], "policies": list(base), "capacity_rps": 0.1234, "wall_s": 600.0,
         "workers": 2, "tuning_seeds": [100, 101], "scenarios": [scenario("base", base),
                                                                 scenario("client-mix", mixed, "lengths")]}
    return {"command": "python -m lab matrix --out x --seeds 0 1", "wall_s": 630.0,
            "load_average_start": 3.0, "load_average_end": 4.0, "matrix": m}


def test_matrix_section_rows_and_targets():
    text = "\n".join(BY_NAME["matrix"].section(matrix_bench()))
    assert ("| base: base desc | - | 10,000 / 90,000 / 230.0 | 20,000 / 400,000 / 220.0 | "
            "5,000 / 50,000 / 236.0 | 4,800 / 48,000 / 236.0 | 4,500 / 40,000 / 232.0 | "
            "4,000 / 30,000 / 232.0 | -50.0 %, -44.4 %, +2.6 % | -4.0 %, -4.0 %, +0.0 % | "
            "83 % / 87 % | 91 % / 95 % |") in text
    assert "| base | 15,000 / 99,000 / 225.0 | - | - | - | - | - | - |" in text  # no flow-control runs
    assert "| client-mix | 120 | 31 % | 87 % | - | - | - |" in text        # the predictor's accuracy
    assert "**10.5 min wall**, target 15 min" in text and "0.1234 requests/s" in text
    assert "CPU time of all runs: 14.0 min" in text
    assert "not met in client-mix (output_throughput)" in text           # 165 vs 170 +- 1
    assert "(2 scenarios: base, client-mix): not met in client-mix (43 %)" in text
    assert "-50.0 % / -44.4 %, met;" in text
    assert "`default` beats `upstream-default` in mean TTFT: in every scenario." in text
    # learned lengths: the mix closes (18,000 - 13,000) / (18,000 - 12,000) = 83 % of the
    # distribution oracle's gap; its throughput (166 vs 170 +- 1) is worse than least request's
    assert "(client-mix, template-mix, reasoning-mix): at least 90 % of the distribution oracle's " \
           "gap: not met in client-mix (71 % of the oracle's gap, 83 % of the distribution oracle's);" in text
    assert "not met in client-mix (output_throughput vs least request, p99_ttft_ms vs default)." in text


def test_report_keeps_sections_of_benchmarks_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "REPO", tmp_path)
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n\nold header\n\n## Validation time\n\n"
                                            "| old table |\n\n## Local gateway streaming\n\n(not run)\n")
    (tmp_path / "lab-matrix.json").write_text(json.dumps(matrix_bench()))
    text = report.write()
    assert "## Validation time\n\n| old table |\n\n## Local gateway streaming\n\n(not run)\n\n## Picker" in text  # kept
    assert "## Picker decision throughput and latency\n\n(not run)" in text   # never run
    assert "| base: base desc |" in text and "old header" not in text



def test_precise_matrix_section_splits_the_outage_by_window():
    def with_windows(mean, before, during, after):
        s = stats(mean, 2 * mean, 200)
        for window, value in (("before", before), ("during", during), ("after", after)):
            s[f"mean_ttft_ms_{window}_outage"] = {"mean": value, "std": 1.0}
        return s
    policies = {"least-request": with_windows(20000, 10000, 60000, 12000),
                "picker": with_windows(15000, 5000, 70000, 3000),
                "picker+precise": with_windows(15000, 5000, 70000, 3000),
                "oracle": with_windows(13000, 5000, 50000, 2000)}
    m = {"seeds": [0, 1], "policies": list(policies), "wall_s": 60.0, "tuning_seeds": [100],
         "scenarios": [scenario("outage", policies)]}
    text = "\n".join(BY_NAME["matrix-precise"].section(
        {"command": "x", "wall_s": 60.0, "load_average_start": 1.0, "load_average_end": 1.0, "matrix": m}))
    assert "Target: the `outage` scenario closes >= 85 % of the oracle gap with precise routing: 71.4 %, not met." in text
    assert "| picker+precise | 5,000 | 70,000 | 3,000 |" in text
    assert "| gap closed by picker+precise | 100 % | -100 % | 90 % |" in text
