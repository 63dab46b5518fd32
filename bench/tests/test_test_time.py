"""The test-time benchmark reads pytest's own summary and durations from the logs it keeps."""

from __future__ import annotations

from bench import test_time

LOG = """\
........                                                                 [100%]
============================= slowest durations ==============================
62.10s call     tests/e2e/test_e2e_edge_abuse.py::test_slow_clients_are_cut_at_the_header_timeout
31.52s setup    tests/e2e/test_e2e_vllm.py::test_both_listeners_serve_real_vllm_through_the_gateway
7.00s teardown  picker/tests/test_scale.py::test_workers_share_the_grpc_port_and_the_metrics
465 passed, 2 skipped in 81.30s (0:01:21)
make[1]: Leaving directory
63 passed in 40.02s
"""


def test_each_pytest_run_and_the_slowest_phases_are_read_from_the_log():
    assert test_time.pytest_runs(LOG) == [{"counts": {"passed": 465, "skipped": 2}, "seconds": 81.3},
                                          {"counts": {"passed": 63}, "seconds": 40.02}]
    slow = test_time.slowest(LOG, top=2)
    assert [(s["seconds"], s["phase"]) for s in slow] == [(62.1, "call"), (31.52, "setup")]
    assert slow[0]["test"].endswith("test_slow_clients_are_cut_at_the_header_timeout")


def test_the_report_states_each_target_met_or_not():
    def run(wall):
        return {"command": "make x", "wall_s": wall, "load_average_start": 1.0, "load_average_end": 2.5,
                "pytest": test_time.pytest_runs(LOG), "slowest": test_time.slowest(LOG)}
    text = "\n".join(test_time.report({"check": run(100.0), "test": run(800.0)}))
    assert "| `make check` | 100 | <= 120 | yes | 528 | 1.0 / 2.5 |" in text
    assert "| `make test` | 800 | <= 720 | no | 528 |" in text
    assert "- 62 s call `tests/e2e/test_e2e_edge_abuse.py::test_slow_clients_are_cut_at_the_header_timeout`" in text
    ci = "\n".join(test_time.ci_report({"ci": run(1400.0)}))
    assert "| `.ci/run` | 1,400 | <= 1500 | yes |" in ci
    failing = run(90.0) | {"exit_code": 2, "pytest": [{"counts": {"passed": 10, "failed": 1}, "seconds": 80.0}]}
    assert "| `make check` | 90 | <= 120 | no (failed) | 10, 1 failed (exit code 2) |" in "\n".join(
        test_time.report({"check": failing, "test": run(700.0)}))
