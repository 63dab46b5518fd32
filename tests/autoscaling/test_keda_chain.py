"""The autoscaling chain run for real on loopback: Prometheus -> KEDA (operator + metrics API server,
v2.20.2) -> the HPA (kube-controller-manager v1.34.2) -> the LeaderWorkerSet's spec.replicas ->
groups that start and serve -> the picker (Kubernetes discovery) routes to them.

The ScaledObject is the one overlays/a10-autoscaling renders, with only what a local run must
change (LOCAL_CHANGES). Stand-ins, named: `Actuator` for the LeaderWorkerSet controller and the
kubelet (simulated vLLM groups, leader pods, the LeaderWorkerSet's status, the leader's preStop
hook run on scale-down), `Load` for Envoy in front of the picker (ext_proc as Envoy speaks it).

One test, in phases: rise -> a new group serves; then, each time with the load falling, the signal
made wrong: Prometheus stopped, no series (every leader's /metrics failing: stale series), NaN then
+Inf (one leader's page, a stand-in) -> the count holds (the HPA while the metric fails, then KEDA's
fallback), the signal mended; the picker killed and started again -> the count holds, no fallback,
the picker routes to every group; the load falls with the signal right -> down to the minimum after
the (shortened) window, the removed group drained; requests failed only while the picker was down."""
from __future__ import annotations

import copy
import json
import math
import re
import time
from datetime import datetime

import pytest

from tests.autoscaling.chain import StatusLog, group_ip
from tests.helpers.kube import STARTUP, wait_until
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


def query_value(chain: Chain, query: str) -> str | None:
    """The query's one value as Prometheus writes it ("NaN", "+Inf", "11"), None without a series."""
    result = chain.prometheus.query(query)
    return result[0]["value"][1] if result else None


def prometheus_answers(chain: Chain, query: str) -> bool:
    try:
        chain.prometheus.query(query)
        return True
    except OSError:
        return False


def scraped_since(target: dict, since: float) -> bool:
    """The target is up and was scraped after `since` (epoch seconds)."""
    # RFC 3339 with nanoseconds, which datetime does not read: the fraction is added apart
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", target.get("lastScrape", ""))
    if not m or target.get("health") != "up":
        return False
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + zone).timestamp() + float(m.group(2) or 0) > since


def restart_prometheus(chain: Chain, leaders: int) -> None:
    """Prometheus started again, and mended only once it has scraped every leader itself: until then
    its query answers from the samples of before the stop (its WAL keeps them and a stop writes no
    staleness markers), and a target moved away before its first scrape leaves them for 5 minutes."""
    chain.prometheus.start()
    started = time.time()
    wait_until(lambda: sum(scraped_since(t, started) for t in chain.prometheus.targets()) >= leaders, 30,
               "Prometheus scraped every leader after its restart", interval=0.2)


def scrape_leaders_at(chain: Chain, groups, mode: str | None) -> None:
    """Points Prometheus' targets of these groups' leaders at the stand-in /metrics page (in `mode`);
    the other leaders at their own pages."""
    chain.stand_in.mode = mode or "error"
    chain.discovery.scrape_at = {f"{chain.actuator.name}-{g}": chain.stand_in.address for g in groups}


def signal_state(chain: Chain) -> str:
    """What Prometheus has: the ScaledObject's query, its targets, the gauge per leader (for failures)."""
    query = chain.objects[("ScaledObject", "qwq-dist-v1")]["spec"]["triggers"][0]["metadata"]["query"]
    targets = [(t["scrapeUrl"], t["health"], t["labels"].get("pod")) for t in chain.prometheus.targets()]
    running = [(r["metric"].get("pod"), r["value"][1]) for r in chain.prometheus.query("vllm:num_requests_running")]
    return f"query {chain.prometheus.query(query)}, targets {targets}, running {running}, file_sd {chain.discovery.written}"


def hpa_failing(status: StatusLog, after: float) -> list:
    """The HPA's ScalingActive conditions with status False seen since `after`."""
    return [v for v in status.seen("hpa", after) if v and v[0] == "False"]


def hold_while_signal_is_wrong(chain: Chain, load, status: StatusLog, raised: int, target: float, name: str,
                               break_signal, mend_signal, signal_is_wrong, keda_error: str, midway=None) -> dict:
    """The signal goes wrong (`break_signal`, until `signal_is_wrong()`), then the load falls to LOW:
    the count holds at `raised` for longer than the scale-down window + period, the HPA reported
    the metric failing, KEDA's operator logged `keda_error` for its query, KEDA's fallback answers
    `raised` x target. `midway` (action, check, KEDA's error) changes the wrong signal once the
    fallback is active. Then the signal is mended and the load raised,
    until KEDA reads the signal again and it asks for `raised` groups."""
    began = time.monotonic()
    log_from = chain.keda.log_size("keda-operator")
    break_signal()
    try:
        wait_until(signal_is_wrong, 30, f"{name}: the signal is wrong", interval=0.2)
    except pytest.fail.Exception:
        print(f"{name}: after {time.monotonic() - began:.1f} s, {signal_state(chain)}")
        raise
    load.concurrency = LOW
    fell = time.monotonic()
    t_wrong = fell - began
    wait_until(lambda: condition(scaled_object(chain), "Fallback").get("status") == "True", 60,
               f"{name}: KEDA's fallback is active", interval=0.2)
    t_fallback = time.monotonic() - fell
    errors = [keda_error]
    if midway is not None:
        midway[0]()
        wait_until(midway[1], 30, f"{name}: the signal changes midway", interval=0.2)
        errors.append(midway[2])
    time.sleep(max(0.0, fell + DOWN_WINDOW_S + DOWN_PERIOD_S + 2 - time.monotonic()))
    held_s = time.monotonic() - fell
    changes = spec_values(chain, began, time.monotonic())
    assert chain.actuator.spec_replicas() == raised and changes == [], (name, changes)
    metric = external_metric(chain)
    assert metric == raised * target, (name, metric)          # behavior currentReplicas
    failing = hpa_failing(status, began)
    assert failing and {v[1] for v in failing} == {"FailedGetExternalMetric"}, (name, status.seen("hpa", began))
    health = json.loads(status.seen("health", began)[-1])
    logged = chain.keda.log_since("keda-operator", log_from)
    assert all(e in logged for e in errors), (name, errors, logged[-2000:])
    print(f"{name}: query wrong after {t_wrong:.1f} s, KEDA's fallback active {t_fallback:.1f} s later, count "
          f"held at {raised} for {held_s:.1f} s after the load fell (KEDA answers {metric:g} = {raised} x "
          f"{target:g}); HPA ScalingActive False {failing[0][1]}: ...{failing[0][2][-160:]}; KEDA health: {health}")
    mend_signal()
    load.concurrency = HIGH
    mended = time.monotonic()
    wait_until(lambda: condition(scaled_object(chain), "Fallback").get("status") == "False"
               and (external_metric(chain) or 0) > (raised - 1) * target, 90,
               f"{name}: KEDA reads the signal again", interval=0.2)
    assert chain.actuator.spec_replicas() == raised and spec_values(chain, began, time.monotonic()) == []
    chain.check_running()
    return {"wrong_s": round(t_wrong, 2), "fallback_s": round(t_fallback, 2), "held_s": round(held_s, 2),
            "mended_s": round(time.monotonic() - mended, 2), "hpa_reason": failing[0][1]}


def hold_through_picker_restart(chain: Chain, load, status: StatusLog, raised: int, query: str) -> dict:
    """The picker killed and started again under HIGH load: the signal (vLLM's gauges) never
    fails, so the HPA's metric never fails and KEDA never falls back; the count holds for longer
    than the window + period; the new picker lists every group and each serves a request."""
    groups = [f"{group_ip(g)}:8000" for g in range(raised)]
    killed = chain.restart_picker()
    wait_until(lambda: chain.picker.serving(), STARTUP, "the restarted picker serves", interval=0.2)
    serving = time.monotonic()
    wait_until(lambda: chain.picker.endpoints() == groups, 60, "the restarted picker lists every group",
               interval=0.2)
    listed = time.monotonic()
    values = []
    while time.monotonic() < killed + DOWN_WINDOW_S + DOWN_PERIOD_S + 2:
        values.append(query_value(chain, query))
        time.sleep(0.5)
    for g in range(raised):
        wait_until(lambda: served_by(load, group_ip(g), listed), 30, f"group {g} serves after the restart",
                   interval=0.2)
    changes = spec_values(chain, killed, time.monotonic())
    assert chain.actuator.spec_replicas() == raised and changes == [], changes
    assert None not in values and all(math.isfinite(float(v)) for v in values), values
    fallback = [v for v in status.seen("fallback", killed) if v[0] == "True"]
    assert fallback == [] and hpa_failing(status, killed) == [], (fallback, status.seen("hpa", killed))
    low_signal = min(float(v) for v in values)
    print(f"picker restart: serving {serving - killed:.1f} s after the kill, every group listed after "
          f"{listed - killed:.1f} s; count held at {raised} for {time.monotonic() - killed:.1f} s; the query "
          f"answered throughout (lowest {low_signal:g} in flight), no fallback, the HPA's metric never failed")
    chain.check_running()
    return {"outage": (killed, serving), "serving_s": round(serving - killed, 2),
            "listed_s": round(listed - killed, 2), "lowest_signal": low_signal}


def test_the_chain_scales_groups_with_the_load_holds_when_the_signal_is_wrong_and_drains_on_the_way_down(chain, load, record_property):
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

    status = StatusLog(chain.api, NAMESPACE, HPA, "qwq-dist-v1").start()
    try:
        timeline = {}
        # Each case below: the signal goes wrong, then the load falls; the count must hold at
        # `raised` for longer than the scale-down window + period, KEDA's fallback answering with
        # the current count; then the signal is mended and the load raised again (the count stays).
        timeline["prometheus_stopped"] = hold_while_signal_is_wrong(
            chain, load, status, raised, target, "Prometheus stopped", chain.prometheus.stop,
            lambda: restart_prometheus(chain, raised), lambda: not prometheus_answers(chain, query),
            "connection refused")
        timeline["no_series"] = hold_while_signal_is_wrong(
            chain, load, status, raised, target, "every leader's /metrics failing (no series)",
            lambda: scrape_leaders_at(chain, range(raised), "error"), lambda: scrape_leaders_at(chain, [], None),
            lambda: chain.prometheus.query(query) == [], "the result is empty")
        timeline["nan_then_inf"] = hold_while_signal_is_wrong(
            chain, load, status, raised, target, "one leader's gauge NaN, then +Inf",
            lambda: scrape_leaders_at(chain, [0], "nan"), lambda: scrape_leaders_at(chain, [], None),
            lambda: query_value(chain, query) == "NaN", "prometheus query returns NaN",
            midway=(lambda: scrape_leaders_at(chain, [0], "inf"), lambda: query_value(chain, query) == "+Inf",
                    "prometheus query returns +Inf"))
        timeline["picker_restart"] = hold_through_picker_restart(chain, load, status, raised, query)
    finally:
        status.stop()

    # Signal right, load low: down one group per period to the minimum after the window; drained.
    load.concurrency = LOW
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
    # Not before the window: the HPA recommended `raised` until the load fell (and some seconds
    # after: the requests in flight end over ~3 s, then a scrape and a poll).
    assert first_down >= DOWN_WINDOW_S - HPA_SYNC_S, first_down
    time.sleep(3)
    load.stop()
    failed = [o for o in load.outcomes if not o.ok]
    outage = timeline["picker_restart"]["outage"]
    # Only while the picker was down (Envoy answers those with an error as well).
    assert all(outage[0] - 0.5 <= o.ended <= outage[1] + 2 for o in failed), failed[:5]
    assert sorted(chain.picker.endpoints()) == [f"{group_ip(g)}:8000" for g in range(low)]
    chain.check_running()
    print(f"load low, signal right: first group removed after {first_down:.1f} s, minimum after {t_down:.1f} s, "
          f"last removed group gone after {t_gone:.1f} s; {len(load.outcomes)} requests, {len(failed)} failed, "
          f"all while the picker was down")
    record_property("timeline", json.dumps({      # `python -m bench keda-chain` reads it
        "spec_up_s": round(t_spec, 2), "listed_s": round(t_listed, 2), "routed_s": round(t_routed, 2), "served_s": round(t_served, 2),
        "raised_to": raised, "fallback_s": timeline["prometheus_stopped"]["fallback_s"],
        "cases": {k: {n: v for n, v in c.items() if n != "outage"} for k, c in timeline.items()},
        "first_down_s": round(first_down, 2),
        "min_s": round(t_down, 2), "gone_s": round(t_gone, 2), "requests": len(load.outcomes),
        "failed": len(failed), "changes": {k: list(v) for k, v in changes.items()}}))


@pytest.fixture
def load(chain):
    from tests.autoscaling.chain import Load
    running = Load(chain.picker.grpc_port, MAX_TOKENS).start()
    yield running
    if running.running:
        running.stop()
