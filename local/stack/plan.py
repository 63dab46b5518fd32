"""The processes a configuration runs, as commands, logs and health checks: one function per kind
of process (the simulated groups, the picker, Envoy Gateway), listed by `plan`. It computes and
writes nothing; the launcher writes the files named here (`objects_file`, the data plane's
layout) and starts the plan.

A new kind of process, or a new option of one, is a change here: its function, and its entry in
`plan`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from local import dataplane, vllm_server
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


def sim_procs(config: StackConfig, topo: Topology) -> list[Proc]:
    """One simulator per simulated group, seeds counting up from the config's."""
    procs = []
    for i, sim in enumerate(topo.sims):
        cmd = [sys.executable, "-m", "local.sim", "--host", config.host, "--port", str(sim.port)]
        for n in sim.served_model_names:
            cmd += ["--served-model-name", n]
        cmd += ["--speedup", str(config.speedup), "--seed", str(config.seed + i), *kv_scale_args(config),
                *config.sim_args]
        procs.append(Proc(f"sim-{sim.port}", cmd, str(config.run_dir / f"sim-{sim.port}.log"),
                          f"http:http://{sim.address}/health"))
    return procs


# Real vLLM's KV-event ports: the group's port + these (8101 -> 18101 publisher, 28101 replay).
# The picker finds them through each server's /kv_event_sources.
VLLM_KV_EVENTS_OFFSET, VLLM_KV_REPLAY_OFFSET = 10000, 20000


def vllm_server_of(config: StackConfig, sim) -> vllm_server.VllmServer:
    """The real vLLM server of one group: the cluster's flags where they apply on a CPU
    (local/vllm_server), KV events on ports derived from the group's."""
    if sim.port + VLLM_KV_REPLAY_OFFSET > 65535:
        raise StackError(f"group port {sim.port}: real vLLM groups need ports below "
                         f"{65536 - VLLM_KV_REPLAY_OFFSET} (their KV-event ports are "
                         f"+{VLLM_KV_EVENTS_OFFSET} and +{VLLM_KV_REPLAY_OFFSET})")
    return vllm_server.VllmServer(port=sim.port, served_model_names=tuple(sim.served_model_names),
                                  host=config.host, kv_events_port=sim.port + VLLM_KV_EVENTS_OFFSET,
                                  kv_replay_port=sim.port + VLLM_KV_REPLAY_OFFSET)


def vllm_procs(config: StackConfig, topo: Topology) -> list[Proc]:
    """One real vLLM server per group (the simulators' ports and served names)."""
    if not vllm_server.available():
        raise StackError("real vLLM is not installed: run `make vllm` first")
    procs = []
    for sim in topo.sims:
        server = vllm_server_of(config, sim)
        procs.append(Proc(f"vllm-{sim.port}", server.launch_command() + list(config.sim_args),
                          str(config.run_dir / f"vllm-{sim.port}.log"), f"http:http://{sim.address}/health"))
    return procs


def engine_procs(config: StackConfig, topo: Topology) -> list[Proc]:
    return vllm_procs(config, topo) if config.engine == "vllm" else sim_procs(config, topo)


def objects_file(config: StackConfig) -> Path:
    return config.run_dir / OBJECTS_FILE


def real_engine_picker_args(config: StackConfig) -> list[str]:
    """In front of real vLLM the picker reads the model's tokenizer, as in the cluster, and
    routes on the engines' KV-cache events."""
    if config.engine != "vllm" or "--tokenizer" in config.picker_args:
        return []
    return ["--tokenizer", str(vllm_server.MODEL_DIR)]


def picker_proc(config: StackConfig, topo: Topology) -> Proc:
    """The picker over every simulated group, with the rendered objects and body mode."""
    c = config
    cmd = [sys.executable, "-m", "picker", "--grpc-port", str(c.picker_grpc_port),
           "--health-port", str(c.picker_health_port), "--metrics-port", str(c.picker_metrics_port),
           "--secure-serving" if picker_tls(topo) else "--no-secure-serving",
           "--discovery", "static", "--endpoints", ",".join(s.address for s in topo.sims),
           "--objects", str(objects_file(c)), "--profile", c.profile,
           "--request-body-mode", topo.body_mode, "--bind", c.host, *picker_timing_args(c),
           *real_engine_picker_args(c), *c.picker_args]
    return Proc("picker", cmd, str(c.run_dir / "picker.log"), f"grpc:{c.host}:{c.picker_health_port}")


def envoy_gateway_proc(config: StackConfig, topo: Topology) -> Proc:
    """Envoy Gateway (standalone) on the run's data-plane layout; it starts Envoy. Healthy = both
    listeners route: /v1/models on `http` reaches a simulator through Envoy, on `llm-gw` it also
    crosses the picker."""
    layout = dataplane.Layout(config.run_dir)
    health = " ".join(f"http:http://{config.host}:{port}/v1/models"
                      for port in listener_ports(topo, config).values())
    return Proc("envoy-gateway", [str(dataplane.envoy_gateway_binary()), "server", "--config-path",
                                  str(layout.config)], str(config.run_dir / "envoy-gateway.log"), health)


def plan(config: StackConfig, topo: Topology) -> list[Proc]:
    """Every process of the stack, in start order (all start at once: the picker retries scrapes
    until the simulators answer)."""
    return [*engine_procs(config, topo), picker_proc(config, topo), envoy_gateway_proc(config, topo)]
