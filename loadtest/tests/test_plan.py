import numpy as np
import pytest

from loadtest.metrics import RequestSample
from loadtest.plan import (WAIT, RunOptions, RunPlan, arrival_offsets, parse_ports,
                           parse_workload_args)
from loadtest.prompts import PromptSpec


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
    assert sorted(s.prompt for s, _, _ in handed) == sorted(f"p{i}" for i in range(10))
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


def test_ab_mode_sends_the_same_prompts_to_each_port_one_phase_after_the_other():
    now = [100.0]
    done = []
    plan = RunPlan(specs(3), RunOptions(ports=[8080, 8081], mode="ab", request_rate=1.0),
                   on_done=lambda: done.append(1), clock=lambda: now[0])
    first = [plan.next_request() for _ in range(3)]
    assert [port for _, _, port in first] == [8080] * 3 and first[0][1] == 100.0
    assert plan.next_request() is WAIT                  # phase 1 drains before phase 2 starts
    assert "phase 1/2: port 8080, 0/6 done" in plan.progress()
    now[0] = 130.0                                      # phase 1's last answer: phase 2 starts
    for _ in range(3):
        plan.record(RequestSample(start=0, success=True, target="8080"))
    second = [plan.next_request() for _ in range(3)]
    assert [s.prompt for s, _, _ in second] == [s.prompt for s, _, _ in first]
    assert [port for _, _, port in second] == [8081] * 3
    assert second[0][1] == 130.0 and second[1][1] - 130.0 == first[1][1] - 100.0  # same schedule
    assert plan.next_request() is None and not done
    for _ in range(3):
        plan.record(RequestSample(start=0, success=True, target="8081"))
    assert done == [1] and plan.phase_starts == [100.0, 130.0]


def test_ab_phase_waits_for_the_gate():
    opened = []
    plan = RunPlan(specs(1), RunOptions(ports=[1, 2], mode="ab"), on_phase_done=opened.append)
    plan.next_request()
    plan.record(RequestSample(start=0, success=True))
    assert opened == [1] and plan.next_request() is WAIT    # e.g. the master has not said go
    plan.start_phase(1)
    assert plan.next_request()[2] == 2


def test_parallel_mode_keeps_one_phase():
    plan = RunPlan(specs(2), RunOptions(ports=[8080, 8081], mode="parallel"))
    assert plan.phase_count == 1 and plan.next_request()[2] is None  # users keep their port
    with pytest.raises(ValueError, match="parallel"):
        RunOptions(ports=[1, 2], mode="ab", cycle=True)


def test_ports_are_named_by_their_listener():
    from local.dataplane import LISTENER_PORT_OFFSET
    from loadtest.targets import (CLUSTER_PORTS, LOCAL_PORT_OFFSET, default_ports,
                                  describe_ports, routing, unreachable)
    assert LOCAL_PORT_OFFSET == LISTENER_PORT_OFFSET       # the local stack's scheme
    http, llm = CLUSTER_PORTS
    assert routing(http) == f"{http}/http = least request"
    assert routing(str(llm)) == f"{llm}/llm-gw = picker"
    assert routing(llm + LOCAL_PORT_OFFSET) == f"{llm + LOCAL_PORT_OFFSET}/llm-gw = picker"
    assert routing(28081, (28080, 28081)) == "28081/llm-gw = picker"
    assert default_ports("http://127.0.0.1") == [http + 10000, llm + 10000]
    assert default_ports("gw.example") == [http, llm]
    assert routing(12345) == "12345" and describe_ports([]) == "the host's own port"
    with __import__("socket").socket() as s:      # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        silent = s.getsockname()[1]
    message = unreachable("http://127.0.0.1", [silent])
    assert f"http://127.0.0.1:{silent} (ConnectionRefusedError" in message and "`make up`" in message


def test_the_local_stack_serving_the_ports_gives_speedup_simulators_and_names(tmp_path):
    import json
    from loadtest.targets import clock_note, local_stack, routing_names
    for name, config in (("other", {"http_port": 28080, "llm_port": 28081, "speedup": 10}),
                         ("local", {"http_port": None, "llm_port": None, "speedup": 20,
                                    "groups": 2, "sim_base_port": 8101, "sim_ports": None})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.json").write_text(json.dumps({"config": config}))
    stack = local_stack("127.0.0.1", [18080, 18081], run_root=tmp_path)
    assert stack["speedup"] == 20 and stack["listeners"] == (18080, 18081)
    assert stack["sims"] == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert local_stack("127.0.0.1", [28081], run_root=tmp_path)["speedup"] == 10
    assert local_stack("10.1.2.3", [18080], run_root=tmp_path) is None   # not this machine
    assert local_stack("127.0.0.1", [9999], run_root=tmp_path) is None
    assert "model time = 20 x wall clock" in clock_note(20.0)
    assert routing_names("127.0.0.1", [18080])["18080"] == "18080/http = least request"


def test_the_api_key_comes_from_the_environment_else_from_the_local_stack(tmp_path, monkeypatch):
    import json
    from loadtest.targets import API_KEY_ENV, api_key
    run = tmp_path / "local"
    run.mkdir()
    (run / "state.json").write_text(json.dumps({"config": {"http_port": None, "llm_port": None}}))
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key("127.0.0.1", [18080], run_root=tmp_path) is None        # a stack without keys
    (run / "api-keys.json").write_text(json.dumps({"loadtest": "lt-key", "user": "u-key"}))
    assert api_key("127.0.0.1", [18080, 18081], run_root=tmp_path) == "lt-key"
    assert api_key("127.0.0.1", [9999], run_root=tmp_path) is None         # not that stack's ports
    assert api_key("gw.example", [8080], run_root=tmp_path) is None
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    assert api_key("127.0.0.1", [18080], run_root=tmp_path) == "env-key"   # the user's own key wins
