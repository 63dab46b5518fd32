"""Unit tests of the launcher: topology from the rendered manifests, cleanup, `down`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from loadtest.workloads import DEMO_SCALE
from local.stack import Stack, StackConfig, StackError
from local.stack.api_keys import api_keys_secret, new_api_keys, read_api_keys
from local.stack.cli import config_from, main, parser
from local.stack.config import API_CLIENTS, REPO
from local.stack.demo import DEMO_SPEEDUP, demo_command
from local.stack.launcher import down
from local.stack.plan import MIN_WALL_SCRAPE_INTERVAL, kv_scale_args, picker_timing, picker_timing_args
from local.stack.processes import Proc, RunState, alive, group_members, is_ours, spawn
from local.stack.topology import topology


def test_plain_topology_follows_the_a10_overlay():
    topo = topology(StackConfig(groups=2, sim_ports=[1001, 1002]))
    addresses = ["127.0.0.1:1001", "127.0.0.1:1002"]
    assert [s.address for s in topo.sims] == addresses
    assert topo.http_route == [("qwq-dist-v1", 100, addresses)]
    assert topo.llm_route == [("qwq-leaders", 1, addresses)]
    assert {o["kind"] for o in topo.objects} == {"InferenceObjective", "InferenceModelRewrite"}
    assert topo.body_mode == "full-duplex"  # base/gateway's EnvoyExtensionPolicy
    assert {o["kind"] for o in topo.gateway} >= {"Gateway", "HTTPRoute", "EnvoyExtensionPolicy", "Backend"}


def test_buffered_body_mode_renders_the_component():
    topo = topology(StackConfig(groups=1, sim_ports=[1], body_mode="buffered"))
    assert topo.body_mode == "buffered"
    policy = next(o for o in topo.gateway if o["kind"] == "EnvoyExtensionPolicy")
    assert policy["spec"]["extProc"][0]["processingMode"]["request"]["body"] == "Buffered"


def test_edge_security_is_rendered_in_the_overlays_namespace_and_can_be_left_out():
    secure = topology(StackConfig(groups=1, sim_ports=[1]))
    kinds = {o["kind"]: o for o in secure.gateway}
    assert {"SecurityPolicy", "EnvoyProxy"} <= set(kinds)
    assert {o["metadata"].get("namespace") for o in secure.gateway if o["kind"] != "GatewayClass"} == {"llm"}
    assert kinds["Gateway"]["spec"]["infrastructure"]["parametersRef"]["name"] == kinds["EnvoyProxy"]["metadata"]["name"]
    assert all(listener["protocol"] == "HTTP" for listener in kinds["Gateway"]["spec"]["listeners"])  # no TLS locally
    open_ = topology(StackConfig(groups=1, sim_ports=[1], edge_security=False))
    assert "SecurityPolicy" not in {o["kind"] for o in open_.gateway}
    # the open gateway's Envoy keeps the access log to the picker, without the edge's filter order
    proxy = next(o for o in open_.gateway if o["kind"] == "EnvoyProxy")
    assert "filterOrder" not in proxy["spec"] and "accessLog" in proxy["spec"]["telemetry"]


def test_api_keys_are_fresh_private_and_fill_the_secret_the_policy_names(tmp_path):
    import base64
    keys = new_api_keys(tmp_path / "keys.json")
    again = new_api_keys(tmp_path / "keys.json")
    assert set(keys) == set(API_CLIENTS) and keys != again and len(set(keys.values())) == len(keys)
    assert (tmp_path / "keys.json").stat().st_mode & 0o777 == 0o600
    assert read_api_keys(tmp_path / "keys.json") == again
    secret = api_keys_secret(topology(StackConfig(groups=1, sim_ports=[1])).gateway, again)
    assert secret["metadata"] == {"name": "inference-gateway-api-keys", "namespace": "llm"}
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == again
    with pytest.raises(StackError, match="no SecurityPolicy with apiKeyAuth"):
        api_keys_secret(topology(StackConfig(groups=1, sim_ports=[1], edge_security=False)).gateway, again)


def test_canary_topology_follows_the_overlay():
    topo = topology(StackConfig(groups=3, canary=True, sim_ports=[1, 2, 3, 4]))
    canary = [s for s in topo.sims if s.lws != "qwq-dist-v1"]
    assert len(topo.sims) == 4 and len(canary) == 1
    assert canary[0].served_model_names == ["qwq-canary", "qwq"]
    weights = {name: (w, len(eps)) for name, w, eps in topo.http_route}
    assert weights == {"qwq-dist-v1": (90, 3), "qwq-dist-v2": (10, 1)}
    rewrite = next(o for o in topo.objects if o["kind"] == "InferenceModelRewrite")
    targets = {t["modelRewrite"]: t["weight"] for t in rewrite["spec"]["rules"][0]["targets"]}
    assert targets == {"qwq": 90, "qwq-canary": 10}


def test_too_few_simulator_ports_are_refused():
    with pytest.raises(StackError):
        topology(StackConfig(groups=3, sim_ports=[1, 2]))


def test_a_busy_port_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(Stack, "check_no_other_data_plane", lambda self: None)  # tested below
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        stack = Stack(StackConfig(name="busy", run_root=tmp_path, groups=1, sim_ports=[busy]))
        with pytest.raises(StackError, match=str(busy)):
            stack.start()
    assert stack.procs == []


@pytest.mark.server
def test_a_process_that_dies_while_starting_stops_the_others(tmp_path, monkeypatch):
    """The simulators here get a bogus option and exit; everything started must be gone."""
    monkeypatch.setattr(Stack, "check_no_other_data_plane", lambda self: None)  # tested below
    # Free ports are picked by binding port 0 and letting go, so a test running beside this one
    # can take one before the stack binds it; the check that refuses then is tested above.
    for _attempt in range(5):
        ports = []
        for _ in range(9):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        config = StackConfig(name="broken", run_root=tmp_path, groups=2, sim_ports=ports[:2], http_port=ports[2],
                             llm_port=ports[3], picker_grpc_port=ports[5],
                             picker_health_port=ports[6], picker_metrics_port=ports[7],
                             picker_outcomes_port=ports[8], kv_events_base_port=ports[4],
                             sim_args=["--no-such-option"], startup_timeout=30,
                             precise_prefix=False)  # no KV-event ports derived from the picked ones
        stack = Stack(config)
        with pytest.raises(StackError) as failure:
            stack.start()
        if "ports already in use" not in str(failure.value):
            break
    assert "exited" in str(failure.value)
    assert stack.procs and all(not alive(p.pid) for p in stack.procs)
    assert not stack.state_file.exists()


@pytest.mark.server
def test_down_stops_the_recorded_process_group(tmp_path):
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    child = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.monotonic() + 10
    while not is_ours(child.pid, cmd):  # until the fork has exec'd the command
        assert time.monotonic() < deadline
        time.sleep(0.01)
    run = tmp_path / "x"
    run.mkdir()
    (run / "state.json").write_text(json.dumps({"name": "x", "procs": [
        {"name": "sleeper", "cmd": cmd, "log": "", "health": "http:", "pid": child.pid}]}))
    assert down("x", run_root=tmp_path) == 0
    assert child.wait(timeout=10) is not None
    assert not (run / "state.json").exists()
    assert down("x", run_root=tmp_path) == 0  # nothing left: still fine


def test_picker_scrapes_at_the_production_interval_in_model_time():
    timing = picker_timing(StackConfig(speedup=5))
    assert timing.scrape_interval == pytest.approx(0.02) and timing.staleness == pytest.approx(0.2)
    assert timing.model_scrape_interval == pytest.approx(0.1) and timing.model_staleness == pytest.approx(1.0)
    args = picker_timing_args(StackConfig(speedup=5, picker_scrape_interval=0.5, picker_staleness=2.0))
    assert args == ["--scrape-interval", "0.1", "--staleness", "0.4"]


def test_picker_scrape_interval_has_a_wall_time_floor_and_keeps_the_staleness_ratio():
    timing = picker_timing(StackConfig(speedup=100))
    assert timing.scrape_interval == MIN_WALL_SCRAPE_INTERVAL
    assert timing.staleness / timing.scrape_interval == pytest.approx(10.0)
    assert timing.model_scrape_interval == pytest.approx(MIN_WALL_SCRAPE_INTERVAL * 100)


def test_explicit_picker_timing_args_are_left_alone():
    config = StackConfig(speedup=100, picker_args=["--scrape-interval", "0.2"])
    assert picker_timing(config) is None and picker_timing_args(config) == []


def test_kv_scale_divides_the_simulator_capacity():
    from local.sim.engines import get_engine_model

    from local.sim.engines import DEFAULT_ENGINE_MODEL

    full = get_engine_model(DEFAULT_ENGINE_MODEL).num_gpu_blocks
    assert kv_scale_args(StackConfig(kv_scale=DEMO_SCALE)) == ["--num-gpu-blocks", str(full // DEMO_SCALE)]
    assert kv_scale_args(StackConfig()) == []
    assert kv_scale_args(StackConfig(kv_scale=6, sim_args=["--num-gpu-blocks", "99"])) == []
    tiny = StackConfig(kv_scale=2, sim_args=["--engine-model", "tiny"])
    assert kv_scale_args(tiny) == ["--num-gpu-blocks", str(get_engine_model("tiny").num_gpu_blocks // 2)]


def test_demo_defaults_scale_the_article_workload():
    from loadtest.workloads import WORKLOADS

    args = parser().parse_args(["demo"])
    assert args.speedup == DEMO_SPEEDUP and args.kv_scale == DEMO_SCALE
    assert parser().parse_args(["up"]).kv_scale == 1
    article, demo = WORKLOADS["article"], WORKLOADS["demo"]
    for key in ("prefix_len", "input_len", "output_len"):
        assert demo[key] == article[key] // DEMO_SCALE
    assert demo["concurrency"] == article["concurrency"] and demo["range_ratio"] == article["range_ratio"]
    make = subprocess.run(["make", "--no-print-directory", "-s", "--eval", "print-kv: ; @echo $(KV_SCALE)",
                           "print-kv", "WORKLOAD=demo"], cwd=REPO, capture_output=True, text=True, check=True)
    assert make.stdout.split()[-1] == str(DEMO_SCALE)  # `make up` for `make compare` of the demo workload


def test_demo_order_sets_which_listener_loadtest_compare_loads_first(tmp_path, capsys):
    listeners = {"http": 18080, "llm-gw": 18081}

    def ports(argv):
        args, rest = parser().parse_known_args(["demo", *argv])
        cmd = demo_command(config_from(args), listeners, ["127.0.0.1:8101"], tmp_path, args.workload,
                              rest, args.warm, args.order)
        after = cmd[cmd.index("--ports") + 1:]
        return after[:after.index("--workload")], cmd

    assert ports([])[0] == ["18080", "18081"]
    assert ports(["--order", "http-first"])[0] == ["18080", "18081"]
    picker_first, cmd = ports(["--order", "picker-first", "--warm", "--num-prompts", "12"])
    assert picker_first == ["18081", "18080"]
    assert cmd.count("--ports") == 1 and cmd[-2:] == ["--num-prompts", "12"] and "--before-each-run" not in cmd
    with pytest.raises(SystemExit):
        parser().parse_args(["demo", "--order", "llm-first"])
    with pytest.raises(SystemExit):   # refused before any stack starts
        main(["demo", "--run-root", str(tmp_path), "--ports", "18081", "18080"])
    assert "--order" in capsys.readouterr().err


def test_a_second_data_plane_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """Envoy Gateway binds fixed ports: with one of them taken, nothing starts and the error says why.
    The test holds a free port and has the launcher probe that one in their place: binding the real
    ones would break a stack another test starts meanwhile (`make test` runs lanes side by side)."""
    import functools

    from local import dataplane

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        monkeypatch.setattr(dataplane, "busy_ports", functools.partial(dataplane.busy_ports, ports=(s.getsockname()[1],)))
        stack = Stack(StackConfig(name="second", run_root=tmp_path, groups=1, sim_ports=[1]))
        with pytest.raises(StackError, match="Only one local stack can run at a time"):
            stack.start()
    assert stack.procs == [] and not (tmp_path / "second").exists()


# What real vLLM does to the launcher: started through `env ...` (so its command line is not the one
# recorded), and an API server that forks an engine core into its process group.
ENGINE_LIKE = ("import os, socket, sys, time\n"
               "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
               "if os.fork() == 0:\n"
               "    time.sleep(120)\n"
               "time.sleep(120)\n")


@pytest.fixture
def engines():
    """Whatever engine-like group a test started is gone after it, whatever `down` did."""
    started: list[Proc] = []
    yield started
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.popen.wait(timeout=10)


def engine_like(tmp_path, port: int, started: list[Proc]) -> Proc:
    proc = spawn(Proc("vllm-x", ["env", "-u", "PYTHONPATH", sys.executable, "-c", ENGINE_LIKE, str(port)],
                      str(tmp_path / "engine.log"), "http:"))
    started.append(proc)
    deadline = time.monotonic() + 20
    while len(group_members(proc.pid)) < 2:  # the leader and its forked child
        assert time.monotonic() < deadline, (tmp_path / "engine.log").read_text()
        time.sleep(0.02)
    return proc


def record(tmp_path, name: str, procs: list[Proc]) -> None:
    (tmp_path / name).mkdir(exist_ok=True)
    RunState(name, None, procs).write(tmp_path / name)


@pytest.mark.server
def test_down_stops_a_process_that_runs_another_command_line_and_its_children(tmp_path, engines):
    proc = engine_like(tmp_path, free_port(), engines)
    assert not is_ours(proc.pid, proc.cmd)  # `env` exec'd python: the old check lost it
    record(tmp_path, "x", [proc])
    assert down("x", run_root=tmp_path) == 0
    assert group_members(proc.pid) == [] and not (tmp_path / "x" / "state.json").exists()


@pytest.mark.server
def test_down_stops_what_outlived_a_killed_leader(tmp_path, engines):
    proc = engine_like(tmp_path, free_port(), engines)
    os.kill(proc.pid, signal.SIGKILL)
    proc.popen.wait(timeout=10)
    assert group_members(proc.pid, proc.started)  # the forked child holds on
    record(tmp_path, "x", [proc])
    assert down("x", run_root=tmp_path) == 0
    assert group_members(proc.pid) == []


@pytest.mark.server
def test_ports_held_by_a_leftover_say_how_to_free_them(tmp_path, monkeypatch, engines):
    monkeypatch.setattr(Stack, "check_no_other_data_plane", lambda self: None)
    port = free_port()
    proc = engine_like(tmp_path, port, engines)  # as if its stack's record were lost
    stack = Stack(free_port_config("again", tmp_path, sim_port=port))
    with pytest.raises(StackError) as refused:
        stack.start()
    message = str(refused.value)
    assert f"{port}: pid " in message and "started by a local stack of this checkout" in message
    kill = message.split("free the ports with: kill -TERM -- ", 1)[1].split()
    assert f"-{proc.pid}" in kill, message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_config(name: str, run_root, sim_port: int, **overrides) -> StackConfig:
    """A one-group stack on free ports only: none of the defaults (18080, 9002, the KV events'
    18101...), which a stack another test runs meanwhile may hold (`make test` runs lanes side by side)."""
    from local.stack.processes import free_ports

    http, llm, grpc, health, metrics, outcomes, kv = free_ports(7)
    return StackConfig(name=name, run_root=run_root, groups=1, sim_ports=[sim_port], http_port=http, llm_port=llm,
                       picker_grpc_port=grpc, picker_health_port=health, picker_metrics_port=metrics,
                       picker_outcomes_port=outcomes, kv_events_base_port=kv, **overrides)


def test_run_state_round_trips_through_its_file(tmp_path):
    from local.stack.processes import Proc, RunState

    config = StackConfig(name="x", run_root=tmp_path, speedup=5, sim_ports=[1, 2])
    procs = [Proc("sim-1", ["python", "-m", "local.sim"], "sim-1.log", "http:http://127.0.0.1:1/health", 42)]
    (tmp_path / "x").mkdir()
    assert RunState.read(config.run_dir) is None
    RunState("x", config, procs, {"sim-1": 1.5}).write(config.run_dir)
    raw = json.loads(RunState.file(config.run_dir).read_text())
    assert raw["config"]["speedup"] == 5 and raw["config"]["run_root"] == str(tmp_path)  # what loadtest reads
    back = RunState.read(config.run_dir)
    assert back.config == config and back.procs == procs and back.retired_cpu_s == {"sim-1": 1.5}
    RunState.remove(config.run_dir)
    assert RunState.read(config.run_dir) is None


def test_the_plan_lists_every_process_and_writes_nothing(tmp_path):
    from local.stack.plan import plan

    config = StackConfig(name="planned", run_root=tmp_path, groups=2, sim_ports=[1001, 1002], kv_scale=DEMO_SCALE)
    procs = plan(config, topology(config))
    assert [p.name for p in procs] == ["sim-1001", "sim-1002", "picker", "envoy-gateway"]
    assert all(p.pid is None and p.log.startswith(str(config.run_dir)) for p in procs)
    assert procs[0].cmd[procs[0].cmd.index("--num-gpu-blocks") + 1] == kv_scale_args(config)[1]
    picker = procs[2].cmd
    assert picker[picker.index("--endpoints") + 1] == "127.0.0.1:1001,127.0.0.1:1002"
    assert "--secure-serving" in picker  # base/gateway's Backend for the picker has TLS
    # the outcome port the gateway's access log sends to (localized to config.picker_outcomes_port)
    assert picker[picker.index("--outcomes-port") + 1] == str(config.picker_outcomes_port) == "9004"
    assert config_from(parser().parse_args(["up", "--picker-outcomes-port", "19004"])).picker_outcomes_port == 19004
    assert procs[3].health.split() == ["http:http://127.0.0.1:18080/v1/models", "http:http://127.0.0.1:18081/v1/models"]
    assert not config.run_dir.exists()


def test_precise_routing_is_on_by_default_and_can_be_turned_off(tmp_path):
    """The simulators tokenize with the model's tokenizer and publish KV-cache events on
    loopback; the picker reads the same tokenizer and routes on them. Off: no events, the picker
    on its approximate index, both still on the tokenizer."""
    from local.sim.kv_events import KVEventsConfig
    from local.stack.plan import kv_event_ports, plan, tokenizer_dir
    from local.tinymodel import DEFAULT_DIR

    config = StackConfig(name="precise", run_root=tmp_path, groups=2, sim_ports=[1001, 1002])
    topo = topology(config)
    sim, _, picker = plan(config, topo)[:3]
    assert config.precise_prefix and tokenizer_dir(config) == DEFAULT_DIR
    events = KVEventsConfig.from_json(sim.cmd[sim.cmd.index("--kv-events-config") + 1])
    assert events.publishes and events.endpoint == "tcp://127.0.0.1:18101"
    assert events.replay_endpoint == "tcp://127.0.0.1:18102" and events.topic == "kv@sim-1001"
    assert sim.cmd[sim.cmd.index("--tokenizer") + 1] == str(DEFAULT_DIR)
    assert picker.cmd[picker.cmd.index("--tokenizer") + 1] == str(DEFAULT_DIR)
    assert "--precise-prefix" in picker.cmd
    assert kv_event_ports(config, topo) == [18101, 18102, 18103, 18104]

    off = config_from(parser().parse_args(["up", "--no-precise-prefix", "--tokenizer", str(tmp_path)]))
    assert not off.precise_prefix
    procs = {p.name: p for p in plan(off, topology(off))}
    sim, picker = procs["sim-8101"], procs["picker"]
    assert "--kv-events-config" not in sim.cmd and "--no-precise-prefix" in picker.cmd
    assert sim.cmd[sim.cmd.index("--tokenizer") + 1] == str(tmp_path)
    assert kv_event_ports(off, topology(off)) == []


@pytest.mark.server
def test_reset_restarts_the_cold_start_processes_and_keeps_their_cpu(tmp_path):
    """`reset` from another shell: the simulator (here a plain HTTP server) is stopped and started
    again with the same command; Envoy Gateway's entry (here a sleeper) is left alone."""
    from local.stack.launcher import reset
    from local.stack.processes import Proc, RunState, free_ports, spawn, stop_groups

    (port,) = free_ports(1)
    run = tmp_path / "x"
    run.mkdir()
    server = Proc("sim-1", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                  str(run / "sim.log"), f"http:http://127.0.0.1:{port}/")
    other = Proc("envoy-gateway", [sys.executable, "-c", "import time; time.sleep(60)"], str(run / "eg.log"), "http:")
    spawn(server), spawn(other)
    try:
        RunState("x", None, [server, other]).write(run)
        assert reset("x", run_root=tmp_path, timeout=30) == 0
        after = RunState.read(run)
        assert after.procs[0].pid != server.pid and after.procs[0].healthy() and after.procs[1].pid == other.pid
        assert server.popen.wait(timeout=10) is not None  # the old one was stopped
        assert set(after.retired_cpu_s) == {"sim-1"}
    finally:
        stop_groups([p.pid for p in RunState.read(run).procs] + [server.pid, other.pid])


def test_two_pickers_run_active_passive_linked_and_all_behind_the_gateway(tmp_path):
    """--pickers 2: base/picker's shape. Each replica competes for the Lease on the stack's API
    server (its kubeconfig and identity in its environment), links to the other, and is checked
    for warmth (only the acting leader answers SERVING to the ext_proc service); the gateway's
    picker Backend lists both."""
    from local import dataplane
    from local.stack.control_plane import picker_rbac
    from local.stack.plan import plan

    config = config_from(parser().parse_args(["up", "--pickers", "2", "--name", "ha", "--run-root",
                                              str(tmp_path), "--groups", "1"]))
    assert config.pickers == 2 and config.leader_election
    assert config.picker_ports(0) == (9002, 9003, 9090, 9005, 9004)
    assert config.picker_ports(1) == (9012, 9013, 9100, 9015, 9014)
    topo = topology(config)
    procs = {p.name: p for p in plan(config, topo, (tmp_path / "kubeconfig", "llm"))}
    assert [n for n in procs if n.startswith("picker")] == ["picker", "picker-1"]
    for name, peer in (("picker", "9005"), ("picker-1", "9015")):
        p = procs[name]
        assert "--leader-election" in p.cmd and p.cmd[p.cmd.index("--peer-port") + 1] == peer
        assert p.cmd[p.cmd.index("--peers") + 1] == "127.0.0.1:9005,127.0.0.1:9015"
        assert p.cmd[p.cmd.index("--leader-election-namespace") + 1] == "llm"
        assert p.env == {"KUBECONFIG": str(tmp_path / "kubeconfig"), "POD_NAME": name}
        assert p.health.endswith("#warm")
    assert procs["picker-1"].cmd[procs["picker-1"].cmd.index("--grpc-port") + 1] == "9012"
    backend = next(d for d in dataplane.localize(topo.gateway, {n: [("127.0.0.1", 1)] for n in topo.services},
                                                 [("127.0.0.1", 9002), ("127.0.0.1", 9012)],
                                                 outcomes=[("127.0.0.1", 9004), ("127.0.0.1", 9014)])
                   if d["kind"] == "Backend" and d["metadata"]["name"] == "inference-gateway-ext-proc")
    assert backend["spec"]["endpoints"] == [{"ip": {"address": "127.0.0.1", "port": 9002}},
                                            {"ip": {"address": "127.0.0.1", "port": 9012}}]
    # the RBAC the replicas get on the stack's API server is the render's, namespaced as deployed
    rbac = picker_rbac(topo.docs)
    assert [o["kind"] for o in rbac] == ["ServiceAccount", "Role", "RoleBinding"]
    assert {o["metadata"]["namespace"] for o in rbac} == {"llm"}
    one = config_from(parser().parse_args(["up"]))
    assert one.pickers == 1 and not one.leader_election
    assert "--leader-election" not in {p.name: p for p in plan(one, topology(one))}["picker"].cmd
