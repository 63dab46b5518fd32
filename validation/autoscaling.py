"""Autoscaling checks (components/autoscaling): a KEDA ScaledObject on a LeaderWorkerSet must scale
something that exists, never lose groups because its signal is gone, and let a removed group
finish the longest request the routes allow.

KEDA semantics relied on (v2.20, pkg/scalers/prometheus_scaler.go, pkg/fallback/fallback.go): the
Prometheus trigger answers an empty result, NaN or Inf with 0 when `ignoreNullValues` is true (its
default), which the HPA reads as "no load"; with "false" they are errors, and after
`fallback.failureThreshold` errors KEDA answers the HPA with `fallback.behavior`'s count.
"""
from __future__ import annotations

from validation.gateway import seconds
from validation.manifests import name_of, ns_of, of_kind, pod_templates
from validation.problems import describe

LWS_API = "leaderworkerset.x-k8s.io/v1"
HOLDING_FALLBACKS = ("currentReplicas", "currentReplicasIfHigher")
DRAIN_MARGIN_S = 60          # the picker's watch and Envoy's endpoint update take seconds
MIN_SCALE_DOWN_WINDOW_S = 300


def _spec(obj) -> dict:
    return obj.get("spec") or {}


def scaled_lws(objs) -> dict[tuple[str, str], dict]:
    """(namespace, LeaderWorkerSet name) -> the ScaledObject that scales it."""
    out = {}
    for so in of_kind(objs, "ScaledObject"):
        ref = _spec(so).get("scaleTargetRef") or {}
        if ref.get("kind") == "LeaderWorkerSet":
            out[(ns_of(so), ref.get("name", ""))] = so
    return out


def max_groups(objs, lws: dict) -> int:
    """The most groups a LeaderWorkerSet can have: its autoscaler's maximum, else spec.replicas."""
    so = scaled_lws(objs).get((ns_of(lws), name_of(lws)))
    replicas = int(_spec(lws).get("replicas", 1))
    if so is None:
        return replicas
    return max(replicas, int(_spec(so).get("maxReplicaCount", 100)))   # KEDA's default maximum


def scaler_targets_exist(objs):
    """scaleTargetRef names a LeaderWorkerSet (apiVersion and kind) of the ScaledObject's namespace."""
    problems = []
    lws = {(ns_of(o), name_of(o)) for o in of_kind(objs, "LeaderWorkerSet")}
    for so in of_kind(objs, "ScaledObject"):
        ref = _spec(so).get("scaleTargetRef") or {}
        if ref.get("kind") != "LeaderWorkerSet" or ref.get("apiVersion") != LWS_API:
            problems.append(f"{describe(so)}: spec.scaleTargetRef must be apiVersion {LWS_API}, kind "
                            f"LeaderWorkerSet (got {ref.get('apiVersion')!r}, {ref.get('kind')!r})")
        elif (ns_of(so), ref.get("name")) not in lws:
            problems.append(f"{describe(so)}: spec.scaleTargetRef.name: no LeaderWorkerSet "
                            f"{ref.get('name')!r} in namespace {ns_of(so)}")
    return problems


def scaled_lws_leaves_replicas(objs):
    """A LeaderWorkerSet the HPA scales sets no spec.replicas: Argo CD would put it back at each sync."""
    scaled = scaled_lws(objs)
    return [f"{describe(lws)}: spec.replicas is set but {describe(scaled[(ns_of(lws), name_of(lws))])} "
            f"owns the group count (Argo CD and the HPA would fight over it): remove it"
            for lws in of_kind(objs, "LeaderWorkerSet")
            if (ns_of(lws), name_of(lws)) in scaled and "replicas" in _spec(lws)]


def scaler_holds_without_signal(objs):
    """The group count never drops because the signal is gone or wrong: at least one group, every
    Prometheus trigger fails on an empty/NaN answer, and the fallback holds the current count."""
    problems = []
    for so in of_kind(objs, "ScaledObject"):
        spec, where = _spec(so), describe(so)
        low, high = int(spec.get("minReplicaCount", 0)), int(spec.get("maxReplicaCount", 100))
        if low < 1:
            problems.append(f"{where}: spec.minReplicaCount {low}: a model group takes minutes to start, "
                            f"keep at least 1")
        if high < low:
            problems.append(f"{where}: spec.maxReplicaCount {high} < minReplicaCount {low}")
        for i, trigger in enumerate(spec.get("triggers") or []):
            meta = trigger.get("metadata") or {}
            if trigger.get("type") == "prometheus" and str(meta.get("ignoreNullValues", "true")).lower() != "false":
                problems.append(f"{where}: spec.triggers[{i}].metadata.ignoreNullValues must be \"false\": "
                                f"otherwise an empty or NaN answer reads as no load and the HPA scales "
                                f"down to the minimum")
        fallback = spec.get("fallback")
        if not fallback:
            problems.append(f"{where}: spec.fallback is missing: when the signal fails the HPA gets no "
                            f"metric and KEDA offers no count; set behavior currentReplicas")
        elif fallback.get("behavior", "static") not in HOLDING_FALLBACKS:
            problems.append(f"{where}: spec.fallback.behavior {fallback.get('behavior', 'static')!r} "
                            f"sets a count unrelated to the current one; use one of {HOLDING_FALLBACKS}")
    return problems


def scale_down_is_gradual(objs):
    """The HPA removes at most one group per policy period, after a stabilization window."""
    problems = []
    for so in of_kind(objs, "ScaledObject"):
        behavior = ((_spec(so).get("advanced") or {}).get("horizontalPodAutoscalerConfig") or {}).get("behavior") or {}
        down, where = behavior.get("scaleDown"), f"{describe(so)}: spec.advanced.horizontalPodAutoscalerConfig.behavior.scaleDown"
        if not down:
            problems.append(f"{where} is missing: the HPA's default removes every surplus group at once")
            continue
        window = down.get("stabilizationWindowSeconds")
        if window is None or int(window) < MIN_SCALE_DOWN_WINDOW_S:
            problems.append(f"{where}.stabilizationWindowSeconds {window}: at least "
                            f"{MIN_SCALE_DOWN_WINDOW_S} s, or a lull between bursts removes groups")
        for i, p in enumerate(down.get("policies") or []):
            if p.get("type") != "Pods" or int(p.get("value", 0)) != 1:
                problems.append(f"{where}.policies[{i}]: {p.get('type')} {p.get('value')}: remove one "
                                f"group per period (type Pods, value 1)")
        if not down.get("policies"):
            problems.append(f"{where}.policies: none: remove one group per period (type Pods, value 1)")
    return problems


def _longest_request_s(objs) -> float:
    timeouts = [seconds(((_spec(p).get("timeout") or {}).get("http") or {}).get("requestTimeout"))
                for p in of_kind(objs, "BackendTrafficPolicy")]
    return max([t for t in timeouts if t is not None], default=0.0)


def drain_covers_longest_request(objs):
    """Pods of a scaled LeaderWorkerSet: a grace period >= the routes' longest request + margin, and
    a leader preStop that waits for vLLM to finish (else SIGTERM cuts running generations)."""
    scaled = scaled_lws(objs)
    need = _longest_request_s(objs) + DRAIN_MARGIN_S
    problems = []
    for t in pod_templates(objs):
        if t.owner.get("kind") != "LeaderWorkerSet" or (ns_of(t.owner), name_of(t.owner)) not in scaled:
            continue
        grace = t.spec.get("terminationGracePeriodSeconds", 30)
        if grace < need:
            problems.append(f"{t.where}.spec.terminationGracePeriodSeconds {grace} < {need:.0f} (the "
                            f"routes' requestTimeout + {DRAIN_MARGIN_S} s): a removed group cuts "
                            f"generations still running")
        containers = t.spec.get("containers") or []
        if not containers or not ((containers[0].get("lifecycle") or {}).get("preStop")):
            problems.append(f"{t.where}.spec.containers[0].lifecycle.preStop is missing: the kubelet "
                            f"sends SIGTERM at once and the group stops mid-generation")
    return problems


AUTOSCALING_CHECKS = [scaler_targets_exist, scaled_lws_leaves_replicas, scaler_holds_without_signal,
                      scale_down_is_gradual, drain_covers_longest_request]
