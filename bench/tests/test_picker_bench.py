"""`make bench-picker`, tiny: the real server, the Go load client, the server's decide() timings."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.picker import service as bench


def test_a_rate_meets_the_latency_target_only_if_served_in_full_without_errors():
    ok = {"offered_per_s": 1000, "decisions_per_s": 985, "errors": 0, "p99_ms": 4.9}
    assert bench._meets_latency_target(ok)
    assert not bench._meets_latency_target({**ok, "p99_ms": 5.1})
    assert not bench._meets_latency_target({**ok, "errors": 1})
    assert not bench._meets_latency_target({**ok, "decisions_per_s": 900})  # fell behind
    with_repeats = {**ok, "repeats": [{"errors": 0}, {"errors": 2}, {"errors": 0}]}
    assert not bench._meets_latency_target(with_repeats)  # errors in any run count


def test_a_repeated_run_is_reported_by_its_median():
    runs = [{"decisions_per_s": 99.0, "p50_ms": 1.0, "p99_ms": p99, "errors": 0, "requests": i}
            for i, p99 in enumerate([9.0, 3.0, 5.0])]
    m = bench._median_run(runs, "p99_ms")
    assert m["p99_ms"] == 5.0 and m["requests"] == 2
    assert [x["p99_ms"] for x in m["repeats"]] == [9.0, 3.0, 5.0]
    runs[0]["decisions_per_s"], runs[1]["decisions_per_s"] = 120.0, 80.0
    assert bench._median_run(runs, "decisions_per_s")["requests"] == 2  # 80, 99, 120


def test_the_latency_bounded_rate_stops_at_the_first_rate_that_misses():
    def run(rate, p99):
        return {"offered_per_s": rate, "decisions_per_s": rate, "errors": 0, "p99_ms": p99}
    assert bench.latency_bounded_rate([run(500, 4), run(250, 3), run(1000, 9)]) == 500
    assert bench.latency_bounded_rate([run(250, 3), run(500, 6), run(750, 4)]) == 250  # noise
    assert bench.latency_bounded_rate([run(250, 6)]) is None


@pytest.mark.server
def test_bench_drives_the_real_server_and_times_every_decision(tmp_path):
    """Over 30 s on a busy machine: the real picker server and the Go load client run the bench's
    closed and open loops (short ones), each started as a process."""
    assert os.access(bench.LOAD_CLIENT, os.X_OK), "load client missing: run `make tools`"
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.picker", "--seconds", "0.5", "--endpoints", "3",
         "--modes", "buffered,full-duplex", "--streams", "8", "--rates", "100", "--repeat", "2",
         "--parts", "inprocess,grpc,scrape", "--servers", "native,python", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [(g["endpoints"], g["mode"], g["server"]) for g in r["grpc"]] == [
        (n, mode, server) for mode in ("buffered", "full-duplex") for n in (None, 3)
        for server in ("native", "python")]
    for g in r["grpc"]:
        runs = [g["closed_loop"], *g["open_loops"]]
        assert all(x["errors"] == 0 and x["requests"] > 0 for x in runs), runs
        assert 49 <= g["open_loops"][0]["requests"] <= 51  # 100/s for 0.5 s, open loop
        repeats = g["open_loops"][0]["repeats"]
        assert len(repeats) == 2 and g["open_loops"][0]["p99_ms"] == max(x["p99_ms"] for x in repeats)
        repeats = g["closed_loop"]["repeats"]
        assert len(repeats) == 2
        assert g["closed_loop"]["decisions_per_s"] == max(x["decisions_per_s"] for x in repeats)
        if g["endpoints"] is not None:
            # the server timed exactly the decisions of each run, no more, no fewer
            assert [x["decide"]["count"] for x in runs] == [x["requests"] for x in runs]
            assert all(0 < x["decide"]["p50_ms"] <= x["decide"]["p99_ms"] for x in runs)
        assert "max_rate_p99_within_target" in g
    assert r["scrape"]["ready_endpoints"] == 64
    assert "p99 <= 5 ms at every rate up to" in run.stdout
