"""The autoscaling chain run for real on loopback: Prometheus -> KEDA (operator + metrics API server,
v2.20.2) -> the HPA (kube-controller-manager v1.34.2) -> the LeaderWorkerSet's spec.replicas ->
groups that start and serve -> the picker (Kubernetes discovery) routes to them.

The ScaledObject is the one overlays/a10-autoscaling renders, with only what a local run must
change (LOCAL_CHANGES). Stand-ins, named: `Actuator` for the LeaderWorkerSet controller and the
kubelet (simulated vLLM groups, leader pods, the LeaderWorkerSet's status, the leader's preStop
hook run on scale-down), `Load` for Envoy in front of the picker (ext_proc as Envoy speaks it).

One test, in phases: rise -> a new group serves; Prometheus stopped while the load falls -> the
count holds (the HPA while the metric fails, then KEDA's fallback); Prometheus back -> down to the
minimum after the (shortened) window, the removed group drained, no request failed."""
from __future__ import annotations

import copy
import json
import math
import time

import pytest

from tests.apiserver.conftest import wait_until
from tests.autoscaling.chain import group_ip
from tests.autoscaling.conftest import HPA_SYNC_S, NAMESPACE, SCRAPE, Chain

pytestmark = pytest.mark.timeout(600)

POLLING_S = 2            # ScaledObject pollingInterval (15 s shipped)
DOWN_WINDOW_S = 10       # HPA scaleDown stabilizationWindowSeconds (600 s shipped)
DOWN_PERIOD_S = 10       # HPA scaleDown policy periodSeconds (300 s shipped; still one group per period)
MAX_TOKENS = 30          # each request decodes 30 tokens: ~2.7 s on the simulator's a10 engine model
HPA = "keda-hpa-qwq-dist-v1"   # the HPA KEDA makes of the ScaledObject
LOW, HIGH = 2, 11        # concurrent requests: below one group's target / ~2.75 groups' worth


def local_scaled_object(shipped: dict, prometheus_url: str) -> tuple[dict, dict]:
    """The shipped ScaledObject with the changes a local run needs, and those changes by path."""
    so = copy.deepcopy(shipped)
    spec = so["spec"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    trigger = spec["triggers"][0]["metadata"]
    changes = {
        # kube-prometheus-stack's Service in the cluster; here the test's Prometheus on loopback.
        "triggers[0].metadata.serverAddress": (trigger["serverAddress"], prometheus_url),
        "pollingInterval": (spec["pollingInterval"], POLLING_S),
        "behavior.scaleDown.stabilizationWindowSeconds": (behavior["scaleDown"]["stabilizationWindowSeconds"],
                                                          DOWN_WINDOW_S),
        "behavior.scaleDown.policies[0].periodSeconds": (behavior["scaleDown"]["policies"][0]["periodSeconds"],
                                                         DOWN_PERIOD_S),
    }
    trigger["serverAddress"] = prometheus_url
    spec["pollingInterval"] = POLLING_S
    behavior["scaleDown"]["stabilizationWindowSeconds"] = DOWN_WINDOW_S
    behavior["scaleDown"]["policies"][0]["periodSeconds"] = DOWN_PERIOD_S
    return so, changes


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def scaled_object(chain: Chain) -> dict:
    from kubernetes import client
    return client.CustomObjectsApi(chain.api).get_namespaced_custom_object(
        "keda.sh", "v1alpha1", NAMESPACE, "scaledobjects", "qwq-dist-v1")


def external_metric(chain: Chain) -> float | None:
    """What KEDA's metrics API server answers the HPA, read through the aggregator as the HPA does."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    hpa = client.AutoscalingV2Api(chain.api).read_namespaced_horizontal_pod_autoscaler(HPA, NAMESPACE)
    name = hpa.spec.metrics[0].external.metric.name        # the metric KEDA named in its HPA
    try:   # the external metrics API's path has the shape of a custom resource list
        reply = client.CustomObjectsApi(chain.api).list_namespaced_custom_object(
            "external.metrics.k8s.io", "v1beta1", NAMESPACE, name,
            label_selector="scaledobject.keda.sh/name=qwq-dist-v1")
    except ApiException:
        return None
    value = reply["items"][0]["value"]
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def served_by(load, ip: str, after: float) -> list:
    return [o for o in load.outcomes if o.ok and o.endpoint == f"{ip}:8000" and o.started >= after]


def spec_values(chain: Chain, start: float, end: float) -> list[int]:
    return [int(w[5:]) for t, w, _ in chain.actuator.events if w.startswith("spec-") and start <= t <= end]


def test_the_chain_scales_groups_with_the_load_holds_without_prometheus_and_drains_on_the_way_down(chain, load, record_property):
    shipped = chain.objects[("ScaledObject", "qwq-dist-v1")]
    low, high = shipped["spec"]["minReplicaCount"], shipped["spec"]["maxReplicaCount"]
    target = float(shipped["spec"]["triggers"][0]["metadata"]["threshold"])
    so, changes = local_scaled_object(shipped, chain.prometheus.url)
    print("\nScaledObject changed for the local run: "
          + "; ".join(f"{k}: {a} -> {b}" for k, (a, b) in changes.items())
          + f"; HPA sync {HPA_SYNC_S} s, scrape {SCRAPE}")
    # Prometheus scrapes the running group with the PodMonitor's labels: the query has an answer.
    query = shipped["spec"]["triggers"][0]["metadata"]["query"]
    wait_until(lambda: chain.prometheus.query(query), 30, "Prometheus answers the ScaledObject's query")
    from validation.apiserver import ServerSideApply
    applied = time.monotonic()
    ServerSideApply(chain.api).apply(so, dry_run=False)

    # KEDA takes the ScaledObject, makes its HPA, which raises the LeaderWorkerSet to the minimum.
    wait_until(lambda: condition(scaled_object(chain), "Ready").get("status") == "True", 60,
               "KEDA reports the ScaledObject Ready")
    from kubernetes import client
    hpa = client.AutoscalingV2Api(chain.api).read_namespaced_horizontal_pod_autoscaler(HPA, NAMESPACE)
    assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (low, high)
    assert hpa.spec.metrics[0].external.target.average_value == shipped["spec"]["triggers"][0]["metadata"]["threshold"]
    assert hpa.spec.behavior.scale_down.stabilization_window_seconds == DOWN_WINDOW_S
    wait_until(lambda: sorted(chain.picker.endpoints()) == [f"{group_ip(g)}:8000" for g in range(low)], 90,
               f"the picker routes to {low} groups")
    chain.check_running()
    print(f"minimum ({low} groups) serving {time.monotonic() - applied:.1f} s after the ScaledObject was applied")
    load.concurrency = LOW
    wait_until(lambda: len([o for o in load.outcomes if o.ok]) >= 4, 30, "low load served")
    steady = time.monotonic()
    time.sleep(4 * HPA_SYNC_S + 2)
    assert chain.actuator.spec_replicas() == low and spec_values(chain, steady, time.monotonic()) == []
    metric = external_metric(chain)
    assert metric is not None and metric <= low * target, metric

    # Rise: in flight ~HIGH -> ceil(HIGH / target) groups; the new group starts, the picker routes to it.
    load.concurrency = HIGH
    rise = time.monotonic()
    wait_until(lambda: chain.actuator.spec_replicas() > low, 60, "spec.replicas rises")
    t_spec = time.monotonic() - rise
    wait_until(lambda: f"{group_ip(low)}:8000" in chain.picker.endpoints(), 60, "the picker lists the new group")
    t_listed = time.monotonic() - rise
    wait_until(lambda: served_by(load, group_ip(low), rise), 60, "a request served by the new group")
    t_routed = min(o.started for o in served_by(load, group_ip(low), rise)) - rise
    t_served = min(o.ended for o in served_by(load, group_ip(low), rise)) - rise
    raised = chain.actuator.spec_replicas()
    assert low < raised <= min(high, math.ceil(HIGH / target)), raised
    print(f"rise: spec.replicas {low} -> {raised} after {t_spec:.1f} s, new group listed by the picker after "
          f"{t_listed:.1f} s, first request sent to it after {t_routed:.1f} s and answered by it after {t_served:.1f} s "
          f"(KEDA's metric {external_metric(chain)})")
    chain.check_running()

    # Signal gone: Prometheus stopped and the load falls; the count holds, KEDA falls back.
    chain.prometheus.stop()
    load.concurrency = LOW
    gone = time.monotonic()
    wait_until(lambda: condition(scaled_object(chain), "Fallback").get("status") == "True", 60,
               "KEDA's fallback is active")
    t_fallback = time.monotonic() - gone
    time.sleep(DOWN_WINDOW_S + DOWN_PERIOD_S + 2)
    held = spec_values(chain, gone, time.monotonic())
    assert chain.actuator.spec_replicas() == raised and held == [], held
    fallback_metric = external_metric(chain)
    assert fallback_metric == raised * target, fallback_metric   # behavior currentReplicas
    print(f"Prometheus stopped: fallback after {t_fallback:.1f} s, count held at {raised} for "
          f"{time.monotonic() - gone:.1f} s (KEDA answers {fallback_metric} = {raised} x {target:g})")

    # Signal back, load low: down one group per period to the minimum after the window; drained.
    restart = time.monotonic()
    chain.prometheus.start()
    back = time.monotonic()
    wait_until(lambda: chain.actuator.first(f"spec-{low}", after=back) is not None,
               DOWN_WINDOW_S + DOWN_PERIOD_S * (raised - low) + 60, "spec.replicas back at the minimum")
    t_down = chain.actuator.first(f"spec-{low}", after=back) - back
    wait_until(lambda: chain.actuator.first("pod-gone", low, after=back) is not None, 60,
               "the removed group drained and gone")
    t_gone = chain.actuator.first("pod-gone", low, after=back) - back
    downs = spec_values(chain, back, time.monotonic())
    assert downs == list(range(raised - 1, low - 1, -1)), downs          # one group at a time
    first_down = chain.actuator.first(f"spec-{raised - 1}", after=back) - back
    # Not before the window: the HPA's last recommendation for `raised` (KEDA's fallback, every
    # sync while Prometheus was down) came at most one sync before the restart began.
    assert first_down + (back - restart) >= DOWN_WINDOW_S - HPA_SYNC_S, (first_down, back - restart)
    time.sleep(3)
    load.stop()
    failed = [o for o in load.outcomes if not o.ok]
    assert failed == [], failed[:5]
    assert sorted(chain.picker.endpoints()) == [f"{group_ip(g)}:8000" for g in range(low)]
    chain.check_running()
    print(f"Prometheus back: first group removed after {first_down:.1f} s, minimum after {t_down:.1f} s, "
          f"last removed group gone after {t_gone:.1f} s; {len(load.outcomes)} requests, none failed")
    record_property("timeline", json.dumps({      # `python -m bench keda-chain` reads it
        "spec_up_s": round(t_spec, 2), "listed_s": round(t_listed, 2), "routed_s": round(t_routed, 2), "served_s": round(t_served, 2),
        "raised_to": raised, "fallback_s": round(t_fallback, 2), "first_down_s": round(first_down, 2),
        "min_s": round(t_down, 2), "gone_s": round(t_gone, 2), "requests": len(load.outcomes),
        "failed": len(failed), "changes": {k: list(v) for k, v in changes.items()}}))


@pytest.fixture
def load(chain):
    from tests.autoscaling.chain import Load
    running = Load(chain.picker.grpc_port, MAX_TOKENS).start()
    yield running
    if running.running:
        running.stop()
