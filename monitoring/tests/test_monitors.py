"""The PodMonitors select the pods the overlay deploys, on ports those pods declare."""
from __future__ import annotations

from pathlib import Path

import pytest

from validation.render import render

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = "overlays/a10-monitoring"


@pytest.fixture(scope="module")
def objects():
    result = render(ROOT, OVERLAY, ROOT)   # the CRD directory is only read for base/crds
    assert not result.problems, [str(p) for p in result.problems]
    return result.objects


def pod_templates(objects):
    """(workload, pod template) for every pod the overlay creates, LWS leaders and workers apart."""
    for o in objects:
        spec = o.get("spec") or {}
        if o["kind"] == "Deployment":
            yield f"Deployment {o['metadata']['name']}", spec["template"]
        elif o["kind"] == "LeaderWorkerSet":
            lws = spec["leaderWorkerTemplate"]
            yield f"LWS {o['metadata']['name']} leader", lws.get("leaderTemplate") or lws["workerTemplate"]
            yield f"LWS {o['metadata']['name']} worker", lws["workerTemplate"]


def selected(objects, monitor):
    match = monitor["spec"]["selector"]["matchLabels"]
    return [(name, t) for name, t in pod_templates(objects)
            if match.items() <= ((t.get("metadata") or {}).get("labels") or {}).items()]


def monitors(objects):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "PodMonitor"}


@pytest.mark.parametrize("name,expected", [
    ("vllm-leaders", {"LWS qwq-dist-v1 leader"}),
    ("picker", {"Deployment inference-gateway-ext-proc"}),
])
def test_in_namespace_monitors_select_their_pods_by_a_declared_port(objects, name, expected):
    monitor = monitors(objects)[name]
    pods = selected(objects, monitor)
    assert {n for n, _ in pods} == expected
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        for _, template in pods:
            ports = {p.get("name") for c in template["spec"]["containers"] for p in c.get("ports", [])}
            assert endpoint["port"] in ports


def test_envoy_monitor_selects_the_envoy_pods_the_picker_admits(objects):
    """Envoy Gateway creates the Envoy pods; the picker's NetworkPolicy names the same labels."""
    monitor = monitors(objects)["envoy-proxy"]
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy"
                  and o["metadata"]["name"] == "inference-gateway-ext-proc")
    peer = policy["spec"]["ingress"][0]["from"][0]
    assert monitor["spec"]["selector"]["matchLabels"] == peer["podSelector"]["matchLabels"]
    namespace = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [namespace]
    assert monitor["spec"]["podMetricsEndpoints"][0]["portNumber"] == 19001


def test_every_monitor_sets_the_job_label_the_alerts_use(objects):
    jobs = {name: [r["replacement"] for r in m["spec"]["podMetricsEndpoints"][0]["relabelings"]
                   if r.get("targetLabel") == "job"] for name, m in monitors(objects).items()}
    assert jobs == {"vllm-leaders": ["vllm"], "picker": ["picker"], "envoy-proxy": ["envoy"]}
