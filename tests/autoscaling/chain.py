"""The parts of the autoscaling chain that run beside the API server: KEDA's two binaries with
their certificates, the actuator that stands in for the LeaderWorkerSet controller and the kubelet,
and the load that stands in for Envoy in front of the picker."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography.x509.oid import ExtendedKeyUsageOID

from local.certs import _pem, issue, new_ca
from tests.helpers.kube import end_process
from validation.apiserver import free_port

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools" / "bin"
KEDA_OPERATOR = Path(os.environ.get("KEDA_OPERATOR", TOOLS / "keda-operator"))
KEDA_ADAPTER = Path(os.environ.get("KEDA_ADAPTER", TOOLS / "keda-adapter"))
KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_NAMESPACE = "keda"
ADAPTER_SERVICE = "keda-metrics-apiserver"
# The adapter's address, also its Service's ClusterIP: the API server's Service range is loopback
# (127.0.100.0/24) and aggregator routing is off, so the aggregator dials it here.
ADAPTER_IP = "127.0.100.20"
FRONT_PROXY_CLIENT = "front-proxy-client"


def keda_version() -> str:
    """The KEDA release tools/keda builds (its go.mod)."""
    text = (ROOT / "tools" / "keda" / "go.mod").read_text()
    return re.search(rf"^require {re.escape(KEDA_MODULE)} (\S+)$", text, re.M).group(1)


def keda_crds_dir() -> Path:
    """KEDA's CRDs from the module the binaries are built from (the Go module cache)."""
    module = f"{KEDA_MODULE}@{keda_version()}"
    proc = subprocess.run(["go", "mod", "download", "-json", module], capture_output=True, text=True,
                          cwd=ROOT / "tools" / "keda")
    info = json.loads(proc.stdout or "{}")
    if proc.returncode != 0 or "Dir" not in info:
        raise RuntimeError(f"go mod download {module}: {info.get('Error') or proc.stderr.strip()}")
    return Path(info["Dir"]) / "config" / "crd" / "bases"


@dataclass(frozen=True)
class Certificates:
    """KEDA's (one CA, one certificate for the operator's gRPC server, the adapter's gRPC client and
    the adapter's HTTPS, as KEDA's own cert rotation makes them) and the API server's front proxy
    (the aggregator's client certificate, which the adapter trusts through the requestheader CA)."""
    keda: Path            # ca.crt, tls.crt, tls.key
    front_proxy: Path     # ca.crt, client.crt, client.key

    @property
    def apiserver_args(self) -> tuple[str, ...]:
        return (f"--requestheader-client-ca-file={self.front_proxy / 'ca.crt'}",
                f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={self.front_proxy / 'client.crt'}",
                f"--proxy-client-key-file={self.front_proxy / 'client.key'}")

    @property
    def ca_bundle(self) -> str:
        return base64.b64encode((self.keda / "ca.crt").read_bytes()).decode()


def write_certificates(workdir: Path) -> Certificates:
    certs = Certificates(workdir / "keda-certs", workdir / "front-proxy")
    both = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
    names = [f"{service}.{KEDA_NAMESPACE}.svc{suffix}" for service in ("keda-operator", ADAPTER_SERVICE)
             for suffix in ("", ".cluster.local")]
    for folder, ca_name, files, dns, ips, usages in (
            (certs.keda, "KEDAORG test CA", ("tls.key", "tls.crt"), names, ["127.0.0.1", ADAPTER_IP], both),
            (certs.front_proxy, "front-proxy test CA", ("client.key", "client.crt"), [FRONT_PROXY_CLIENT], [],
             (ExtendedKeyUsageOID.CLIENT_AUTH,))):
        ca_key, ca_cert = new_ca(ca_name)
        key, cert = issue(ca_key, ca_cert, dns, ips, usages)
        folder.mkdir(parents=True)
        (folder / "ca.crt").write_bytes(_pem(ca_cert))
        (folder / files[0]).write_bytes(key)
        (folder / files[1]).write_bytes(cert)
    return certs


class Keda:
    """KEDA's operator (its gRPC metrics service on loopback) and its metrics API server
    (the adapter: external.metrics.k8s.io behind the API server's aggregator), as in KEDA's own
    manifests but as processes: cert rotation off (the certificates are made by the test), leader
    election off, the operator's own /metrics and probes off; both with the admin kubeconfig
    (KEDA's ClusterRoles are not what this tests)."""

    def __init__(self, workdir: Path, kubeconfig: Path, certs: Certificates):
        self.workdir, self.kubeconfig, self.certs = workdir, kubeconfig, certs
        self.grpc_port, self.adapter_port = free_port(), free_port()
        self.processes: list[subprocess.Popen] = []

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        env.update(KUBECONFIG=str(self.kubeconfig), WATCH_NAMESPACE="", POD_NAMESPACE=KEDA_NAMESPACE,
                   KEDA_CLUSTER_OBJECT_NAMESPACE=KEDA_NAMESPACE)
        return env

    def _spawn(self, name: str, argv: list) -> None:
        log = (self.workdir / f"{name}.log").open("wb")
        self.processes.append(subprocess.Popen([str(a) for a in argv], env=self.env(), stdout=log,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True))

    def start(self) -> "Keda":
        kcfg, certs = self.kubeconfig, self.certs.keda
        self._spawn("keda-operator", [
            KEDA_OPERATOR, f"--metrics-service-bind-address=127.0.0.1:{self.grpc_port}", f"--cert-dir={certs}",
            "--metrics-bind-address=0", "--health-probe-bind-address=0", "--enable-cert-rotation=false",
            "--leader-elect=false", "--zap-log-level=info"])
        self._spawn("keda-adapter", [
            KEDA_ADAPTER, f"--bind-address={ADAPTER_IP}", f"--secure-port={self.adapter_port}",
            f"--tls-cert-file={certs / 'tls.crt'}", f"--tls-private-key-file={certs / 'tls.key'}",
            f"--cert-dir={certs}", f"--metrics-service-address=127.0.0.1:{self.grpc_port}",
            f"--lister-kubeconfig={kcfg}", f"--authentication-kubeconfig={kcfg}",
            f"--authorization-kubeconfig={kcfg}", f"--port={free_port()}", "--zap-log-level=info"])
        return self

    def register(self, api) -> None:
        """The adapter's Service (ClusterIP = its loopback address), an EndpointSlice that makes the
        Service look served (never dialled: aggregator routing is off) and the APIService,
        trusting KEDA's CA as KEDA's cert rotation would patch it."""
        from kubernetes import client
        client.CoreV1Api(api).create_namespaced_service(KEDA_NAMESPACE, {
            "metadata": {"name": ADAPTER_SERVICE},
            "spec": {"clusterIP": ADAPTER_IP, "ports": [{"name": "https", "port": self.adapter_port}]}})
        client.DiscoveryV1Api(api).create_namespaced_endpoint_slice(KEDA_NAMESPACE, {
            "metadata": {"name": f"{ADAPTER_SERVICE}-1", "labels": {"kubernetes.io/service-name": ADAPTER_SERVICE}},
            "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": self.adapter_port}]})
        client.ApiregistrationV1Api(api).create_api_service({
            "metadata": {"name": "v1beta1.external.metrics.k8s.io"},
            "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1", "caBundle": self.certs.ca_bundle,
                     "service": {"namespace": KEDA_NAMESPACE, "name": ADAPTER_SERVICE, "port": self.adapter_port},
                     "groupPriorityMinimum": 100, "versionPriority": 100}})

    def log_size(self, name: str) -> int:
        return (self.workdir / f"{name}.log").stat().st_size

    def log_since(self, name: str, offset: int) -> str:
        with (self.workdir / f"{name}.log").open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def check_running(self) -> None:
        for proc, name in zip(self.processes, ("keda-operator", "keda-adapter")):
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for proc in self.processes:
            end_process(proc)


class PodDiscovery:
    """Stand-in for Prometheus' Kubernetes pod discovery, which Debian's Prometheus is built without
    (its config loader answers `field kubernetes_sd_configs not found in type config.ScrapeConfig`):
    lists the namespace's pods on the API server every `every` seconds and writes them, labelled as
    that discovery labels them, to a file_sd file that Prometheus watches. `scrape_at` (pod name ->
    host:port) points a pod's target elsewhere, e.g. at a `LeaderMetricsStandIn`; its labels stay."""

    def __init__(self, api, namespace: str, path: Path, every: float = 0.2):
        from kubernetes import client
        self.core, self.namespace, self.path, self.every = client.CoreV1Api(api), namespace, path, every
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pod-discovery", daemon=True)
        self.written = None
        self.scrape_at: dict[str, str] = {}
        self.write([])

    def write(self, pods: list[dict]) -> None:
        from monitoring.local_prometheus import pod_discovery_targets
        groups = pod_discovery_targets(pods)
        for group in groups:
            elsewhere = self.scrape_at.get(group["labels"]["__meta_kubernetes_pod_name"])
            if elsewhere:
                group["targets"] = [elsewhere]
        text = json.dumps(groups, sort_keys=True)
        if text != self.written:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.path)
            self.written = text

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                reply = self.core.list_namespaced_pod(self.namespace, _preload_content=False)
                self.write(json.loads(reply.data)["items"])
            except Exception:   # noqa: BLE001 - as discovery does: keep the last targets, retry
                pass
            self.stop_event.wait(self.every)

    def start(self) -> "PodDiscovery":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=5)


class LeaderMetricsStandIn:
    """Stand-in for a leader's /metrics page gone wrong (vLLM's own never serves these): `mode`
    "error" answers 503 (the scrape fails, Prometheus marks the target's series stale), "nan" and
    "inf" serve vLLM's two request gauges with NaN or +Inf as the running requests."""

    def __init__(self):
        self.mode = "error"
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        stand_in = self

        class Page(BaseHTTPRequestHandler):
            def do_GET(self):
                value = {"nan": "NaN", "inf": "+Inf"}.get(stand_in.mode)
                if value is None:
                    self.send_error(503)
                    return
                body = (f'vllm:num_requests_running{{model_name="qwq"}} {value}\n'
                        'vllm:num_requests_waiting{model_name="qwq"} 0\n').encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Page)
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics-stand-in", daemon=True)

    def start(self) -> "LeaderMetricsStandIn":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class StatusLog:
    """Samples, every `every` seconds, the HPA's ScalingActive condition and the ScaledObject's
    Fallback condition and health, keeping each change with its time: short states (the HPA fails
    for ~1-3 s before KEDA's fallback answers) are seen however long a phase lasts."""
    api: object
    namespace: str
    hpa: str
    scaled_object: str
    every: float = 0.25
    changes: list = field(default_factory=list)      # (monotonic time, what, value)

    def __post_init__(self):
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="status-log", daemon=True)

    def sample(self) -> dict:
        from kubernetes import client
        hpa = client.AutoscalingV2Api(self.api).read_namespaced_horizontal_pod_autoscaler(self.hpa, self.namespace)
        so = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            "keda.sh", "v1alpha1", self.namespace, "scaledobjects", self.scaled_object)
        active = next((c for c in hpa.status.conditions or [] if c.type == "ScalingActive"), None)
        status = so.get("status") or {}
        fallback = next((c for c in status.get("conditions") or [] if c["type"] == "Fallback"), {})
        return {"hpa": (active.status, active.reason, active.message) if active else None,
                "fallback": (fallback.get("status"), fallback.get("reason")),
                "health": json.dumps(status.get("health") or {}, sort_keys=True)}

    def _run(self) -> None:
        last: dict = {}
        while not self.stop_event.is_set():
            try:
                for what, value in self.sample().items():
                    if last.get(what) != value:
                        self.changes.append((time.monotonic(), what, value))
                        last[what] = value
            except Exception:   # noqa: BLE001 - a missed sample; the next one counts
                pass
            self.stop_event.wait(self.every)

    def seen(self, what: str, after: float, before: float | None = None) -> list:
        """Values of `what` in force at any time in [after, before]: the one holding at `after` too."""
        before = time.monotonic() if before is None else before
        held = [v for t, w, v in self.changes if w == what and t <= after][-1:]
        return held + [v for t, w, v in self.changes if w == what and after < t <= before]

    def start(self) -> "StatusLog":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=5)


# ---- groups ------------------------------------------------------------------------------------

def group_ip(index: int) -> str:
    """Group g's leader pod IP: its own loopback address, so every leader serves on port 8000
    (the InferencePool's target port) as in the cluster."""
    return f"127.0.50.{10 + index}"


def http_get(url: str, timeout: float = 2) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except OSError:
        return None


@dataclass
class Group:
    index: int
    pod: str
    sim: subprocess.Popen
    ready_at: float | None = None
    terminating_at: float | None = None


@dataclass
class Actuator:
    """Stand-in for the LeaderWorkerSet controller and the kubelet (neither runs here): follows the
    LeaderWorkerSet's spec.replicas. Up: starts group g's simulated vLLM (`python -m local.sim` on
    the group's loopback IP, port 8000), creates its leader pod `<lws>-<g>` from the rendered leader
    template (bound to a node, so its deletion is graceful) and, once the simulator answers
    /health, writes the pod Running and Ready with its IP. Down: removes the highest group as the
    LeaderWorkerSet does: deletes its leader pod (it turns terminating: the picker drops it), runs
    the leader's preStop hook as rendered (two changes, named in `prestop`), then stops the
    simulator and lets the pod go. Writes the LeaderWorkerSet's status (replicas, readyReplicas,
    hpaPodSelector) after every change."""
    api: object
    namespace: str
    lws: dict
    workdir: Path
    sim_args: tuple = ()
    settle_s: float = 1.0
    groups: dict = field(default_factory=dict)
    events: list = field(default_factory=list)      # (monotonic time, what, group index)
    errors: list = field(default_factory=list)

    def __post_init__(self):
        from kubernetes import client
        self.core, self.custom = client.CoreV1Api(self.api), client.CustomObjectsApi(self.api)
        self.name = self.lws["metadata"]["name"]
        self.template = self.lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="actuator", daemon=True)

    # LeaderWorkerSet ------------------------------------------------------------------------
    def _lws_ref(self):
        return ("leaderworkerset.x-k8s.io", "v1", self.namespace, "leaderworkersets", self.name)

    def spec_replicas(self) -> int:
        return self.custom.get_namespaced_custom_object(*self._lws_ref())["spec"]["replicas"]

    def write_status(self) -> None:
        with self.lock:
            live = [g for g in self.groups.values() if g.terminating_at is None]
        self.custom.patch_namespaced_custom_object_status(*self._lws_ref(), {"status": {
            "replicas": len(live), "readyReplicas": sum(g.ready_at is not None for g in live),
            "hpaPodSelector": f"leaderworkerset.sigs.k8s.io/name={self.name},"
                              "leaderworkerset.sigs.k8s.io/worker-index=0"}})

    def event(self, what: str, index: int | None = None) -> None:
        self.events.append((time.monotonic(), what, index))

    def first(self, what: str, index: int | None = None, after: float = 0.0) -> float | None:
        return next((t for t, w, i in self.events if w == what and (index is None or i == index) and t >= after),
                    None)

    # groups -----------------------------------------------------------------------------------
    def pod_labels(self) -> dict:
        labels = dict(self.template["metadata"]["labels"])
        labels.update({"leaderworkerset.sigs.k8s.io/name": self.name,
                       "leaderworkerset.sigs.k8s.io/worker-index": "0"})
        return labels

    def start_group(self, index: int) -> None:
        ip, pod = group_ip(index), f"{self.name}-{index}"
        log = (self.workdir / f"sim-{index}.log").open("wb")
        sim = subprocess.Popen([sys.executable, "-m", "local.sim", "--host", ip, "--port", "8000",
                                "--served-model-name", "qwq", "--seed", str(index), *self.sim_args],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        spec = json.loads(json.dumps(self.template["spec"]))
        spec["nodeName"] = f"node-{index}"
        self.core.create_namespaced_pod(self.namespace, {
            "metadata": {"name": pod, "labels": {**self.pod_labels(),
                                                 "leaderworkerset.sigs.k8s.io/group-index": str(index)}},
            "spec": spec})
        with self.lock:
            self.groups[index] = Group(index, pod, sim)
        self.event("pod-created", index)
        self.write_status()
        threading.Thread(target=self._become_ready, args=(self.groups[index], ip), daemon=True).start()

    def _become_ready(self, group: Group, ip: str) -> None:
        while http_get(f"http://{ip}:8000/health") is None:
            if group.sim.poll() is not None:
                self.errors.append(f"simulator of group {group.index} exited with {group.sim.returncode}")
                return
            time.sleep(0.1)
        self.core.patch_namespaced_pod_status(group.pod, self.namespace, {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True"}]}})
        group.ready_at = time.monotonic()
        self.event("pod-ready", group.index)
        self.write_status()

    def prestop(self, index: int) -> list[str]:
        """The leader's preStop command as rendered, with two changes: it reads the group's vLLM at
        the group's IP (in the pod that is 127.0.0.1, its own network namespace) and waits
        `settle_s` instead of 15 s for the picker and Envoy to stop sending (the picker here drops a
        terminating pod within a watch event)."""
        command = list(self.template["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"])
        script = command[-1]
        assert "http://127.0.0.1:8000/metrics" in script and "time.sleep(15)" in script, script
        command[-1] = (script.replace("http://127.0.0.1:8000/metrics", f"http://{group_ip(index)}:8000/metrics")
                       .replace("time.sleep(15)", f"time.sleep({self.settle_s})"))
        command[0] = sys.executable if command[0] == "python3" else command[0]
        return command

    def remove_group(self, index: int) -> None:
        group = self.groups[index]
        group.terminating_at = time.monotonic()
        self.core.delete_namespaced_pod(group.pod, self.namespace)   # graceful: deletionTimestamp
        self.event("pod-terminating", index)
        self.write_status()
        threading.Thread(target=self._drain, args=(group,), daemon=True).start()

    def _drain(self, group: Group) -> None:
        hook = subprocess.run(self.prestop(group.index), capture_output=True, text=True, timeout=600)
        if hook.returncode != 0:
            self.errors.append(f"preStop of group {group.index}: {hook.returncode} {hook.stderr[-500:]}")
        self.event("prestop-done", group.index)
        end_process(group.sim)
        self.core.delete_namespaced_pod(group.pod, self.namespace, grace_period_seconds=0)
        with self.lock:
            del self.groups[group.index]
        self.event("pod-gone", group.index)

    # loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        last = None
        while not self.stop_event.is_set():
            try:
                want = self.spec_replicas()
                if want != last:
                    self.event(f"spec-{want}")
                    last = want
                with self.lock:
                    live = sorted(i for i, g in self.groups.items() if g.terminating_at is None)
                    busy = {i for i, g in self.groups.items() if g.terminating_at is not None}
                for index in range(want):
                    if index not in live and index not in busy:
                        self.start_group(index)
                for index in live[want:]:
                    self.remove_group(index)
            except Exception as exc:   # noqa: BLE001 - recorded; the test fails on it
                self.errors.append(repr(exc))
            self.stop_event.wait(0.2)

    def start(self) -> "Actuator":
        self.write_status()
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=5)
        for group in list(self.groups.values()):
            end_process(group.sim)


# ---- load through the picker -------------------------------------------------------------------

@dataclass
class Outcome:
    started: float
    ended: float
    endpoint: str | None
    status: int | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


class Load:
    """Stand-in for Envoy (the gateway does not run here): `concurrency` clients in a closed loop,
    each request asked of the picker over ext_proc (buffered body, as the gateway's
    EnvoyExtensionPolicy), sent to the endpoint the picker names, and its response handed back
    to the picker, as Envoy does. Every outcome is kept."""

    def __init__(self, picker_port: int, max_tokens: int, clients: int = 16):
        self.picker_port, self.max_tokens, self.clients = picker_port, max_tokens, clients
        self.concurrency = 0
        self.outcomes: list[Outcome] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="load", daemon=True)
        self.running = True

    def start(self) -> "Load":
        self.thread.start()
        self.future = asyncio.run_coroutine_threadsafe(self._main(), self.loop)
        return self

    async def _main(self) -> None:
        import aiohttp
        import grpc
        from tests.helpers import extproc_client as c
        # Reconnect within half a second of the picker coming back (gRPC's default backoff grows
        # to minutes; Envoy's ext_proc cluster reconnects on the next request).
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.picker_port}", options=[
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 500)])
        stub = c.ep_stub(channel)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            await asyncio.gather(*(self._client(i, c, stub, http) for i in range(self.clients)))
        await channel.close()

    async def _client(self, index: int, c, stub, http) -> None:
        while self.running:
            if index >= self.concurrency:
                await asyncio.sleep(0.05)
                continue
            outcome = await self._one(c, stub, http)
            self.outcomes.append(outcome)
            if not outcome.ok:     # e.g. the picker restarting: retry, not in a tight loop
                await asyncio.sleep(0.2)

    async def _one(self, c, stub, http) -> Outcome:
        started = time.monotonic()
        body = json.dumps({"model": "qwq", "prompt": "how many groups serve now", "max_tokens": self.max_tokens,
                           "ignore_eos": True}).encode()
        endpoint = None
        try:
            call, answers = await c.send_buffered(stub, c.post_headers(), body)
            last = answers[-1]
            if last.HasField("immediate_response"):
                await call.done_writing()
                return Outcome(started, time.monotonic(), None, last.immediate_response.status.code,
                               "picker answered at once")
            endpoint = c.lb_destination(last)
            sent = last.request_body.response.body_mutation.body or body
            async with http.post(f"http://{endpoint}/v1/completions", data=sent,
                                 headers={"content-type": "application/json"}) as response:
                answer, status = await response.read(), response.status
            await call.write(c.response_headers())
            await call.read()
            await call.write(c.response_body(answer, True))
            await call.read()
            await call.done_writing()
            return Outcome(started, time.monotonic(), endpoint, status)
        except Exception as exc:   # noqa: BLE001 - a failed request is an outcome
            return Outcome(started, time.monotonic(), endpoint, None, repr(exc)[:300])

    def stop(self) -> None:
        self.running = False
        try:
            self.future.result(timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
