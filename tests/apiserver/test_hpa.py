"""The HPA of components/autoscaling on the real controllers it runs on: kube-controller-manager's
HPA controller (v1.34.2, same Go module as the API server) scales the LeaderWorkerSet's
spec.replicas through its scale subresource on the real kube-apiserver, from an External metric
served through the API server's aggregator, with the shipped ScaledObject's bounds, target and
behaviour (as KEDA renders them into the HPA).

Stand-ins, named: `MetricsStandIn` answers external.metrics.k8s.io in place of KEDA's metrics API
server (KEDA itself does not run here), and `lws_status` writes the LeaderWorkerSet's status
(replicas, hpaPodSelector) in place of the LeaderWorkerSet controller. The aggregator reaches the
stand-in on loopback: the API server's Service range is 127.0.100.0/24, the APIService's Service has
the stand-in's address as ClusterIP (aggregator routing off), and an EndpointSlice with a
placeholder address (never dialled) satisfies the APIService's availability check."""
from __future__ import annotations

import http.server
import json
import os
import ssl
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml

from tests.helpers.kube import ETCD, KUBE_APISERVER, KUBE_CONTROLLER_MANAGER, ROOT, start_hpa_controller, wait_until
from validation.apiserver import ControlPlane, install_crds
from validation.cli import default_crds_dir

SCALED_OBJECT = yaml.safe_load((ROOT / "components/autoscaling/scaledobject.yaml").read_text())
STANDIN_IP = "127.0.100.10"   # the stand-in's address and its Service's ClusterIP
LWS = ("leaderworkerset.x-k8s.io", "v1", "default", "leaderworkersets", "qwq-dist-v1")
SYNC_S = 1          # --horizontal-pod-autoscaler-sync-period (15 s in a cluster)


class MetricsStandIn:
    """Stand-in for KEDA's metrics API server: one external metric, its value set by the test;
    `fail` answers 500, as KEDA's adapter does while its scaler fails and before its fallback."""

    def __init__(self, workdir: Path):
        self.value, self.fail, self.queries = 0.0, False, 0
        key, cert = workdir / "standin.key", workdir / "standin.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "1", "-subj", "/CN=keda-metrics.default.svc"],
                       check=True, capture_output=True)
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                path = urllib.parse.urlparse(self.path).path
                if path.endswith("/v1beta1"):
                    body = {"kind": "APIResourceList", "apiVersion": "v1",
                            "groupVersion": "external.metrics.k8s.io/v1beta1",
                            "resources": [{"name": "*", "namespaced": True,
                                           "kind": "ExternalMetricValueList", "verbs": ["get"]}]}
                elif "/namespaces/" in path:
                    standin.queries += 1
                    if standin.fail:
                        self.send_response(500)
                        self.end_headers()
                        return
                    body = {"kind": "ExternalMetricValueList", "apiVersion": "external.metrics.k8s.io/v1beta1",
                            "metadata": {}, "items": [{
                                "metricName": path.rsplit("/", 1)[1], "metricLabels": {},
                                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "value": f"{int(standin.value * 1000)}m"}]}
                else:
                    body = {"kind": "APIGroupList", "apiVersion": "v1", "groups": []}
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((STANDIN_IP, 0), Handler)   # a free port
        self.port = self.server.server_address[1]
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def register(self, api) -> None:
        from kubernetes import client
        client.CoreV1Api(api).create_namespaced_service("default", {
            "metadata": {"name": "keda-metrics"},
            "spec": {"clusterIP": STANDIN_IP, "ports": [{"port": self.port}]}})
        client.DiscoveryV1Api(api).create_namespaced_endpoint_slice("default", {
            "metadata": {"name": "keda-metrics-1", "labels": {"kubernetes.io/service-name": "keda-metrics"}},
            "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}],
            "ports": [{"port": self.port}]})
        client.ApiregistrationV1Api(api).create_api_service({
            "metadata": {"name": "v1beta1.external.metrics.k8s.io"},
            "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1", "insecureSkipTLSVerify": True,
                     "service": {"namespace": "default", "name": "keda-metrics", "port": self.port},
                     "groupPriorityMinimum": 100, "versionPriority": 100}})

    def stop(self) -> None:
        self.server.shutdown()


def hpa_from_scaled_object(so: dict, scale_down_window_s: int | None = None) -> dict:
    """The HPA KEDA makes of the ScaledObject (its name, target, bounds, metric and behaviour)."""
    spec, trigger = so["spec"], so["spec"]["triggers"][0]
    behavior = json.loads(json.dumps(spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]))
    if scale_down_window_s is not None:
        behavior["scaleDown"]["stabilizationWindowSeconds"] = scale_down_window_s
        behavior["scaleDown"]["policies"][0]["periodSeconds"] = 1
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": f"keda-hpa-{so['metadata']['name']}"},
            "spec": {"scaleTargetRef": spec["scaleTargetRef"], "minReplicas": spec["minReplicaCount"],
                     "maxReplicas": spec["maxReplicaCount"], "behavior": behavior,
                     "metrics": [{"type": "External", "external": {
                         "metric": {"name": "s0-prometheus", "selector": {"matchLabels": {
                             "scaledobject.keda.sh/name": so["metadata"]["name"]}}},
                         "target": {"type": "AverageValue", "averageValue": trigger["metadata"]["threshold"]}}}]}}




@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """API server (loopback Service range, aggregator routing off), the LWS CRD, the metrics
    stand-in behind an APIService, kube-controller-manager running only its HPA controller."""
    from kubernetes import client
    for binary in (KUBE_APISERVER, KUBE_CONTROLLER_MANAGER):
        if not binary.is_file():
            pytest.fail(f"{binary} is missing: `make tools` builds it (tools/kube-apiserver)")
    workdir = tmp_path_factory.mktemp("hpa")
    plane = ControlPlane(workdir, KUBE_APISERVER, ETCD, service_cidr="127.0.100.0/24",
                         extra_args=("--enable-aggregator-routing=false",)).start()
    standin = kcm = None
    try:
        api = plane.api_client()
        install_crds(api, (Path(os.environ["CRDS_DIR"]) if os.environ.get("CRDS_DIR")
                           else default_crds_dir(ROOT)).resolve() / "lws-v0.10.0")
        standin = MetricsStandIn(workdir)
        standin.register(api)
        kcm = start_hpa_controller(plane.kubeconfig(workdir / "kubeconfig"), workdir, SYNC_S)
        yield api, standin, client.CustomObjectsApi(api), client.AutoscalingV2Api(api)
    finally:
        if kcm:
            kcm.terminate()
            kcm.wait(timeout=10)
        if standin:
            standin.stop()
        plane.stop()


def lws_status(custom, replicas: int) -> None:
    """Stand-in for the LeaderWorkerSet controller: the groups exist, and the HPA's selector."""
    custom.patch_namespaced_custom_object_status(*LWS, {"status": {
        "replicas": replicas, "readyReplicas": replicas,
        "hpaPodSelector": "leaderworkerset.sigs.k8s.io/name=qwq-dist-v1,leaderworkerset.sigs.k8s.io/worker-index=0"}})


def spec_replicas(custom) -> int:
    return custom.get_namespaced_custom_object(*LWS)["spec"]["replicas"]


def follow(custom, seconds: float) -> list[int]:
    """spec.replicas every 0.2 s for `seconds`, the stand-in controller following each change."""
    seen, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append(spec_replicas(custom))
        lws_status(custom, seen[-1])
        time.sleep(0.2)
    return seen


def condition(hpas, type_: str):
    hpa = hpas.read_namespaced_horizontal_pod_autoscaler("keda-hpa-qwq-dist-v1", "default")
    return next((c for c in hpa.status.conditions or [] if c.type == type_), None)


def test_the_hpa_follows_the_signal_holds_without_it_and_never_drops_below_the_minimum(chain):
    api, standin, custom, hpas = chain
    target = float(SCALED_OBJECT["spec"]["triggers"][0]["metadata"]["threshold"])
    low = SCALED_OBJECT["spec"]["minReplicaCount"]
    custom.create_namespaced_custom_object(*LWS[:4], {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {"name": LWS[4]},
        "spec": {"replicas": low, "leaderWorkerTemplate": {"size": 2, "workerTemplate": {
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]}}}}})
    lws_status(custom, low)
    standin.value = target * low                     # at target: the count stays
    hpas.create_namespaced_horizontal_pod_autoscaler("default", hpa_from_scaled_object(SCALED_OBJECT, 3))
    wait_until(lambda: standin.queries >= 2, 30, "the HPA reads the external metric")
    assert set(follow(custom, 3 * SYNC_S)) == {low}

    # Load: in flight = 2.5 groups' worth above the count -> ceil(v / target) groups, in one sync.
    standin.value = target * (low + 1.5)
    raised = time.monotonic()
    wait_until(lambda: (lws_status(custom, spec_replicas(custom)), spec_replicas(custom))[1] == low + 2,
               10 * SYNC_S, "scale-up on the LeaderWorkerSet")
    print(f"\nscale-up visible on spec.replicas {time.monotonic() - raised:.1f} s after the metric rose "
          f"(HPA sync {SYNC_S} s)")

    # Signal gone: the metric API answers 500; the count holds and the HPA says why.
    standin.fail = True
    queries = standin.queries
    held = follow(custom, 5 * SYNC_S)
    assert standin.queries > queries and set(held) == {low + 2}
    assert condition(hpas, "ScalingActive").reason == "FailedGetExternalMetric"

    # Signal back at zero load: down one group per period, never below the minimum.
    standin.fail, standin.value = False, 0.0
    seen = follow(custom, 8 * SYNC_S)
    steps = [b - a for a, b in zip(seen, seen[1:]) if b != a]
    assert seen[-1] == low and all(s == -1 for s in steps), seen
