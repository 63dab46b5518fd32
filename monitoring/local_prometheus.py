"""A real Prometheus on the local stack, scraping it the way the cluster's monitors say.

    python -m monitoring.local_prometheus --name local   # against a stack started by `make up` (make observe)

The scrape config is derived from the PodMonitors of components/monitoring (rendered through
overlays/a10-monitoring), so the jobs, paths, relabelings and metric relabelings are written
once: each monitor endpoint becomes one scrape job whose static targets stand in for the pods
Kubernetes service discovery would find (their `__meta_kubernetes_*` labels included), followed by
the labels the Prometheus Operator adds (namespace, pod, endpoint, job) and the monitor's own
relabelings. Two things differ: the interval (the simulators run faster than real time), and
the local listener ports, which a first metric relabeling renames to the cluster's (Envoy
Gateway names a listener's stats `http-<port>`), so the monitor's own rules see what they would
see in the cluster.
The alert rules (components/monitoring/rules.yaml) are loaded too, so the UI shows their state.
Prometheus (Debian's package) listens on loopback; its data lives in the run folder.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from local.stack import Stack, StackConfig
from local.stack.config import REPO
from local.stack.processes import RunState, free_ports, port_free, stop_group
from local.stack.topology import kustomize, topology
from monitoring.rules import write_rule_file

MONITOR_OVERLAY = "overlays/a10-monitoring"
DEFAULT_PORT = 9095          # the picker has 9090
DEFAULT_INTERVAL = "2s"
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


@dataclass(frozen=True)
class Target:
    address: str             # host:port that Prometheus scrapes
    pod: str                 # the pod it stands in for
    namespace: str = "llm"


def monitors(overlay: str = MONITOR_OVERLAY) -> list[dict]:
    return [d for d in kustomize(overlay) if d.get("kind") == "PodMonitor"]


def relabel_config(rule: dict) -> dict:
    """A Prometheus Operator RelabelConfig (camelCase) as Prometheus' relabel_config (snake_case)."""
    out = {_CAMEL.sub("_", key).lower(): value for key, value in rule.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def listener_renames(listeners: dict[int, int]) -> list[dict]:
    """Metric relabelings: local listener port -> the cluster's (`listeners`: cluster -> local)."""
    return [{"source_labels": ["envoy_http_conn_manager_prefix"], "regex": f"http-{local}",
             "target_label": "envoy_http_conn_manager_prefix", "replacement": f"http-{cluster}"}
            for cluster, local in sorted(listeners.items()) if cluster != local]


def scrape_jobs(monitor: dict, targets: list[Target], interval: str, listeners: dict[int, int] | None = None) -> list[dict]:
    meta, spec = monitor["metadata"], monitor["spec"]
    jobs = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        port = str(ep.get("port") or ep.get("portNumber") or ep.get("targetPort"))
        static = [{"targets": [t.address],
                   "labels": {"__meta_kubernetes_namespace": t.namespace,
                              "__meta_kubernetes_pod_name": t.pod}} for t in targets]
        operator_defaults = [
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": f"{meta.get('namespace', 'default')}/{meta['name']}"},
            {"target_label": "endpoint", "replacement": port},
        ]
        jobs.append({
            "job_name": f"podMonitor/{meta.get('namespace', 'default')}/{meta['name']}/{i}",
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "metrics_path": ep.get("path", "/metrics"),
            "scheme": ep.get("scheme", "http"),
            "honor_labels": bool(ep.get("honorLabels", False)),
            "static_configs": static,
            "relabel_configs": operator_defaults + [relabel_config(r) for r in ep.get("relabelings", [])],
            "metric_relabel_configs": listener_renames(listeners or {})
            + [relabel_config(r) for r in ep.get("metricRelabelings", [])],
        })
    return jobs


def _label_name(label: str) -> str:
    """A Kubernetes label as Prometheus' pod discovery names it (`__meta_kubernetes_pod_label_<...>`)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def pod_discovery_jobs(monitor: dict, targets_file: str, interval: str) -> list[dict]:
    """The monitor's scrape jobs over discovered pods instead of static targets, with the
    selection the Prometheus Operator writes: the pods its selector picks, on the named port,
    Failed and Succeeded pods dropped. The targets come from `targets_file` (file_sd), in which
    each pod carries the `__meta_kubernetes_*` labels of Prometheus' pod discovery (Debian's
    Prometheus is built without kubernetes_sd_configs)."""
    selector = monitor["spec"]["selector"].get("matchLabels", {})
    jobs = scrape_jobs(monitor, [], interval)
    for job, ep in zip(jobs, monitor["spec"]["podMetricsEndpoints"]):
        del job["static_configs"]
        # Prometheus watches the file; the 1 s re-read catches a change whose watch event it missed
        job["file_sd_configs"] = [{"files": [targets_file], "refresh_interval": "1s"}]
        keep = [{"action": "keep", "regex": f"{value};true",
                 "source_labels": [f"__meta_kubernetes_pod_label_{_label_name(key)}",
                                   f"__meta_kubernetes_pod_labelpresent_{_label_name(key)}"]}
                for key, value in sorted(selector.items())]
        keep.append({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"})
        if ep.get("port"):
            keep.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                         "regex": ep["port"]})
        job["relabel_configs"] = keep + job["relabel_configs"]
    return jobs


def pod_discovery_targets(pods: list[dict]) -> list[dict]:
    """file_sd groups for pods (API objects), labelled as Prometheus' pod discovery labels them:
    one target per declared container port of each pod that has an IP."""
    groups = []
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        if not status.get("podIP"):
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        labels = {"__meta_kubernetes_namespace": meta["namespace"], "__meta_kubernetes_pod_name": meta["name"],
                  "__meta_kubernetes_pod_phase": status.get("phase", ""),
                  "__meta_kubernetes_pod_ready": str(ready).lower(),
                  "__meta_kubernetes_pod_ip": status["podIP"]}
        for key, value in (meta.get("labels") or {}).items():
            labels[f"__meta_kubernetes_pod_label_{_label_name(key)}"] = value
            labels[f"__meta_kubernetes_pod_labelpresent_{_label_name(key)}"] = "true"
        for container in pod["spec"]["containers"]:
            for port in container.get("ports") or []:
                groups.append({"targets": [f"{status['podIP']}:{port['containerPort']}"], "labels": {
                    **labels, "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])}})
    return groups


def stack_targets(stack: Stack) -> dict[str, list[Target]]:
    """Monitor name -> the local processes standing in for the pods it selects."""
    config, index, sims = stack.config, {}, []
    for sim in stack.topology.sims:   # leader pods are named <LeaderWorkerSet>-<group index>
        n = index[sim.lws] = index.get(sim.lws, -1) + 1
        sims.append(Target(sim.address, f"{sim.lws}-{n}"))
    envoy = stack.envoy_admin().removeprefix("http://")   # the admin API serves /stats/prometheus too
    return {"vllm-leaders": sims,
            "picker": [Target(f"{config.host}:{config.picker_metrics_port}", "inference-gateway-ext-proc-0")],
            "envoy-proxy": [Target(envoy, "envoy-inference-gateway-0", "envoy-gateway-system")]}


def cluster_listener_ports(stack: Stack) -> dict[int, int]:
    """The Gateway's listener ports in the cluster -> the local stack's."""
    local = stack.listener_ports()
    return {listener["port"]: local[listener["name"]]
            for gw in stack.topology.gateway if gw["kind"] == "Gateway"
            for listener in gw["spec"]["listeners"] if listener["name"] in local}


def prometheus_config(targets: dict[str, list[Target]], interval: str = DEFAULT_INTERVAL,
                      listeners: dict[int, int] | None = None) -> dict:
    """`listeners`: cluster listener port -> local port (8080 -> the stack's http port, ...)."""
    jobs = []
    for monitor in monitors():
        found = targets.get(monitor["metadata"]["name"])
        if found:
            jobs += scrape_jobs(monitor, found, interval, listeners)
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": jobs}


def stack_config(stack: Stack, interval: str = DEFAULT_INTERVAL) -> dict:
    """The Prometheus config for a started local stack."""
    return prometheus_config(stack_targets(stack), interval, cluster_listener_ports(stack))


class Prometheus:
    """One Prometheus process; `with Prometheus(...) as prom:` starts it and stops it."""

    def __init__(self, run_dir: Path, config: dict, port: int = DEFAULT_PORT, host: str = "127.0.0.1"):
        self.dir = Path(run_dir) / "prometheus"
        self.config, self.host, self.port = config, host, port
        self.popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "Prometheus":
        exe = shutil.which("prometheus")
        if exe is None:
            raise RuntimeError("prometheus not found (Debian package `prometheus`; `make setup` installs it)")
        if not port_free(self.host, self.port):
            raise RuntimeError(f"port {self.port} on {self.host} is in use (choose another with --port)")
        self.dir.mkdir(parents=True, exist_ok=True)
        rules = write_rule_file(self.dir)
        self.config = {**self.config, "rule_files": [str(rules)]}
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(self.config, sort_keys=False))
        cmd = [exe, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
               f"--web.listen-address={self.host}:{self.port}", "--log.level=warn"]
        with open(self.dir / "prometheus.log", "ab") as log:
            self.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not become ready; log {self.dir / 'prometheus.log'}")
            time.sleep(0.2)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            stop_group(self.popen.pid)
            self.popen.wait(timeout=10)

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                        step=f"{step:g}")["result"]

    def metric_names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def wait_scraped(self, timeout: float = 30.0) -> list[dict]:
        """Wait until every target has been scraped once (discovery applies every 5 s)."""
        expected = sum(len(group["targets"]) for job in self.config["scrape_configs"]
                       for group in job["static_configs"])
        deadline = time.monotonic() + timeout
        while True:
            targets = [t for t in self.targets() if not t["lastScrape"].startswith("0001-")]  # never: year 1
            if len(targets) >= expected:
                return targets
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(targets)} of {expected} targets scraped after {timeout:g}s")
            time.sleep(0.5)


@contextmanager
def observed_stack(name: str, run_root: Path, interval: str = "1s", **config):
    """A local stack on free loopback ports (StackConfig `config`) and a Prometheus scraping it,
    every target scraped once: `with observed_stack(...) as (stack, prom):`."""
    groups = config.get("groups", StackConfig.groups)
    http, llm, grpc, health, metrics, outcomes, prom_port, *sims = free_ports(7 + groups)
    config = StackConfig(name=name, run_root=Path(run_root), sim_ports=sims, http_port=http, llm_port=llm,
                         picker_grpc_port=grpc, picker_health_port=health, picker_metrics_port=metrics,
                         picker_outcomes_port=outcomes, **config)
    with Stack(config) as stack:
        with Prometheus(config.run_dir, stack_config(stack, interval), prom_port) as prom:
            prom.wait_scraped()
            yield stack, prom


def running_stack(name: str, run_root: Path = REPO / "runs") -> Stack:
    """The stack started by `make up` (config from its state file, topology from the manifests)."""
    run_dir = Path(run_root) / name
    state = RunState.read(run_dir)
    if state is None or state.config is None:
        raise SystemExit(f"no running stack {name!r} ({RunState.file(run_dir)} missing): start one with `make up`")
    stack = Stack(state.config)
    stack.topology = topology(stack.config)
    return stack


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m monitoring.local_prometheus", description=__doc__.split("\n")[0])
    p.add_argument("--name", default="local", help="the stack's run folder runs/<name>")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="Prometheus UI/API port on 127.0.0.1")
    p.add_argument("--interval", default=DEFAULT_INTERVAL, help="scrape and rule evaluation interval")
    args = p.parse_args(argv)
    stack = running_stack(args.name)
    prom = Prometheus(stack.config.run_dir, stack_config(stack, args.interval), args.port)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with prom:
        print(f"Prometheus {prom.url} scraping stack {args.name!r} (config and data in {prom.dir}); Ctrl-C stops it",
              flush=True)
        try:
            while prom.popen.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
