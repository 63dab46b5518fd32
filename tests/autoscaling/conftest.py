"""The whole autoscaling chain on loopback, one per module: etcd + kube-apiserver (aggregator with a
front-proxy client certificate, loopback Service range) and kube-controller-manager's HPA
controller (tests/apiserver), KEDA's operator and metrics API server (`make autoscaling-tools`),
Prometheus (Debian's) scraping the leader pods found on the API server with the vllm-leaders
PodMonitor's rules, the actuator (stand-in for the LeaderWorkerSet controller and the kubelet)
and the picker with Kubernetes discovery. `make test-autoscaling` (not part of `make test`)."""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from monitoring.local_prometheus import Prometheus, pod_discovery_jobs
from tests.helpers.kube import (ETCD, KUBE_APISERVER, KUBE_CONTROLLER_MANAGER, NAMESPACE, ROOT, STARTUP, Picker,
                                end_process,
                                start_hpa_controller, wait_until)
from tests.autoscaling.chain import (KEDA_ADAPTER, KEDA_NAMESPACE, KEDA_OPERATOR, Actuator, Keda,
                                     LeaderMetricsStandIn, PodDiscovery, keda_crds_dir,
                                     write_certificates)
from validation.apiserver import ControlPlane, ServerSideApply, ensure_namespaces, free_port, install_crds, render_targets
from validation.cli import default_crds_dir

OVERLAY = "overlays/a10-autoscaling"
HPA_SYNC_S = 1          # kube-controller-manager --horizontal-pod-autoscaler-sync-period (15 s in a cluster)
SCRAPE = "1s"           # Prometheus' scrape interval (the PodMonitor's: 15 s)
SIM_ARGS = ("--speedup", "1")


@dataclass
class Chain:
    plane: ControlPlane
    api: object
    objects: dict
    keda: Keda
    prometheus: Prometheus
    actuator: Actuator
    picker: Picker
    workdir: Path
    discovery: PodDiscovery
    stand_in: LeaderMetricsStandIn

    def restart_picker(self) -> float:
        """Kills the picker (SIGKILL: no goodbye) and starts it again on the same ports, as its
        Deployment would; returns when the kill happened."""
        ports = (self.picker.grpc_port, self.picker.health_port, self.picker.metrics_port)
        self.picker.proc.kill()
        killed = time.monotonic()
        self.picker.stop()
        self.picker = Picker(self.picker.kubeconfig, self.workdir / f"picker-{time.time():.0f}.log", ports)
        return killed

    def check_running(self) -> None:
        self.keda.check_running()
        assert not self.actuator.errors, self.actuator.errors


def rendered_objects() -> dict:
    rendered = render_targets(ROOT, default_crds_dir(ROOT).resolve(), [OVERLAY])[OVERLAY]
    assert not rendered.problems, rendered.problems
    return {(o["kind"], o["metadata"]["name"]): o for o in rendered.objects}


def install_chain_crds(api) -> None:
    crds = default_crds_dir(ROOT).resolve()
    for pattern in ("lws-*", "gateway-api-inference-extension-*", "llm-d-router-*"):
        (folder,) = sorted(crds.glob(pattern))
        install_crds(api, folder)
    install_crds(api, keda_crds_dir())


def require_tools() -> None:
    for binary in (KEDA_OPERATOR, KEDA_ADAPTER):
        if not binary.is_file():   # not built by `make setup`: this module is not part of `make test`
            pytest.skip(f"{binary} is missing: `make test-autoscaling` builds it (`make autoscaling-tools`)")
    for binary in (KUBE_APISERVER, KUBE_CONTROLLER_MANAGER):
        if not binary.is_file():
            pytest.fail(f"{binary} is missing: `make apiserver-tools` builds it")
    for exe, package in ((ETCD, "etcd-server"), ("prometheus", "prometheus")):
        if shutil.which(exe) is None:
            pytest.fail(f"{exe} is not on PATH (Debian's {package}; `make autoscaling-tools` installs it)")


def apply_serving_objects(api, objects: dict) -> None:
    """The namespaces and what the picker and the HPA read: the pool, objectives and rewrite, and
    the LeaderWorkerSet as the overlay renders it (no spec.replicas: the HPA owns it)."""
    from kubernetes import client
    ensure_namespaces(api, [NAMESPACE, KEDA_NAMESPACE])
    client.CoreV1Api(api).create_namespaced_service_account(NAMESPACE, {"metadata": {"name": "default"}})
    sa = ServerSideApply(api)
    for key in (("InferencePool", "reasoning-pool"), ("InferenceObjective", "batch"),
                ("InferenceObjective", "interactive"), ("InferenceModelRewrite", "qwq"),
                ("LeaderWorkerSet", "qwq-dist-v1")):
        sa.apply(objects[key], dry_run=False)


@pytest.fixture(scope="module")
def chain():
    require_tools()
    # Not pytest's tmp_path: other pytest sessions on the machine prune those while this one runs.
    workdir = Path(tempfile.mkdtemp(prefix="keda-chain-"))
    print(f"\nlogs in {workdir}")
    certs = write_certificates(workdir)
    plane = ControlPlane(workdir, KUBE_APISERVER, ETCD, service_cidr="127.0.100.0/24",
                         extra_args=("--enable-aggregator-routing=false", *certs.apiserver_args)).start()
    kcm = keda = discovery = prometheus = actuator = picker = stand_in = built = None
    try:
        api = plane.api_client()
        install_chain_crds(api)
        objects = rendered_objects()
        apply_serving_objects(api, objects)
        kubeconfig = plane.kubeconfig(workdir / "kubeconfig", namespace=NAMESPACE)
        kcm = start_hpa_controller(kubeconfig, workdir, HPA_SYNC_S)
        keda = Keda(workdir, kubeconfig, certs).start()
        keda.register(api)
        (workdir / "discovery").mkdir()    # a folder of its own: Prometheus watches the file's folder
        discovery = PodDiscovery(api, NAMESPACE, workdir / "discovery" / "pods.json").start()
        prometheus = Prometheus(workdir, {
            "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE},
            "scrape_configs": pod_discovery_jobs(objects[("PodMonitor", "vllm-leaders")],
                                                 str(workdir / "discovery" / "pods.json"), SCRAPE)}, free_port()).start()
        lws = objects[("LeaderWorkerSet", "qwq-dist-v1")]
        actuator = Actuator(api, NAMESPACE, lws, workdir, SIM_ARGS).start()
        picker = Picker(kubeconfig, workdir / "picker.log")
        wait_until(lambda: picker.serving() is not None, STARTUP, "the picker's health server")
        stand_in = LeaderMetricsStandIn().start()
        built = Chain(plane, api, objects, keda, prometheus, actuator, picker, workdir, discovery, stand_in)
        yield built
    finally:
        picker = built.picker if built is not None else picker   # the restarted one, if it was
        for part in (picker, stand_in, actuator, prometheus, discovery, keda):
            if part is not None:
                try:
                    part.stop()
                except Exception as exc:   # noqa: BLE001 - stop the rest regardless
                    print(f"stopping {type(part).__name__}: {exc!r}")
        if kcm is not None:
            end_process(kcm)
        plane.stop()
        for data in (workdir / "etcd", workdir / "prometheus" / "data"):   # the logs stay
            shutil.rmtree(data, ignore_errors=True)
