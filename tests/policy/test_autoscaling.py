"""Autoscaling (components/autoscaling via overlays/a10-autoscaling): each rule holds on every
overlay, fails on a fixture broken the way it guards, and isolation follows the scale."""
from __future__ import annotations

import pytest

from validation import autoscaling, isolation
from tests.policy.conftest import OVERLAYS, find, rendered

OVERLAY = "overlays/a10-autoscaling"
LWS = "qwq-dist-v1"


def scaled_object(objs):
    return find(objs, "ScaledObject", LWS)


def lws_template(objs, role):
    return find(objs, "LeaderWorkerSet", LWS)["spec"]["leaderWorkerTemplate"][f"{role}Template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", autoscaling.AUTOSCALING_CHECKS, ids=lambda c: c.__name__)
def test_autoscaling_rules_hold(overlay, check):
    assert check(rendered(overlay)) == []


def test_the_overlay_scales_the_stable_lws():
    objs = rendered(OVERLAY)
    assert set(autoscaling.scaled_lws(objs)) == {("llm", LWS)}
    assert autoscaling.max_groups(objs, find(objs, "LeaderWorkerSet", LWS)) == 6


# ------------------------------------------------------------------ the target

def test_target_that_does_not_exist_is_caught():
    objs = rendered(OVERLAY)
    scaled_object(objs)["spec"]["scaleTargetRef"]["name"] = "qwq-dist-v9"
    assert autoscaling.scaler_targets_exist(objs) == [
        "ScaledObject llm/qwq-dist-v1: spec.scaleTargetRef.name: no LeaderWorkerSet 'qwq-dist-v9' "
        "in namespace llm"]


def test_target_of_another_kind_is_caught():
    objs = rendered(OVERLAY)
    scaled_object(objs)["spec"]["scaleTargetRef"]["apiVersion"] = "apps/v1"
    assert any("must be apiVersion leaderworkerset.x-k8s.io/v1" in p
               for p in autoscaling.scaler_targets_exist(objs))


def test_replicas_left_in_the_lws_is_caught():
    objs = rendered(OVERLAY)
    find(objs, "LeaderWorkerSet", LWS)["spec"]["replicas"] = 3
    problems = autoscaling.scaled_lws_leaves_replicas(objs)
    assert len(problems) == 1 and "spec.replicas is set" in problems[0] and "fight" in problems[0]


# ------------------------------------------------------------------ the signal gone or wrong

def test_empty_answer_read_as_zero_is_caught():
    objs = rendered(OVERLAY)
    del scaled_object(objs)["spec"]["triggers"][0]["metadata"]["ignoreNullValues"]   # KEDA: true
    problems = autoscaling.scaler_holds_without_signal(objs)
    assert len(problems) == 1 and "spec.triggers[0].metadata.ignoreNullValues" in problems[0]


@pytest.mark.parametrize("fallback, message", [
    (None, "spec.fallback is missing"),
    ({"failureThreshold": 3, "replicas": 2}, "behavior 'static'"),
    ({"failureThreshold": 3, "replicas": 2, "behavior": "currentReplicasIfLower"}, "'currentReplicasIfLower'"),
])
def test_fallback_that_does_not_hold_the_count_is_caught(fallback, message):
    objs = rendered(OVERLAY)
    spec = scaled_object(objs)["spec"]
    spec.pop("fallback")
    if fallback:
        spec["fallback"] = fallback
    problems = autoscaling.scaler_holds_without_signal(objs)
    assert len(problems) == 1 and message in problems[0]


def test_scale_to_zero_and_inverted_bounds_are_caught():
    objs = rendered(OVERLAY)
    spec = scaled_object(objs)["spec"]
    spec["minReplicaCount"], spec["maxReplicaCount"] = 0, -1
    problems = autoscaling.scaler_holds_without_signal(objs)
    assert any("minReplicaCount 0" in p for p in problems)
    assert any("maxReplicaCount -1 < minReplicaCount 0" in p for p in problems)


# ------------------------------------------------------------------ scale-down

def test_scale_down_faster_than_one_group_is_caught():
    objs = rendered(OVERLAY)
    down = scaled_object(objs)["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    down["policies"][0]["value"] = 2
    down["stabilizationWindowSeconds"] = 60
    problems = autoscaling.scale_down_is_gradual(objs)
    assert len(problems) == 2
    assert any("stabilizationWindowSeconds 60" in p for p in problems)
    assert any("policies[0]: Pods 2" in p for p in problems)


def test_missing_scale_down_behaviour_is_caught():
    objs = rendered(OVERLAY)
    del scaled_object(objs)["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert any("removes every surplus group at once" in p for p in autoscaling.scale_down_is_gradual(objs))


def test_grace_period_shorter_than_the_longest_request_is_caught():
    objs = rendered(OVERLAY)
    lws_template(objs, "worker")["terminationGracePeriodSeconds"] = 60
    problems = autoscaling.drain_covers_longest_request(objs)
    assert len(problems) == 1 and "workerTemplate" in problems[0] and "60 < 3660" in problems[0]


def test_longer_route_timeout_needs_a_longer_grace_period():
    objs = rendered(OVERLAY)
    for p in autoscaling.of_kind(objs, "BackendTrafficPolicy"):
        http = p["spec"].get("timeout", {}).get("http", {})
        if "requestTimeout" in http:
            http["requestTimeout"] = "2h"
    problems = autoscaling.drain_covers_longest_request(objs)
    assert len(problems) == 2 and all("3660 < 7260" in p for p in problems)


def test_leader_without_drain_is_caught():
    objs = rendered(OVERLAY)
    del lws_template(objs, "leader")["containers"][0]["lifecycle"]
    problems = autoscaling.drain_covers_longest_request(objs)
    assert len(problems) == 1 and "leaderTemplate.spec.containers[0].lifecycle.preStop" in problems[0]


# ------------------------------------------------------------------ isolation follows the scale

def test_every_group_up_to_the_maximum_is_checked():
    pods = list(isolation.lws_pods(rendered(OVERLAY)))
    assert {(p.group, p.template.role) for p in pods} == {(g, r) for g in range(6) for r in ("leader", "worker")}


def test_per_group_policies_under_the_autoscaler_are_caught():
    """Today's per-group policies leave groups 3..5 (added by the HPA) closed: they cannot form."""
    objs = [o for o in rendered(OVERLAY) if o["metadata"]["name"] != f"{LWS}-groups"]
    objs += [g for g in rendered("overlays/a10") if g["kind"] == "NetworkPolicy"
             and g["metadata"]["name"].startswith(f"{LWS}-group-")]
    problems = isolation.ray_ports_isolated(objs)
    assert {p.split(" (group ")[1][0] for p in problems} == {"3", "4", "5"}
    assert all("add a policy admitting the pods of qwq-dist-v1" in p for p in problems)


def test_lws_policy_open_to_other_model_pods_is_caught():
    objs = rendered(OVERLAY)
    peer = find(objs, "NetworkPolicy", f"{LWS}-groups")["spec"]["ingress"][0]["from"][0]
    peer["podSelector"] = {"matchLabels": {"app": "distributed-serving"}}
    problems = isolation.ray_ports_isolated(objs)
    assert problems and all("only pods of LeaderWorkerSet qwq-dist-v1 may connect" in p
                            or "cannot reach every port" in p for p in problems)
    assert any(p.startswith(f"NetworkPolicy llm/{LWS}-groups spec.ingress[0].from[0]") for p in problems)
