import numpy as np
import pytest

from loadtest.metrics import RequestSample
from loadtest.plan import (RunOptions, RunPlan, arrival_offsets, parse_ports,
                           parse_workload_args)
from loadtest.workloads import PromptSpec


def specs(n):
    return [PromptSpec(prompt=f"p{i}", prompt_tokens=1, output_tokens=1) for i in range(n)]


def test_parsers():
    assert parse_ports("8080 8081") == [8080, 8081] == parse_ports("8080,8081")
    assert parse_ports("") == [] and parse_ports([9000]) == [9000]
    with pytest.raises(ValueError):
        parse_ports("80a")
    with pytest.raises(ValueError):
        parse_ports("70000")
    assert parse_workload_args("path=/x.json, input_len=20,range_ratio=0.5") == \
        {"path": "/x.json", "input_len": 20, "range_ratio": 0.5}
    with pytest.raises(ValueError, match="key=value"):
        parse_workload_args("oops")


def test_workers_split_prompts_without_overlap():
    opts = RunOptions(workload="smoke")
    plans = [RunPlan(specs(10), opts, worker_index=i, worker_count=3) for i in range(3)]
    handed = [p.next_request() for p in plans for _ in range(p.total)]
    assert sorted(s.prompt for s, _ in handed) == sorted(f"p{i}" for i in range(10))
    assert all(p.next_request() is None for p in plans)


def test_done_fires_once_after_every_sample_and_ports_round_robin():
    done = []
    plan = RunPlan(specs(2), RunOptions(ports=[8080, 8081]), on_done=lambda: done.append(1))
    assert [plan.next_port() for _ in range(3)] == [8080, 8081, 8080]
    plan.record(RequestSample(start=0, success=True))
    assert not done
    plan.record(RequestSample(start=0, success=False, error="x"))
    assert done == [1] and "2/2 done, 1 failed" in plan.progress()


def test_cycle_mode_keeps_handing_out_prompts():
    plan = RunPlan(specs(2), RunOptions(cycle=True))
    assert [plan.next_request()[0].prompt for _ in range(5)] == ["p0", "p1", "p0", "p1", "p0"]


def test_request_rate_schedule():
    assert not arrival_offsets(5, 0, 1.0, 0).any()
    offsets = arrival_offsets(4000, 20.0, 1.0, 0)
    assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0)
    assert abs(offsets[-1] / 3999 - 1 / 20.0) < 0.005   # mean gap 1/rate
    plan = RunPlan(specs(3), RunOptions(request_rate=2.0), clock=lambda: 100.0)
    assert plan.next_request()[1] == 100.0 and plan.next_request()[1] > 100.0


def test_bad_options():
    with pytest.raises(ValueError, match="endpoint"):
        RunOptions(endpoint="embeddings")
    with pytest.raises(ValueError):
        RunOptions(request_rate=-1)
