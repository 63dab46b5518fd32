"""Autoscaling lab: the HPA's arithmetic, groups that start after a delay and drain on removal,
group-hours, the day trace and the planner."""
from __future__ import annotations

import pytest

from lab.autoscale import Hpa, Policy, ScalerSettings, ScalingLab, slo_figures
from lab.daytrace import DAY_SHAPE, day_trace, rate_share, write_trace
from lab.plan import answer, evaluate
from lab.policies import make_policy
from lab.simulation import LabConfig, prepare_requests
from loadtest.metrics import RequestSample
from loadtest.traces import trace_workload


def settings(**kw):
    base = dict(min_groups=1, max_groups=6, target=4.0, up_window_s=0.0, down_window_s=60.0,
                up_policies=(Policy(2, 60),), down_policies=(Policy(1, 120),))
    return ScalerSettings(**{**base, **kw})


# ------------------------------------------------------------------ the HPA

def test_hpa_asks_ceil_of_signal_over_target_within_its_limits():
    hpa = Hpa(settings())
    assert hpa.desired(0, 8.5, 1) == 3           # ceil(8.5 / 4) = 3, +2 per 60 s allows 3
    assert hpa.desired(15, 40.0, 3) == 3         # 10 wanted; the 60 s period already added 2
    assert hpa.desired(61, 40.0, 3) == 5         # next period: +2
    assert hpa.desired(122, 400.0, 5) == 6       # max_groups


def test_hpa_tolerance_keeps_the_count():
    hpa = Hpa(settings())
    assert hpa.desired(0, 4 * 3 * 1.09, 3) == 3  # 9 % over target: within the 10 % tolerance
    assert hpa.desired(15, 4 * 3 * 1.2, 3) == 4


def test_hpa_scale_down_waits_for_its_window_and_removes_one_per_period():
    hpa = Hpa(settings())
    assert hpa.desired(0, 20.0, 5) == 5
    assert hpa.desired(30, 0.0, 5) == 5          # the window still holds the recommendation 5
    assert hpa.desired(61, 0.0, 5) == 4          # window passed: one group per 120 s
    assert hpa.desired(120, 0.0, 4) == 4
    assert hpa.desired(182, 0.0, 4) == 3
    assert hpa.desired(400, 0.0, 3) == 2
    assert hpa.desired(600, 0.0, 2) == 1         # min_groups
    assert hpa.desired(800, 0.0, 1) == 1


def test_settings_come_from_the_shipped_scaled_object():
    s = ScalerSettings.from_scaled_object()
    assert (s.min_groups, s.max_groups) == (2, 6)
    assert s.down_policies == (Policy(1, 300),) and s.down_window_s == 600
    assert s.target > 0


# ------------------------------------------------------------------ groups in the lab

def trace_requests(tmp_path, records):
    path = tmp_path / "t.jsonl"
    write_trace(path, records)
    return prepare_requests(trace_workload(0, str(path)), 16)


def burst_then_quiet(n=24, gap=2.0, output_tokens=400):
    return [{"prompt_tokens": 600, "output_tokens": output_tokens, "arrival_time": i * gap} for i in range(n)]


def run(requests, scaler, initial, startup_s=120.0, engines=None, policy="least-request"):
    config = LabConfig(num_engines=engines or (2 * scaler.max_groups if scaler else initial),
                       concurrency=None, seed=0)
    lab = ScalingLab(requests, make_policy(policy), config, scaler, initial, startup_s)
    return lab, lab.run()


def test_fixed_pool_bills_every_group_for_the_whole_run(tmp_path):
    requests = trace_requests(tmp_path, burst_then_quiet())
    lab, result = run(requests, None, 2)
    end = max(s.end for s in result.samples)
    assert result.summary["completed"] == len(requests) and result.summary["failed"] == 0
    assert result.summary["group_hours"] == pytest.approx(2 * end / 3600)


def test_a_policy_that_holds_requests_runs_with_scaling(tmp_path):
    """Flow control holds a burst in the picker while a small pool is saturated: the scaling lab
    runs the same event loop as the lab, so the held requests are woken and all complete."""
    requests = trace_requests(tmp_path, burst_then_quiet(n=40, gap=0.1, output_tokens=800))
    lab, result = run(requests, None, 1, policy="picker-flow")
    assert result.summary["completed"] == 40 and result.summary["failed"] == 0


def test_scaler_adds_groups_after_the_startup_delay_and_drains_them_without_failures(tmp_path):
    requests = trace_requests(tmp_path, burst_then_quiet(n=40, gap=8.0, output_tokens=3000))
    scaler = settings(min_groups=1, max_groups=4, target=2.0, down_window_s=30.0,
                      down_policies=(Policy(1, 15),), scrape_s=5.0, sync_s=5.0)
    lab, result = run(requests, scaler, 1, startup_s=120.0)
    assert result.summary["failed"] == 0 and result.summary["completed"] == 40
    ups = [(t, r, s) for t, r, s, _ in lab.timeline if r > 1]
    assert ups, "never scaled up"
    first_raise = ups[0][0]
    first_serving = next(t for t, r, s, _ in lab.timeline if s > 1)
    assert first_serving - first_raise >= 120.0 - 5.0       # serves only after the delay
    served_by = {s.target for s in result.samples}
    assert len(served_by) > 1                                # the new groups took requests
    assert lab.timeline[-1][1] == 1                          # back to the minimum at the end
    # billed: less than the maximum all along, more than one group all along
    end = max(s.end for s in result.samples)
    assert end / 3600 < result.summary["group_hours"] < 4 * end / 3600


def test_a_removed_group_finishes_its_requests(tmp_path):
    """Scale-down while a group holds long requests: they complete on it (no failure), and it
    gets no new request once it drains."""
    records = [{"prompt_tokens": 300, "output_tokens": 3000, "arrival_time": float(i)} for i in range(8)]
    records += [{"prompt_tokens": 300, "output_tokens": 50, "arrival_time": 200.0 + i} for i in range(10)]
    requests = trace_requests(tmp_path, records)
    scaler = settings(min_groups=1, max_groups=2, target=100.0, down_window_s=15.0,
                      down_policies=(Policy(1, 15),), scrape_s=5.0, sync_s=5.0)
    lab, result = run(requests, scaler, 2)                    # starts at 2, wants 1 at once
    assert result.summary["failed"] == 0
    long_on_second = [s for s in result.samples if s.output_tokens == 3000 and s.target.endswith(":8102")]
    late_on_second = [s for s in result.samples if s.output_tokens == 50 and s.target.endswith(":8102")]
    assert long_on_second and not late_on_second


def test_slo_figures_count_failures_as_missed():
    samples = [RequestSample(start=0, success=True, ttft=t, end=1) for t in (1, 2, 3, 30)]
    samples.append(RequestSample(start=0, success=False, end=0, error="x"))
    f = slo_figures(samples, 10.0)
    assert f["slo_attainment_pct"] == pytest.approx(60.0) and f["failed"] == 1 and f["p90_ttft_s"] == 30


# ------------------------------------------------------------------ trace and planner

def test_day_trace_follows_the_shape():
    records = day_trace(peak_rate=0.5, hours=2.0, seed=1)
    times = [r["arrival_time"] for r in records]
    assert times == sorted(times) and times[-1] < 7200
    hour = lambda t: 24 * t / 7200                                    # noqa: E731
    night = sum(1 for t in times if hour(t) < 6) / (6 / 24 * 7200)
    peak = sum(1 for t in times if 9 <= hour(t) < 12) / (3 / 24 * 7200)
    burst = sum(1 for t in times if 15 <= hour(t) < 15.33) / (0.33 / 24 * 7200)
    assert night == pytest.approx(0.5 * 0.15, rel=0.35)
    assert peak == pytest.approx(0.5, rel=0.2)
    assert burst > 1.4 * peak
    assert rate_share(10) == 1.0 and rate_share(3) == DAY_SHAPE[0][1]


def test_planner_picks_the_smallest_pool_that_meets_the_objective(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, [{"prompt_tokens": 3000, "output_tokens": 1500, "arrival_time": i * 0.5}
                       for i in range(30)])
    results = evaluate(str(path), slo_s=2.0, pools=[1, 3], seeds=[0], scaler=None)
    one, three = results["fixed-1"], results["fixed-3"]
    assert three["slo_attainment_pct"] > one["slo_attainment_pct"]
    assert three["group_hours"] > one["group_hours"]
    verdict = answer(results, attainment_pct=(one["slo_attainment_pct"] + three["slo_attainment_pct"]) / 2)
    assert verdict["smallest_fixed_pool"] == 3
    assert answer(results, attainment_pct=101)["smallest_fixed_pool"] is None
