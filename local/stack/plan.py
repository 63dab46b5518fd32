"""The processes a configuration runs, as commands, logs and health checks: one function per kind
of process (the simulated groups, the picker, Envoy Gateway), listed by `plan`. It computes and
writes nothing; the launcher writes the files named here (`objects_file`, the data plane's
layout) and starts the plan.

A new kind of process, or a new option of one, is a change here: its function, and its entry in
`plan`."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from local import dataplane, ratelimit, vllm_server
from local.sim.clock import to_model_seconds, to_wall_seconds
from local.sim.engines import DEFAULT_ENGINE_MODEL, EngineModel, get_engine_model
from local.stack.config import StackConfig, StackError
from local.stack.processes import Proc
from local.stack.topology import Topology, listener_ports, picker_tls

OBJECTS_FILE = "objects.yaml"  # the picker's InferenceObjectives and InferenceModelRewrite
# Below this the picker and the simulators would spend a large part of the 2 cores on /metrics
# alone, which distorts latencies: a simulator needs ~1.5 ms of CPU to render one page, so 3
# endpoints every 20 ms (the demo at speedup 5) already cost ~0.2 cores in the simulators.
MIN_WALL_SCRAPE_INTERVAL = 0.02


@dataclass(frozen=True)
class PickerTiming:
    scrape_interval: float  # wall seconds, what the picker is started with
    staleness: float        # wall seconds
    model_scrape_interval: float  # what that is in model seconds (x speedup)
    model_staleness: float


def picker_timing(config: StackConfig) -> PickerTiming | None:
    """The picker's scrape interval and staleness in wall time for this speedup.

    The simulators run `speedup` times faster than real time, but the picker's timers run in wall
    time: left at its defaults (0.1 s, 1 s) at speedup 20 it would scrape every 2 s of model time,
    20 x less often than in production, and route on older numbers than it ever would. So the
    launcher divides both by the speedup (staleness keeps its ratio to the interval), with a floor
    on the interval (MIN_WALL_SCRAPE_INTERVAL). None when picker_args set either one explicitly
    (the end-to-end tests do): then the caller's wall-time values apply unchanged.
    """
    if any(a.split("=")[0] in ("--scrape-interval", "--staleness") for a in config.picker_args):
        return None
    from picker.config import parser as picker_parser

    defaults = picker_parser()
    model_interval = config.picker_scrape_interval or defaults.get_default("scrape_interval")
    model_staleness = config.picker_staleness or defaults.get_default("staleness")
    wall_interval = max(MIN_WALL_SCRAPE_INTERVAL, to_wall_seconds(model_interval, config.speedup))
    wall_staleness = model_staleness * wall_interval / model_interval
    return PickerTiming(wall_interval, wall_staleness, to_model_seconds(wall_interval, config.speedup),
                        to_model_seconds(wall_staleness, config.speedup))


def picker_timing_args(config: StackConfig) -> list[str]:
    timing = picker_timing(config)
    if timing is None:
        return []
    return ["--scrape-interval", f"{timing.scrape_interval:.6g}", "--staleness", f"{timing.staleness:.6g}"]


def sim_engine_model(config: StackConfig) -> EngineModel:
    """The engine model the simulators of `config` run (their --engine-model, else the simulator's
    default) with the KV capacity / config.kv_scale: what the lab runs to compare with them."""
    args = config.sim_args
    model = get_engine_model(args[args.index("--engine-model") + 1] if "--engine-model" in args
                             else DEFAULT_ENGINE_MODEL)
    if config.kv_scale <= 1:
        return model
    return model.with_overrides(num_gpu_blocks=model.num_gpu_blocks // config.kv_scale)


def kv_scale_args(config: StackConfig) -> list[str]:
    """The simulators' --num-gpu-blocks for config.kv_scale (none if they are given one)."""
    if config.kv_scale <= 1 or "--num-gpu-blocks" in config.sim_args:
        return []
    return ["--num-gpu-blocks", str(sim_engine_model(config).num_gpu_blocks)]


def tokenizer_dir(config: StackConfig) -> Path:
    """The tokenizer directory the simulators and the picker read."""
    from local.tinymodel import DEFAULT_DIR
    return Path(config.tokenizer) if config.tokenizer else DEFAULT_DIR


def kv_event_ports_of(config: StackConfig, index: int) -> tuple[int, int]:
    """(publisher, replay) ports of simulated group `index`."""
    first = config.kv_events_base_port + 2 * index
    return first, first + 1


def kv_events_args(config: StackConfig, index: int, port: int) -> list[str]:
    """A simulator's --kv-events-config: vLLM's JSON, the sockets on the stack's host, the topic
    naming the simulator as vLLM's names the pod in the cluster."""
    if not config.precise_prefix:
        return []
    pub, replay = kv_event_ports_of(config, index)
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
           "endpoint": f"tcp://{config.host}:{pub}", "replay_endpoint": f"tcp://{config.host}:{replay}",
           "topic": f"kv@sim-{port}"}
    return ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]


def kv_event_ports(config: StackConfig, topo: Topology) -> list[int]:
    """The ports the simulators' KV-event sockets bind (none without precise routing)."""
    if not config.precise_prefix:
        return []
    return [p for i in range(len(topo.sims)) for p in kv_event_ports_of(config, i)]


def sim_procs(config: StackConfig, topo: Topology) -> list[Proc]:
    """One simulator per simulated group, seeds counting up from the config's; all tokenize with
    the model's tokenizer and, with precise routing, publish their KV-cache events."""
    procs = []
    for i, sim in enumerate(topo.sims):
        cmd = [sys.executable, "-m", "local.sim", "--host", config.host, "--port", str(sim.port)]
        for n in sim.served_model_names:
            cmd += ["--served-model-name", n]
        cmd += ["--speedup", str(config.speedup), "--seed", str(config.seed + i), *kv_scale_args(config),
                "--tokenizer", str(tokenizer_dir(config)), *kv_events_args(config, i, sim.port),
                *config.sim_args]
        procs.append(Proc(f"sim-{sim.port}", cmd, str(config.run_dir / f"sim-{sim.port}.log"),
                          f"http:http://{sim.address}/health"))
    return procs


def vllm_server_of(config: StackConfig, index: int, sim) -> vllm_server.VllmServer:
    """The real vLLM server of group `index`: the cluster's flags where they apply on a CPU
    (local/vllm_server), its KV events on the ports a simulator of that group would use."""
    pub, replay = kv_event_ports_of(config, index) if config.precise_prefix else (None, None)
    return vllm_server.VllmServer(port=sim.port, served_model_names=tuple(sim.served_model_names),
                                  host=config.host, kv_events_port=pub, kv_replay_port=replay,
                                  kv_topic=f"kv@vllm-{sim.port}")


def vllm_procs(config: StackConfig, topo: Topology) -> list[Proc]:
    """One real vLLM server per group (the simulators' ports and served names)."""
    if not vllm_server.available():
        raise StackError("real vLLM is not installed: run `make vllm` first")
    procs = []
    for i, sim in enumerate(topo.sims):
        server = vllm_server_of(config, i, sim)
        procs.append(Proc(f"vllm-{sim.port}", server.launch_command() + list(config.sim_args),
                          str(config.run_dir / f"vllm-{sim.port}.log"), f"http:http://{sim.address}/health"))
    return procs


def engine_procs(config: StackConfig, topo: Topology) -> list[Proc]:
    return vllm_procs(config, topo) if config.engine == "vllm" else sim_procs(config, topo)


def objects_file(config: StackConfig) -> Path:
    return config.run_dir / OBJECTS_FILE


def picker_proc(config: StackConfig, topo: Topology, i: int = 0,
                election: tuple[Path, str] | None = None) -> Proc:
    """Picker replica i over every simulated group, with the rendered objects and body mode. With
    `election` (the kubeconfig and the Lease's namespace, control_plane.bootstrap): active-passive
    as base/picker runs it, linked to the other replicas; its health check is then `warm` (a
    standby never answers SERVING to the ext_proc service, only the acting leader does)."""
    c = config
    grpc, health, metrics, peer, outcomes = c.picker_ports(i)
    cmd = [sys.executable, "-m", "picker", "--grpc-port", str(grpc),
           "--health-port", str(health), "--metrics-port", str(metrics),
           "--outcomes-port", str(outcomes),
           "--secure-serving" if picker_tls(topo) else "--no-secure-serving",
           "--discovery", "static", "--endpoints", ",".join(s.address for s in topo.sims),
           "--objects", str(objects_file(c)), "--profile", c.profile,
           "--request-body-mode", topo.body_mode, "--bind", c.host, "--tokenizer", str(tokenizer_dir(c)),
           "--precise-prefix" if c.precise_prefix else "--no-precise-prefix", *picker_timing_args(c),
           # the certificate the gateway verifies (components/picker-tls), else a self-signed one
           *(["--cert-path", str(c.certs_dir / "picker")] if c.tls else [])]
    env, check = {}, f"grpc:{c.host}:{health}"
    if election is not None:
        kubeconfig, namespace = election
        peers = ",".join(f"{c.host}:{c.picker_ports(j)[3]}" for j in range(c.pickers))
        cmd += ["--leader-election", "--leader-election-namespace", namespace,
                "--peers", peers, "--peer-port", str(peer)]
        env = {"KUBECONFIG": str(kubeconfig), "POD_NAME": c.picker_name(i)}
        check += "#warm"
    cmd += c.picker_args
    return Proc(c.picker_name(i), cmd, str(c.run_dir / f"{c.picker_name(i)}.log"), check, env=env)


def picker_procs(config: StackConfig, topo: Topology,
                 election: tuple[Path, str] | None = None) -> list[Proc]:
    return [picker_proc(config, topo, i, election) for i in range(config.pickers)]


def envoy_gateway_proc(config: StackConfig, topo: Topology) -> Proc:
    """Envoy Gateway (standalone) on the run's data-plane layout; it starts Envoy. Healthy = both
    listeners route: /v1/models on `http` reaches a simulator through Envoy, on `llm-gw` it also
    crosses the picker."""
    layout = dataplane.Layout(config.run_dir)
    if config.tls:
        health = " ".join(f"https:https://localhost:{port}/v1/models#{config.certs_dir / 'ca.crt'}"
                          for port in listener_ports(topo, config).values())
    else:
        health = " ".join(f"http:http://{config.host}:{port}/v1/models"
                          for port in listener_ports(topo, config).values())
    return Proc("envoy-gateway", [str(dataplane.envoy_gateway_binary()), "server", "--config-path",
                                  str(layout.config)], str(config.run_dir / "envoy-gateway.log"), health)


def ratelimit_procs(config: StackConfig) -> list[Proc]:
    """Redis and the Envoy rate limit service, as Envoy Gateway runs them in a cluster
    (local/ratelimit.py); the service takes its configuration from Envoy Gateway over xDS."""
    ports, certs = config.ratelimit_ports, dataplane.Layout(config.run_dir).config_home / "certs"
    return [Proc("redis", ratelimit.redis_command(ports), str(config.run_dir / "redis.log"), ""),
            Proc("ratelimit", ratelimit.service_command(), str(config.run_dir / "ratelimit.log"),
                 f"http:http://127.0.0.1:{ports.http}/healthcheck", env=ratelimit.service_env(certs, ports))]


def plan(config: StackConfig, topo: Topology, election: tuple[Path, str] | None = None) -> list[Proc]:
    """Every process of the stack, in start order (all start at once: the picker retries scrapes
    until the simulators answer; the rate limit service retries Envoy Gateway's xDS, and Envoy
    refuses requests until it answers, so the listeners' health check waits for it). The picker
    replicas' API server, when there is one, runs before (control_plane.py)."""
    return [*engine_procs(config, topo), *picker_procs(config, topo, election),
            *(ratelimit_procs(config) if config.token_budget else []), envoy_gateway_proc(config, topo)]
