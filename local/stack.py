"""Launcher of the local stack: simulated vLLM groups, the picker, Envoy Gateway + Envoy.

    python -m local.stack up     [options]   start, wait until healthy, leave it running
    python -m local.stack down   [--name N]  stop a stack started by `up`
    python -m local.stack status [--name N]  what runs and whether it is healthy
    python -m local.stack reset  [--name N]  restart its simulators and picker (cold caches)
    python -m local.stack key    [--name N] [--client C]  print its throw-away API key
    python -m local.stack demo   [options]   up, compare both ports with loadtest, down

Every process runs in its own process group (session); its output goes to runs/<name>/<proc>.log
and runs/<name>/state.json records what was started, so `down` can stop it from another shell.
Any failure or Ctrl-C while starting stops everything that was started.

Everything comes from one render of the overlay a cluster would deploy, without the parts that
need cluster Secrets: overlays/a10-open-gateway (overlays/a10-canary-open-gateway with --canary;
components/buffered-body with --body-mode buffered) plus the cluster's edge
(components/edge-security: API keys, rate limits, connection limit; plain HTTP, no TLS;
--no-edge-security leaves it out). overlays/a10 is exactly that plus TLS and the verified picker
hop. The API keys are throw-away ones made at start, one per
client id in API_CLIENTS, kept in runs/<name>/api-keys.json (`python -m local.stack key`). The
simulated groups from its LeaderWorkerSets, the picker's objects from its InferenceObjectives and
InferenceModelRewrite, and Envoy Gateway's input from its gateway objects (local/dataplane.py).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from local import dataplane
from validation import manifests
from validation.render import kustomize as render_target
from local.dataplane import gateway_objects
from local.sim.clock import to_model_seconds, to_wall_seconds
from local.sim.engines import DEFAULT_ENGINE_MODEL, get_engine_model

REPO = Path(__file__).resolve().parent.parent
STABLE_SERVICE = "qwq-dist-v1"
MODEL = "qwq"
OBJECT_KINDS = {"InferenceObjective", "InferenceModelRewrite"}
HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EDGE_SECURITY = "components/edge-security"
# Client ids of the throw-away keys: `loadtest` has the load generators' rate limit (the demo, the
# load tests and the end-to-end tests use it), `user` the limit of any other client.
API_CLIENTS = ("loadtest", "user")
API_KEYS_FILE = "api-keys.json"


class StackError(RuntimeError):
    pass


@dataclass
class StackConfig:
    name: str = "local"
    groups: int = 3
    speedup: float = 20.0
    seed: int = 0
    # Request body mode of the EnvoyExtensionPolicy (None: as base/gateway has it). "buffered" adds
    # components/buffered-body to the render, as a cluster user would.
    body_mode: str | None = None
    canary: bool = False
    # The cluster's edge (components/edge-security) with throw-away API keys; False: no keys, no
    # rate limits, as overlays/a10-open-gateway alone.
    edge_security: bool = True
    host: str = "127.0.0.1"
    sim_base_port: int = 8101
    sim_ports: list[int] | None = None  # explicit ports; else sim_base_port, +1, ...
    # Listener ports; None: the cluster port + dataplane.LISTENER_PORT_OFFSET (18080, 18081).
    http_port: int | None = None
    llm_port: int | None = None
    picker_grpc_port: int = 9002
    picker_health_port: int = 9003
    picker_metrics_port: int = 9090
    profile: str = "default"
    # The picker's scrape interval and staleness in MODEL seconds (None: the picker's own defaults,
    # which are meant for real time). The launcher divides them by the speedup, so the picker sees
    # the simulated engines as often, in model time, as it would see real ones (see picker_timing).
    picker_scrape_interval: float | None = None
    picker_staleness: float | None = None
    kv_scale: int = 1  # simulators get the engine model's KV capacity / kv_scale (the demo uses DEMO_SCALE)
    sim_args: list[str] = field(default_factory=list)
    picker_args: list[str] = field(default_factory=list)
    run_root: Path = REPO / "runs"
    startup_timeout: float = 90.0

    @property
    def run_dir(self) -> Path:
        return Path(self.run_root) / self.name

    @property
    def overlay(self) -> str:
        return "overlays/a10-canary-open-gateway" if self.canary else "overlays/a10-open-gateway"

    @property
    def components(self) -> list[str]:
        return ((["components/buffered-body"] if self.body_mode == "buffered" else [])
                + ([EDGE_SECURITY] if self.edge_security else []))

    @property
    def api_keys_file(self) -> Path:
        return self.run_dir / API_KEYS_FILE


@dataclass
class SimGroup:
    lws: str  # the LeaderWorkerSet it stands in for
    port: int
    served_model_names: list[str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Topology:
    """What the manifests say the local stack should look like."""

    sims: list[SimGroup]
    services: dict[str, list[str]]             # Service name -> addresses of the leaders it selects
    http_route: list[tuple[str, int, list[str]]]  # (Service, weight, addresses) on listener `http`
    llm_route: list[tuple[str, int, list[str]]]   # the same on `llm-gw`
    objects: list[dict]                        # InferenceObjectives and InferenceModelRewrites
    gateway: list[dict]                        # the Gateway API and Envoy Gateway objects, as rendered
    body_mode: str                             # the picker's --request-body-mode, from the policy


# -- manifests ---------------------------------------------------------------------------------

def kustomize(path: str | Path) -> list[dict]:
    """The objects of a kustomization, rendered as `make validate` renders them."""
    result = render_target(REPO, str(path))
    if result.problems:
        raise StackError("; ".join(str(p) for p in result.problems))
    return result.objects


def render(config: StackConfig) -> list[dict]:
    """The overlay a cluster would deploy, with the config's components, rendered by kustomize."""
    if not config.components:
        return kustomize(config.overlay)
    with tempfile.TemporaryDirectory(prefix="local-render-") as tmp:
        # kustomize takes directories anywhere, but only by relative path
        def rel(path: str) -> str:
            return os.path.relpath(REPO / path, tmp)

        kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                         "resources": [rel(config.overlay)], "components": [rel(c) for c in config.components]}
        # the components' own objects land in the overlay's namespace, as in an overlay that lists them
        namespace = yaml.safe_load((REPO / config.overlay / "kustomization.yaml").read_text()).get("namespace")
        if namespace:
            kustomization["namespace"] = namespace
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return kustomize(tmp)


def _route_refs(docs: list[dict], section: str) -> list[tuple[str, int]]:
    routes = manifests.routes_on_listener(docs, section)
    if not routes:
        raise StackError(f"no HTTPRoute attached to listener {section!r} in the rendered manifests")
    return [(r["name"], int(r.get("weight", 1))) for r in manifests.backend_refs(routes[0])]


def _leader_sets(docs: list[dict]) -> list[tuple[str, dict, list[str]]]:
    """(LWS name, leader pod labels, served model names) for every LeaderWorkerSet."""
    served = manifests.served_model_names(docs)
    out = []
    for t in manifests.pod_templates(docs):
        if t.role != "leader":
            continue
        name = manifests.name_of(t.owner)
        if not served.get(name):
            raise StackError(f"LeaderWorkerSet {name!r}: no --served-model-name in its leader container")
        out.append((name, t.labels, served[name]))
    return out


BODY_MODES = {"Buffered": "buffered", "FullDuplexStreamed": "full-duplex"}


def _body_mode(docs: list[dict]) -> str:
    policy = next((d for d in docs if d.get("kind") == "EnvoyExtensionPolicy"), None)
    if policy is None:
        raise StackError("the rendered manifests have no EnvoyExtensionPolicy (the picker's ext_proc)")
    mode = ((policy["spec"]["extProc"][0].get("processingMode") or {}).get("request") or {}).get("body")
    if mode not in BODY_MODES:
        raise StackError(f"EnvoyExtensionPolicy {policy['metadata']['name']}: request body mode {mode!r}; "
                         f"the picker supports {sorted(BODY_MODES)}")
    return BODY_MODES[mode]


def topology(config: StackConfig) -> Topology:
    """Every LeaderWorkerSet of the overlay becomes simulated groups (the stable one `groups` of
    them, every other one a single group); each Service gets the groups its selector matches, as
    Kubernetes endpoints would."""
    ports = list(config.sim_ports or [])
    needed = config.groups + (1 if config.canary else 0)
    if not ports:
        ports = [config.sim_base_port + i for i in range(needed)]
    if len(ports) < needed:
        raise StackError(f"{needed} simulator ports needed, {len(ports)} given")
    docs = render(config)
    sims: list[SimGroup] = []
    labels_of: dict[str, dict] = {}
    free = iter(ports)
    for name, labels, served in _leader_sets(docs):
        labels_of[name] = labels
        count = config.groups if name == STABLE_SERVICE else 1
        sims += [SimGroup(name, next(free), served) for _ in range(count)]
    if not any(s.lws == STABLE_SERVICE for s in sims) or len(sims) != needed:
        raise StackError(f"{config.overlay}: expected LeaderWorkerSet {STABLE_SERVICE!r}"
                         f"{' and one canary' if config.canary else ''}, found {sorted(labels_of)}")
    services = {manifests.name_of(svc): [s.address for s in sims if manifests.matches(
                    (svc.get("spec") or {}).get("selector") or {}, labels_of[s.lws])]
                for svc in manifests.of_kind(docs, "Service")}

    def route(section: str) -> list[tuple[str, int, list[str]]]:
        groups = []
        for service, weight in _route_refs(docs, section):
            if not services.get(service):
                raise StackError(f"{config.overlay}: HTTPRoute ({section}) backendRef Service {service!r} "
                                 "selects no leader")
            groups.append((service, weight, services[service]))
        return groups

    body_mode = _body_mode(docs)
    if config.body_mode and config.body_mode != body_mode:
        raise StackError(f"body mode {config.body_mode!r} asked, but the rendered EnvoyExtensionPolicy says "
                         f"{body_mode!r}")
    return Topology(sims, {k: v for k, v in services.items() if v}, route("http"), route("llm-gw"),
                    _objects(docs), gateway_objects(docs), body_mode)


def _objects(docs: list[dict]) -> list[dict]:
    objects = [d for d in docs if d.get("kind") in OBJECT_KINDS]
    if not objects:
        raise StackError("the rendered manifests contain no InferenceObjective or InferenceModelRewrite")
    return objects


# -- picker timing in model time ---------------------------------------------------------------

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


# -- API keys ----------------------------------------------------------------------------------

def new_api_keys(path: Path) -> dict[str, str]:
    """Fresh random keys for API_CLIENTS, written to `path` readable by this user only."""
    keys = {client: secrets.token_urlsafe(32) for client in API_CLIENTS}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(keys, f, indent=2)
    os.chmod(path, 0o600)  # an older file keeps its mode through O_TRUNC
    return keys


def read_api_keys(path: Path) -> dict[str, str]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}


def api_keys_secret(gateway: list[dict], keys: dict[str, str]) -> dict:
    """The Secret the SecurityPolicy's apiKeyAuth names (data key = client id, value = API key), in
    the policy's namespace: what `kubectl create secret generic` makes in a cluster."""
    policy = next((d for d in gateway if d.get("kind") == "SecurityPolicy" and (d["spec"].get("apiKeyAuth"))), None)
    if policy is None:
        raise StackError(f"edge security is on but the render has no SecurityPolicy with apiKeyAuth "
                         f"({EDGE_SECURITY} missing from the overlay?)")
    refs = policy["spec"]["apiKeyAuth"].get("credentialRefs") or []
    if len(refs) != 1 or refs[0].get("kind", "Secret") != "Secret":
        raise StackError(f"SecurityPolicy {manifests.name_of(policy)}: spec.apiKeyAuth.credentialRefs must name "
                         "one Secret for the local stack to fill")
    meta = {"name": refs[0]["name"]}
    if policy["metadata"].get("namespace"):
        meta["namespace"] = refs[0].get("namespace") or policy["metadata"]["namespace"]
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "data": {client: base64.b64encode(key.encode()).decode() for client, key in keys.items()}}


# -- processes ---------------------------------------------------------------------------------

def python_env() -> dict[str, str]:
    """This environment with the repo and picker/src on PYTHONPATH, unbuffered output."""
    env = dict(os.environ)
    paths = [str(REPO), str(REPO / "picker" / "src")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def http_ok(url: str, timeout: float = 1.0, headers: dict[str, str] | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def grpc_serving(address: str, timeout: float = 1.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_group(pid: int, timeout: float = 5.0) -> None:
    stop_groups([pid], timeout)


def stop_groups(pids: list[int], timeout: float = 5.0) -> None:
    """SIGTERM the process groups led by pids, then SIGKILL what is left after `timeout`."""
    pending = list(pids)
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 2.0)):
        for pid in list(pending):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pending.remove(pid)
        deadline = time.monotonic() + wait
        while pending and time.monotonic() < deadline:
            pending = [p for p in pending if _alive(p)]
            if pending:
                time.sleep(0.05)
        if not pending:
            return


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log: str
    health: str  # "http:<url>" or "grpc:<address>"; several separated by spaces must all pass
    pid: int | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    def state(self) -> dict:
        return {"name": self.name, "cmd": self.cmd, "log": self.log, "health": self.health, "pid": self.pid}

    def healthy(self, headers: dict[str, str] | None = None) -> bool:
        """headers: sent with the http checks (the API key when the listeners need one)."""
        for check in self.health.split():
            kind, _, target = check.partition(":")
            if not (http_ok(target, headers=headers) if kind == "http" else grpc_serving(target)):
                return False
        return True


class Stack:
    """The whole local stack. Use as a context manager or call start() / stop()."""

    def __init__(self, config: StackConfig):
        self.config = config
        self.procs: list[Proc] = []
        self.topology: Topology | None = None
        self.api_keys: dict[str, str] = read_api_keys(config.api_keys_file) if config.edge_security else {}

    @property
    def state_file(self) -> Path:
        return self.config.run_dir / "state.json"

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def proc(self, name: str) -> Proc:
        for p in self.procs:
            if p.name == name:
                return p
        raise KeyError(name)

    def api_key(self, client: str = "loadtest") -> str | None:
        """The throw-away API key of `client` (None without edge security)."""
        return self.api_keys.get(client)

    def auth_headers(self, client: str = "loadtest") -> dict[str, str]:
        """What an OpenAI client sends with its api_key: `Authorization: Bearer <key>`."""
        key = self.api_key(client)
        return {"Authorization": f"Bearer {key}"} if key else {}

    # -- start -----------------------------------------------------------------------------

    def listener_ports(self) -> dict[str, int]:
        """Listener name -> local port: the config's, else the cluster port + the local offset."""
        c, ports = self.config, {}
        for gw in (d for d in self.topology.gateway if d["kind"] == "Gateway"):
            for listener in gw["spec"]["listeners"]:
                explicit = {"http": c.http_port, "llm-gw": c.llm_port}.get(listener["name"])
                ports[listener["name"]] = explicit or dataplane.local_listener_port(listener["port"])
        return ports

    @property
    def http_port(self) -> int:
        return self.listener_ports()["http"]

    @property
    def llm_port(self) -> int:
        return self.listener_ports()["llm-gw"]

    def plan(self) -> list[Proc]:
        c = self.config
        run = c.run_dir
        self.topology = topo = self.topology or topology(c)
        objects = run / "objects.yaml"
        run.mkdir(parents=True, exist_ok=True)
        objects.write_text(yaml.safe_dump_all(topo.objects, sort_keys=False))
        py = sys.executable
        procs = []
        for i, sim in enumerate(topo.sims):
            cmd = [py, "-m", "local.sim", "--host", c.host, "--port", str(sim.port)]
            for n in sim.served_model_names:
                cmd += ["--served-model-name", n]
            cmd += ["--speedup", str(c.speedup), "--seed", str(c.seed + i), *kv_scale_args(c), *c.sim_args]
            procs.append(Proc(f"sim-{sim.port}", cmd, str(run / f"sim-{sim.port}.log"),
                              f"http:http://{sim.address}/health"))
        endpoints = ",".join(s.address for s in topo.sims)
        picker = [py, "-m", "picker", "--grpc-port", str(c.picker_grpc_port),
                  "--health-port", str(c.picker_health_port), "--metrics-port", str(c.picker_metrics_port),
                  "--secure-serving" if self.picker_tls else "--no-secure-serving",
                  "--discovery", "static", "--endpoints", endpoints, "--objects", str(objects),
                  "--profile", c.profile, "--request-body-mode", topo.body_mode, "--bind", c.host,
                  *picker_timing_args(c), *c.picker_args]
        procs.append(Proc("picker", picker, str(run / "picker.log"),
                          f"grpc:{c.host}:{c.picker_health_port}"))
        procs.append(self._plan_envoy_gateway())
        return procs

    @property
    def picker_tls(self) -> bool:
        """TLS to the picker exactly when the gateway's Backend for it says so (base/gateway: yes)."""
        return any(d["kind"] == "Backend" and dataplane.is_picker_backend(d) and "tls" in d["spec"]
                   for d in self.topology.gateway)

    @property
    def layout(self) -> dataplane.Layout:
        return dataplane.Layout(self.config.run_dir)

    def _plan_envoy_gateway(self) -> Proc:
        """Envoy Gateway (standalone) with the rendered gateway objects, localized; it starts Envoy."""
        c, layout = self.config, self.layout
        binary = dataplane.envoy_gateway_binary()
        dataplane.prepare(layout)
        certgen = subprocess.run([str(binary), "certgen", "--local", "--config-home", str(layout.config_home)],
                                 capture_output=True, text=True)
        if certgen.returncode != 0:
            raise StackError(f"envoy-gateway certgen failed: {certgen.stderr.strip()[-2000:]}")
        resources = dataplane.localize(
            self.topology.gateway,
            {name: [(a.split(":")[0], int(a.split(":")[1])) for a in addresses]
             for name, addresses in self.topology.services.items()},
            (c.host, c.picker_grpc_port), self.listener_ports())
        if c.edge_security:
            self.api_keys = new_api_keys(c.api_keys_file)
            resources += [api_keys_secret(self.topology.gateway, self.api_keys)]
        dataplane.write_atomically(layout.resources / "gateway.yaml", dataplane.dump(resources))
        # Healthy = both listeners route: /v1/models on `http` reaches a simulator through Envoy,
        # on `llm-gw` it also crosses the picker.
        health = " ".join(f"http:http://{c.host}:{port}/v1/models" for port in self.listener_ports().values())
        return Proc("envoy-gateway", [str(binary), "server", "--config-path", str(layout.config)],
                    str(c.run_dir / "envoy-gateway.log"), health)

    def envoy_admin(self) -> str:
        """Envoy's admin address (http://ip:port); the Host provider lets Envoy choose the port."""
        address = dataplane.admin_address(self.layout)
        if not address:
            raise StackError(f"Envoy's admin address is not known yet (no admin-address.txt under {self.layout.root})")
        return f"http://{address}"

    def start(self) -> "Stack":
        c = self.config
        if self.state_file.exists():
            live = [p for p in json.loads(self.state_file.read_text())["procs"] if p["pid"] and _alive(p["pid"])]
            if live:
                raise StackError(f"stack {c.name!r} is already running (pids {[p['pid'] for p in live]}); "
                                 f"stop it with `python -m local.stack down --name {c.name}`")
        self.check_no_other_data_plane()
        self.topology = topology(c)
        ports = [s.port for s in self.topology.sims] + [*self.listener_ports().values(),
                                                       c.picker_grpc_port, c.picker_health_port,
                                                       c.picker_metrics_port]
        busy = [p for p in ports if not port_free(c.host, p)]
        if busy:
            raise StackError(f"ports already in use on {c.host}: {busy} (another stack? `make down`)")
        try:
            for p in self.plan():  # all at once: the picker retries scrapes until the simulators answer
                self._spawn(p)
            self._wait_healthy(self.procs)
        except BaseException:
            self.stop()
            raise
        return self

    def check_no_other_data_plane(self) -> None:
        """Standalone Envoy Gateway binds fixed ports and Envoy its hot-restart socket: one data plane
        per machine (network namespace). Fail before anything starts, naming the cause."""
        busy = dataplane.busy_ports()
        if busy or dataplane.envoy_running():
            what = f"ports {busy} are in use" if busy else "an Envoy already runs (its hot-restart socket exists)"
            raise StackError(f"another Envoy Gateway or Envoy runs on this machine: {what}. Only one local "
                             "stack can run at a time: stop the other one (`make down`, or "
                             "`python -m local.stack down --name <name>`)")

    def _spawn(self, p: Proc) -> None:
        with open(p.log, "ab") as log:
            p.popen = subprocess.Popen(p.cmd, cwd=REPO, env=python_env(), stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        p.pid = p.popen.pid
        self.procs.append(p)
        self._write_state()

    def _write_state(self) -> None:
        state = {"name": self.config.name, "config": _jsonable(dataclasses.asdict(self.config)),
                 "procs": [p.state() for p in self.procs]}
        self.state_file.write_text(json.dumps(state, indent=2))

    def _wait_healthy(self, procs: list[Proc]) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        pending = list(procs)
        while pending:
            for p in list(pending):
                if p.popen is not None and p.popen.poll() is not None:
                    raise StackError(f"{p.name} exited with {p.popen.returncode} while starting; "
                                     f"log {p.log}:\n{_tail(p.log)}")
                if p.healthy(self.auth_headers()):
                    pending.remove(p)
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise StackError(f"not healthy after {self.config.startup_timeout}s: {names}; "
                                 f"logs in {self.config.run_dir}:\n{_tail(pending[0].log)}")
            if pending:
                time.sleep(0.1)

    # -- stop ------------------------------------------------------------------------------

    def stop_process(self, name: str) -> None:
        p = self.proc(name)
        if p.pid is not None:
            stop_group(p.pid)
        if p.popen is not None:
            p.popen.wait(timeout=10)

    def restart_process(self, *names: str) -> None:
        """Start stopped processes again with the same commands and wait until they are healthy."""
        fresh = []
        for name in names:
            p = self.proc(name)
            self.procs.remove(p)
            fresh.append(Proc(p.name, p.cmd, p.log, p.health))
            self._spawn(fresh[-1])
        self._wait_healthy(fresh)

    def kill_process(self, name: str) -> None:
        p = self.proc(name)
        os.killpg(p.pid, signal.SIGKILL)
        if p.popen is not None:
            p.popen.wait(timeout=10)

    def stop(self) -> None:
        live = [p.pid for p in self.procs if p.pid is not None]
        if self.state_file.exists():  # `reset` from another process may have restarted some
            recorded = json.loads(self.state_file.read_text())["procs"]
            live += [p["pid"] for p in recorded if p["pid"] and p["pid"] not in live and _alive(p["pid"])
                     and _is_ours(p["pid"], p["cmd"])]
        stop_groups(live)
        for p in self.procs:
            if p.popen is not None:
                try:
                    p.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        if self.state_file.exists():
            self.state_file.unlink()

    # -- measurement -------------------------------------------------------------------------

    def cpu_seconds(self) -> dict[str, float]:
        """user+system CPU seconds so far, per process name (with its children), including what
        the processes `reset` replaced used before they were stopped."""
        state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        retired = state.get("retired_cpu_s", {})
        pids = {p["name"]: p["pid"] for p in state.get("procs", [])} or {p.name: p.pid for p in self.procs}
        return {name: process_cpu_seconds(pid) + retired.get(name, 0.0) for name, pid in pids.items()}


def process_cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of a process and its children (nan if it is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return sum(proc.cpu_times()[:2]) + sum(sum(c.cpu_times()[:2]) for c in proc.children(recursive=True))
    except psutil.Error:
        return float("nan")


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- commands ----------------------------------------------------------------------------------

def _read_state(name: str, run_root: Path) -> tuple[Path, dict | None]:
    """The state file of stack `name` and its contents (None if no such stack runs)."""
    state_file = Path(run_root) / name / "state.json"
    return state_file, json.loads(state_file.read_text()) if state_file.exists() else None


def down(name: str, run_root: Path = REPO / "runs") -> int:
    state_file, state = _read_state(name, run_root)
    if state is None:
        print(f"no running stack {name!r} ({state_file} not found)")
        return 0
    ours = [p for p in state["procs"] if p["pid"] and _alive(p["pid"]) and _is_ours(p["pid"], p["cmd"])]
    stop_groups([p["pid"] for p in ours])
    for p in ours:
        print(f"stopped {p['name']} (pid {p['pid']})")
    state_file.unlink()
    return 0


COLD_START = ("sim-", "picker")  # the processes that hold state between runs (caches, prefix index)


def reset(name: str, run_root: Path = REPO / "runs", timeout: float = 60.0) -> int:
    """Restart the simulators and the picker of a running stack, so the next run starts cold:
    empty KV and prefix caches, no prefix index, no in-flight counts. Envoy keeps running."""
    state_file, state = _read_state(name, run_root)
    if state is None:
        print(f"no running stack {name!r} ({state_file} not found)", file=sys.stderr)
        return 1
    fresh = []
    for p in state["procs"]:
        if not p["name"].startswith(COLD_START):
            continue
        if p["pid"] and _alive(p["pid"]) and _is_ours(p["pid"], p["cmd"]):
            used = process_cpu_seconds(p["pid"])  # kept, so a demo's CPU table covers every run
            retired = state.setdefault("retired_cpu_s", {})
            retired[p["name"]] = retired.get(p["name"], 0.0) + (0.0 if used != used else used)
            stop_group(p["pid"])
        with open(p["log"], "ab") as log:
            popen = subprocess.Popen(p["cmd"], cwd=REPO, env=python_env(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        p["pid"] = popen.pid
        fresh.append(Proc(p["name"], p["cmd"], p["log"], p["health"], popen.pid, popen))
    state_file.write_text(json.dumps(state, indent=2))
    deadline = time.monotonic() + timeout
    while not all(p.healthy() for p in fresh):
        if time.monotonic() > deadline:
            print(f"not healthy {timeout:.0f}s after the restart: "
                  f"{', '.join(p.name for p in fresh if not p.healthy())}", file=sys.stderr)
            return 1
        time.sleep(0.1)
    return 0


def _is_ours(pid: int, cmd: list[str]) -> bool:
    """The pid still runs the command we started (pids get reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[:3] == [c.encode() for c in cmd[:3]]
    except OSError:
        return True  # no /proc: trust the state file


def status(name: str, run_root: Path = REPO / "runs") -> int:
    state_file, state = _read_state(name, run_root)
    if state is None:
        print(f"no running stack {name!r}")
        return 1
    bad = 0
    key = read_api_keys(state_file.parent / API_KEYS_FILE).get("loadtest")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for p in state["procs"]:
        proc = Proc(p["name"], p["cmd"], p["log"], p["health"], p["pid"])
        alive = bool(p["pid"]) and _alive(p["pid"])
        healthy = alive and proc.healthy(headers)
        bad += not healthy
        print(f"{p['name']:<12} pid {p['pid']:<8} {'healthy' if healthy else 'DOWN' if not alive else 'unhealthy'}"
              f"  log {p['log']}")
    return 1 if bad else 0


def show_key(name: str, client: str, run_root: Path = REPO / "runs") -> int:
    """Print the throw-away API key of `client` of stack `name` (for OPENAI_API_KEY, curl...)."""
    path = Path(run_root) / name / API_KEYS_FILE
    keys = read_api_keys(path)
    if client not in keys:
        print(f"no API key for client {client!r} in {path} (is stack {name!r} up, with edge security?)",
              file=sys.stderr)
        return 1
    print(keys[client])
    return 0


def describe(stack: Stack) -> str:
    c = stack.config
    lines = [f"local stack {c.name!r} is up (logs and state in {c.run_dir}):"]
    for s in stack.topology.sims:
        lines.append(f"  simulator      {s.address}  serves {' '.join(s.served_model_names)}  ({s.lws})")
    lines.append(f"  picker         ext_proc {c.host}:{c.picker_grpc_port} ({'TLS' if stack.picker_tls else 'plaintext'}, "
                 f"{stack.topology.body_mode}), health {c.picker_health_port}, "
                 f"metrics http://{c.host}:{c.picker_metrics_port}/metrics")
    timing = picker_timing(c)
    if timing is not None:
        lines.append(f"                 scrapes every {timing.scrape_interval * 1000:.0f} ms wall = "
                     f"{timing.model_scrape_interval:g} s model time (speedup {c.speedup:g}), "
                     f"staleness {timing.model_staleness:g} s model time")
    lines.append(f"  envoy-gateway  {dataplane.EG_VERSION} standalone, Envoy {dataplane.ENVOY_VERSION}: "
                 f"http://{c.host}:{stack.http_port} (listener http, least request), "
                 f"http://{c.host}:{stack.llm_port} (listener llm-gw, picker)")
    try:
        lines.append(f"                 Envoy admin and stats {stack.envoy_admin()}/stats")
    except StackError:
        pass
    if stack.api_keys:
        lines.append(f"  API keys       {', '.join(stack.api_keys)} in {c.api_keys_file} (both listeners need one):")
        lines.append(f"                 export OPENAI_API_KEY=$(python -m local.stack key --name {c.name} --client user)")
    else:
        lines.append("  API keys       none (--no-edge-security): both listeners are open")
    return "\n".join(lines)


# `make demo` runs the article's workload scaled down by DEMO_SCALE: every length / DEMO_SCALE
# (loadtest/workloads.py "demo") on simulators with the KV capacity / DEMO_SCALE, at the article's
# concurrency. Queueing for KV blocks, which is what routing changes, then happens as in the
# article, in 1/DEMO_SCALE of the time (measured in the lab: least request vs picker within a few
# points of the full-size gap). DEMO_SPEEDUP keeps the SSE chunk rate ~1,200/s, low enough that
# the stack's CPU use does not distort latencies on 2 cores (see DATAPLANE.md, "make demo").
DEMO_SCALE = 6
DEMO_SPEEDUP = 5.0
DEMO_ENGINE_MODEL = DEFAULT_ENGINE_MODEL  # the simulator's default engine model


def kv_scale_args(config: StackConfig) -> list[str]:
    if config.kv_scale <= 1 or "--num-gpu-blocks" in config.sim_args:
        return []
    args = config.sim_args
    engine_model = args[args.index("--engine-model") + 1] if "--engine-model" in args else DEMO_ENGINE_MODEL
    return ["--num-gpu-blocks", str(get_engine_model(engine_model).num_gpu_blocks // config.kv_scale)]


DEMO_ORDERS = ("http-first", "picker-first")  # which listener loadtest compare runs first


def demo_command(config: StackConfig, listeners: dict[str, int], metrics_endpoints: list[str], out: Path,
                 workload: str, compare_args: list[str], warm: bool = False, order: str = "http-first") -> list[str]:
    """The `loadtest compare` command of the demo: both listeners (`listeners`: name -> port), http
    (least request) then llm-gw (picker) or, with order picker-first, llm-gw then http."""
    if order not in DEMO_ORDERS:
        raise ValueError(f"order {order!r}: expected one of {', '.join(DEMO_ORDERS)}")
    names = ["http", "llm-gw"] if order == "http-first" else ["llm-gw", "http"]
    cmd = [sys.executable, "-m", "loadtest", "compare", "--host", config.host,
           "--ports", *(str(listeners[n]) for n in names), "--workload", workload,
           "--seed", str(config.seed), "--out", str(out), "--repetitions", "2",  # A B, B A
           "--metrics-endpoints", *metrics_endpoints, *compare_args]
    if not warm:  # every run cold: its own caches and prefix index, whatever ran before
        cmd += ["--before-each-run", f"{shlex.quote(sys.executable)} -m local.stack reset --name {config.name} "
                                     f"--run-root {shlex.quote(str(config.run_root))}"]
    return cmd


def demo(config: StackConfig, out: Path | None, workload: str, compare_args: list[str], warm: bool = False,
         order: str = "http-first") -> int:
    out = out or REPO / "results" / time.strftime("demo-%Y%m%d-%H%M%S")
    with Stack(config) as stack:
        print(describe(stack), flush=True)
        before, t0 = stack.cpu_seconds(), time.monotonic()
        cmd = demo_command(config, stack.listener_ports(), [s.address for s in stack.topology.sims], out,
                           workload, compare_args, warm, order)
        print("$ python " + " ".join(cmd[1:]), flush=True)
        client_before = _children_cpu()
        envoy_before = dataplane.listener_stats(stack.envoy_admin(), stack.listener_ports())
        env = python_env()
        if stack.api_key():
            env["OPENAI_API_KEY"] = stack.api_key()  # the load generator's key, not on the command line
        rc = subprocess.call(cmd, cwd=REPO, env=env)
        envoy = dataplane.stats_delta(envoy_before, dataplane.listener_stats(stack.envoy_admin(),
                                                                             stack.listener_ports()))
        after, wall = stack.cpu_seconds(), time.monotonic() - t0
        after["loadtest"] = _children_cpu() - client_before  # the load generator, for comparison
    table = envoy_table(envoy, stack.listener_ports())
    print(table)
    print(cpu_table(before, after, wall))
    if out.is_dir():
        cpu = {name: after[name] - before.get(name, 0.0) for name in after}
        (out / "dataplane.json").write_text(json.dumps(
            {"wall_s": wall, "cores": os.cpu_count(), "cpu_s": cpu, "listeners": stack.listener_ports(),
             "envoy_listener_stats": envoy, "speedup": config.speedup, "workload": workload,
             "state_between_runs": "warm" if warm else "cold"}, indent=2))
    report = out / "report.md"
    if report.exists():
        with report.open("a") as f:
            f.write(f"\n## Envoy's own listener statistics\n\n{table}\n\n## CPU per process\n\n"
                    f"```\n{cpu_table(before, after, wall)}\n```\n\n"
                    + ("Runs started **warm**: simulators and picker kept their state between runs.\n" if warm else
                       "Runs started **cold**: the simulators and the picker were restarted before every run "
                       "(`python -m local.stack reset`), so no run starts with another's KV/prefix caches or "
                       "prefix index.\n"))
    return rc


def envoy_table(delta: dict[str, dict[str, int]], ports: dict[str, int]) -> str:
    """Markdown table of what Envoy counted on each listener during the comparison."""
    stats = dataplane.LISTENER_STATS
    rows = ["| listener | " + " | ".join(s.replace("downstream_", "") for s in stats) + " |",
            "|---|" + "---|" * len(stats)]
    for name, values in delta.items():
        rows.append(f"| {name} ({ports[name]}) | " + " | ".join(str(values[s]) for s in stats) + " |")
    return "\n".join(rows)


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_table(before: dict[str, float], after: dict[str, float], wall: float) -> str:
    rows = [f"CPU used during the comparison ({wall:.0f} s wall, {os.cpu_count()} cores):"]
    total = 0.0
    for name in after:
        used = after[name] - before.get(name, 0.0)
        if name != "loadtest":
            total += used
        rows.append(f"  {name:<12} {used:7.1f} s  {used / wall:5.2f} cores")
    rows.append(f"  {'stack total':<12} {total:7.1f} s  {total / wall:5.2f} cores (without loadtest)")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m local.stack", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("up", "down", "status", "reset", "demo", "key"):
        s = sub.add_parser(name)
        s.add_argument("--name", default="local", help="run folder <run-root>/<name>")
        s.add_argument("--run-root", type=Path, default=REPO / "runs", help="where run folders live (default runs/)")
        if name in ("up", "demo"):
            s.add_argument("--groups", type=int, default=3, help="simulated vLLM groups (stable)")
            s.add_argument("--speedup", type=float, default=DEMO_SPEEDUP if name == "demo" else 20.0,
                           help="simulator time speedup (default: 20 for up, 5 for demo)")
            s.add_argument("--scrape-interval", type=float, dest="picker_scrape_interval",
                           help="picker scrape interval in MODEL seconds (default: the picker's, "
                                "0.1); the picker gets it divided by the speedup")
            s.add_argument("--staleness", type=float, dest="picker_staleness",
                           help="picker staleness in MODEL seconds (default: the picker's, 1.0)")
            s.add_argument("--seed", type=int, default=0)
            s.add_argument("--body-mode", choices=["buffered", "full-duplex"],
                           help="request body mode of the EnvoyExtensionPolicy (default: base/gateway's, "
                                "full-duplex; buffered renders with components/buffered-body)")
            s.add_argument("--canary", action="store_true", help="overlays/a10-canary: extra canary group + weights")
            s.add_argument("--edge-security", action=argparse.BooleanOptionalAction, default=True,
                           help=f"render {EDGE_SECURITY} (API keys, rate limits, connection limit) with "
                                "throw-away keys (default: on; --no-edge-security: open listeners)")
            s.add_argument("--profile", default="default", help="picker scheduling profile")
            s.add_argument("--sim-base-port", type=int, default=8101)
            s.add_argument("--sim-ports", type=int, nargs="+")
            s.add_argument("--http-port", type=int, help="listener http (default: 8080 + "
                           f"{dataplane.LISTENER_PORT_OFFSET} = 18080)")
            s.add_argument("--llm-port", type=int, help="listener llm-gw (default: 8081 + "
                           f"{dataplane.LISTENER_PORT_OFFSET} = 18081)")
            s.add_argument("--picker-grpc-port", type=int, default=9002)
            s.add_argument("--picker-health-port", type=int, default=9003)
            s.add_argument("--picker-metrics-port", type=int, default=9090)
            s.add_argument("--sim-arg", action="append", default=[], help="extra simulator argument (repeat)")
            s.add_argument("--picker-arg", action="append", default=[], help="extra picker argument (repeat)")
            s.add_argument("--startup-timeout", type=float, default=90.0)
            s.add_argument("--kv-scale", type=int, default=DEMO_SCALE if name == "demo" else 1,
                           help="simulators get the engine model's KV capacity / this (default: 1 for up, "
                                f"{DEMO_SCALE} for demo, whose workload is the article's / {DEMO_SCALE})")
        if name == "key":
            s.add_argument("--client", default="loadtest", choices=API_CLIENTS,
                           help="whose key: loadtest (the load generators' rate limit) or user (any other client's)")
        if name == "up":
            s.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the stack")
        if name == "demo":
            s.add_argument("--workload", default="demo")
            s.add_argument("--out", type=Path)
            s.add_argument("--warm", action="store_true",
                           help="keep the simulators' caches and the picker's state between runs (default: "
                                "restart both before every run, so no run depends on the one before)")
            s.add_argument("--order", choices=DEMO_ORDERS, default="http-first",
                           help="which listener loadtest compare loads first: http (least request, the "
                                "default) or llm-gw (through the picker); the repetition then swaps them")
    return p


def config_from(args: argparse.Namespace) -> StackConfig:
    return StackConfig(
        name=args.name, groups=args.groups, speedup=args.speedup, seed=args.seed, body_mode=args.body_mode,
        canary=args.canary, edge_security=args.edge_security, profile=args.profile, sim_base_port=args.sim_base_port,
        sim_ports=args.sim_ports, http_port=args.http_port, llm_port=args.llm_port,
        picker_grpc_port=args.picker_grpc_port, picker_health_port=args.picker_health_port,
        picker_metrics_port=args.picker_metrics_port, sim_args=[a for x in args.sim_arg for a in x.split()],
        picker_args=[a for x in args.picker_arg for a in x.split()], startup_timeout=args.startup_timeout,
        picker_scrape_interval=args.picker_scrape_interval, picker_staleness=args.picker_staleness,
        kv_scale=args.kv_scale, run_root=args.run_root)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(argv)
    if rest and args.command != "demo":
        parser().error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo" and any(a == "--ports" or a.startswith("--ports=") for a in rest):
        parser().error("demo compares both listeners: choose which goes first with --order, not --ports")
    if args.command == "down":
        return down(args.name, args.run_root)
    if args.command == "status":
        return status(args.name, args.run_root)
    if args.command == "reset":
        return reset(args.name, args.run_root)
    if args.command == "key":
        return show_key(args.name, args.client, args.run_root)
    config = config_from(args)
    # Ctrl-C and SIGTERM both unwind through Stack.start/stop, which stop every process group.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # also when started in the background (SIGINT ignored)
    try:
        if args.command == "demo":
            return demo(config, args.out, args.workload, rest, warm=args.warm, order=args.order)
        stack = Stack(config).start()
        print(describe(stack), flush=True)
        if args.foreground:
            try:
                while all(p.popen.poll() is None for p in stack.procs):
                    time.sleep(0.5)
                print("a process exited; stopping the stack", file=sys.stderr)
                return 1
            finally:
                stack.stop()
        print(f"stop it with: python -m local.stack down --name {config.name}   (or make down)")
        return 0
    except (StackError, dataplane.DataPlaneError) as e:
        print(f"local.stack: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; the stack was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
