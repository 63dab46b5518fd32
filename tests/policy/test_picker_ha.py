"""Picker replicas route as one (validation/picker_ha.py): every overlay holds, and each check
fails on a fixture broken the way it guards."""
from __future__ import annotations

import pytest

from tests.policy.conftest import OVERLAYS, ROOT, find, rendered
from validation import picker_ha, rules

OVERLAY = "overlays/a10"
PICKER = "inference-gateway-ext-proc"


def deployment(objs):
    return find(objs, "Deployment", PICKER)


def args(objs):
    return deployment(objs)["spec"]["template"]["spec"]["containers"][0]["args"]


def role(objs):
    return find(objs, "Role", PICKER)


def problems(objs):
    return [p for check in picker_ha.PICKER_HA_CHECKS for p in check(objs)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_routes_as_one(overlay):
    assert problems(rendered(overlay)) == []


def test_the_rules_run_on_overlays():
    assert set(picker_ha.PICKER_HA_CHECKS) <= set(rules.rules_for(OVERLAY))


def test_base_runs_two_replicas_active_passive():
    objs = rendered(OVERLAY)
    assert deployment(objs)["spec"]["replicas"] == 2
    assert picker_ha.leader_election_on(args(objs))
    assert picker_ha.lease_of(deployment(objs), deployment(objs)["spec"]["template"]["spec"]
                              ["containers"][0]) == ("llm", "reasoning-pool-picker")


def test_replicas_without_leader_election_fail():
    objs = rendered(OVERLAY)
    args(objs).remove("--leader-election")
    found = picker_ha.picker_replicas_route_as_one(objs)
    assert len(found) == 1 and "spec.replicas 2 without --leader-election" in found[0], found


def test_no_leader_election_after_it_fails_too():
    objs = rendered(OVERLAY)
    args(objs).append("--no-leader-election")
    assert picker_ha.picker_replicas_route_as_one(objs) != []


def test_active_active_on_purpose_passes():
    objs = rendered(OVERLAY)
    args(objs).remove("--leader-election")
    deployment(objs)["metadata"].setdefault("annotations", {})[picker_ha.HA_MODE_ANNOTATION] = "active-active"
    assert problems(objs) == []


def test_one_replica_needs_nothing():
    objs = rendered(OVERLAY)
    args(objs).remove("--leader-election")
    deployment(objs)["spec"]["replicas"] = 1
    assert problems(objs) == []


@pytest.mark.parametrize("mode,elected", [("active-active", True), ("active-passive", False),
                                          ("hot-standby", True)])
def test_the_annotation_must_say_what_runs(mode, elected):
    objs = rendered(OVERLAY)
    if not elected:
        args(objs).remove("--leader-election")
    deployment(objs)["metadata"].setdefault("annotations", {})[picker_ha.HA_MODE_ANNOTATION] = mode
    found = picker_ha.picker_replicas_route_as_one(objs)
    assert len(found) == 1 and picker_ha.HA_MODE_ANNOTATION in found[0], found


def _without_lease_rules(objs):
    role(objs)["rules"] = [r for r in role(objs)["rules"] if "leases" not in r["resources"]]


@pytest.mark.parametrize("break_it,missing", [
    (_without_lease_rules, "get/update/create"),
    (lambda objs: [r.update(resourceNames=["other-lease"]) for r in role(objs)["rules"]
                   if r["resources"] == ["leases"] and "get" in r["verbs"]], "get/update"),
    (lambda objs: [r["verbs"].remove("update") for r in role(objs)["rules"]
                   if r["resources"] == ["leases"] and "update" in r["verbs"]], "update"),
    # create with resourceNames is never granted by the API server (no name is known yet)
    (lambda objs: [r.update(resourceNames=["reasoning-pool-picker"]) for r in role(objs)["rules"]
                   if r["verbs"] == ["create"]], "create"),
    (lambda objs: args(objs).extend(["--leader-election-lease-name", "renamed"]), "get/update"),
], ids=["no-lease-rules", "other-resource-name", "no-update", "create-by-name", "renamed-lease"])
def test_a_role_short_of_the_lease_verbs_fails(break_it, missing):
    objs = rendered(OVERLAY)
    break_it(objs)
    found = picker_ha.picker_leader_election_works(objs)
    assert len(found) == 1 and f"may not {missing} the Lease" in found[0], found


def test_the_role_must_be_bound_to_the_pickers_service_account():
    objs = rendered(OVERLAY)
    find(objs, "RoleBinding", PICKER)["subjects"][0]["name"] = "someone-else"
    found = picker_ha.picker_leader_election_works(objs)
    assert len(found) == 1 and "ServiceAccount inference-gateway-ext-proc may not" in found[0], found


@pytest.mark.parametrize("strategy", [None, {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}])
def test_a_rollout_that_keeps_the_leader_fails(strategy):
    objs = rendered(OVERLAY)
    if strategy is None:
        del deployment(objs)["spec"]["strategy"]     # the default: maxUnavailable 25%
    else:
        deployment(objs)["spec"]["strategy"] = strategy
    found = picker_ha.picker_leader_election_works(objs)
    assert len(found) == 1 and "maxUnavailable" in found[0] and "stuck" in found[0], found


def test_recreate_passes():
    objs = rendered(OVERLAY)
    deployment(objs)["spec"]["strategy"] = {"type": "Recreate"}
    assert picker_ha.picker_leader_election_works(objs) == []


@pytest.mark.parametrize("budget", [{"minAvailable": 1}, {"maxUnavailable": 1}, {"maxUnavailable": "50%"}])
def test_a_budget_that_pins_the_leader_fails(budget):
    objs = rendered(OVERLAY)
    spec = find(objs, "PodDisruptionBudget", PICKER)["spec"]
    spec.pop("maxUnavailable", None)
    spec.update(budget)
    found = picker_ha.picker_leader_election_works(objs)
    assert len(found) == 1 and "drain waits on it forever" in found[0], found


def test_the_shared_view_component_runs_active_active_on_purpose(tmp_path):
    """components/picker-shared-view (in no overlay now): active-active with Redis, and the rule
    holds on it (annotation, leader election off, a budget that keeps one replica)."""
    import os
    import subprocess

    import yaml
    rel = os.path.relpath(ROOT, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{rel}/base/picker]\ncomponents: [{rel}/components/picker-shared-view]\n")
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True,
                         check=True).stdout
    objs = [o for o in yaml.safe_load_all(out) if o]
    assert problems(objs) == []
    assert not picker_ha.leader_election_on(args(objs)) and "--peer-store" in args(objs)
    assert find(objs, "PodDisruptionBudget", PICKER)["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_deployed_flags_parse_and_name_the_lease_the_rule_checks(overlay, monkeypatch):
    """The picker's own parser accepts the Deployment's arguments, and the Lease it would compete
    for is the one validation/picker_ha.py checks the Role against."""
    from picker.config import lease_settings, parse_args
    objs = rendered(overlay)
    d = deployment(objs)
    container = d["spec"]["template"]["spec"]["containers"][0]
    namespace = d["metadata"]["namespace"]
    argv = [a.replace("$(POD_NAMESPACE)", namespace) for a in container["args"]]
    monkeypatch.setenv("POD_NAME", "picker-0")
    settings = lease_settings(parse_args(argv))
    assert settings is not None
    assert (settings.namespace, settings.name) == picker_ha.lease_of(d, container)


# --- failover Envoy sees at once (picker_failover_visible)

def ext_proc(objs):
    return find(objs, "EnvoyExtensionPolicy", "reasoning-inference-picker")["spec"]["extProc"][0]


def failover(objs):
    return picker_ha.picker_failover_visible(objs)


def test_base_links_its_replicas_and_lets_envoy_see_them_all():
    objs = rendered(OVERLAY)
    assert failover(objs) == []
    assert "--peers" in args(objs) and ext_proc(objs)["backendSettings"]["healthCheck"]["active"][
        "grpc"]["service"] == "envoy.service.ext_proc.v3.ExternalProcessor"


def test_replicas_without_the_link_fail():
    objs = rendered(OVERLAY)
    args(objs).extend(["--peers", ""])          # the last --peers wins, as in argparse
    found = failover(objs)
    assert len(found) == 1 and "no --peers" in found[0], found


def test_a_link_through_a_service_that_hides_the_standby_fails():
    objs = rendered(OVERLAY)
    del find(objs, "Service", "inference-gateway-ext-proc-replicas")["spec"][
        "publishNotReadyAddresses"]
    found = failover(objs)
    # both the link and the gateway's Backend go through that Service
    assert len(found) == 2 and all("publishNotReadyAddresses" in p for p in found), found


def test_a_backend_on_the_clusterip_service_fails():
    objs = rendered(OVERLAY)
    find(objs, "Backend", PICKER)["spec"]["endpoints"][0]["fqdn"]["hostname"] = \
        "inference-gateway-ext-proc.llm.svc.cluster.local"
    found = failover(objs)
    assert len(found) == 1 and "not headless" in found[0], found


def test_a_network_policy_that_cuts_the_link_fails():
    objs = rendered(OVERLAY)
    policy = find(objs, "NetworkPolicy", PICKER)
    policy["spec"]["ingress"] = [r for r in policy["spec"]["ingress"]
                                 if 9005 not in [p.get("port") for p in r.get("ports") or []]]
    found = failover(objs)
    assert len(found) == 1 and "(Ingress)" in found[0] and "9005" in found[0], found


@pytest.mark.parametrize("change,expected", [
    (lambda hc: hc["active"].update(type="TCP"), "only the acting leader answers SERVING"),
    (lambda hc: hc["active"]["grpc"].update(service="liveness"), "only the acting leader"),
    (lambda hc: hc["active"].update(overrides={"port": 9003}), "no overrides.port"),
    (lambda hc: hc["active"].update(interval="3s"), "exceed the picker's --drain-seconds"),
    (lambda hc: hc.pop("panicThreshold"), "unset (50 %)"),
    (lambda hc: hc.update(panicThreshold=0), "must be above 0"),
    (lambda hc: hc.update(panicThreshold=50), "below 100 / 2 replicas"),
])
def test_a_health_check_envoy_cannot_fail_over_on_fails(change, expected):
    objs = rendered(OVERLAY)
    change(ext_proc(objs)["backendSettings"]["healthCheck"])
    found = failover(objs)
    assert len(found) == 1 and expected in found[0], found


def test_three_replicas_need_a_lower_panic_threshold_than_half():
    objs = rendered(OVERLAY)
    deployment(objs)["spec"]["replicas"] = 3
    ext_proc(objs)["backendSettings"]["healthCheck"]["panicThreshold"] = 34
    assert any("below 100 / 3 replicas" in p for p in failover(objs))


def test_no_retry_on_connect_failure_fails():
    objs = rendered(OVERLAY)
    ext_proc(objs)["backendSettings"]["retry"]["retryOn"]["triggers"] = ["reset"]
    found = failover(objs)
    assert len(found) == 1 and "connect-failure" in found[0], found


def test_a_drain_shorter_than_a_health_check_fails():
    objs = rendered(OVERLAY)
    args(objs).extend(["--drain-seconds", "0.2"])
    found = failover(objs)
    assert len(found) == 1 and "--drain-seconds 0.2" in found[0], found


def test_a_health_check_without_the_no_traffic_cadence_fails():
    objs = rendered(OVERLAY)
    patch = find(objs, "EnvoyPatchPolicy", "picker-health-check-cadence")
    patch["spec"]["jsonPatches"][0]["operation"]["value"] = "60s"
    found = failover(objs)
    assert len(found) == 1 and "no_traffic_interval" in found[0], found
    patch["spec"]["jsonPatches"][0]["name"] = "envoyextensionpolicy/default/reasoning-inference-picker/extproc/0"
    patch["spec"]["jsonPatches"][0]["operation"]["value"] = "0.1s"
    assert len(failover(objs)) == 1          # another namespace's cluster: not this one


def test_a_health_check_without_a_host_name_authority_fails():
    objs = rendered(OVERLAY)
    patch = find(objs, "EnvoyPatchPolicy", "picker-health-check-cadence")
    authority = next(p for p in patch["spec"]["jsonPatches"]
                     if p["operation"]["path"].endswith("/grpc_health_check/authority"))
    authority["operation"]["value"] = "envoyextensionpolicy/llm/reasoning-inference-picker/extproc/0"
    found = failover(objs)
    assert len(found) == 1 and "authority" in found[0], found
    patch["spec"]["jsonPatches"].remove(authority)
    found = failover(objs)
    assert len(found) == 1 and "authority" in found[0] and "none" in found[0], found


def test_envoy_gateway_accepts_the_patch_in_the_cluster_and_on_the_local_stack(tmp_path):
    """The cadence patch is an EnvoyPatchPolicy: Envoy Gateway ignores one unless enabled."""
    import yaml

    from local import dataplane
    assert find(rendered(OVERLAY), "EnvoyPatchPolicy", "picker-health-check-cadence")
    app = yaml.safe_load((ROOT / "argocd" / "apps" / "envoy-gateway.yaml").read_text())
    apis = app["spec"]["source"]["helm"]["valuesObject"]["config"]["envoyGateway"]["extensionApis"]
    assert apis["enableEnvoyPatchPolicy"] is True
    local = dataplane.envoy_gateway_config(dataplane.Layout(tmp_path))
    assert local["extensionApis"]["enableEnvoyPatchPolicy"] is True


def test_retries_without_the_previous_hosts_predicate_fail():
    objs = rendered(OVERLAY)
    patch = find(objs, "EnvoyPatchPolicy", "picker-retry-other-replica")
    predicate = patch["spec"]["jsonPatches"][0]["operation"]
    predicate["value"] = [{"name": "envoy.retry_host_predicates.omit_canary_hosts"}]
    found = failover(objs)
    assert len(found) == 1 and "previous_hosts" in found[0] and "llm/inference-gateway/llm-gw" in found[0], found
    predicate["value"] = [{"name": "envoy.retry_host_predicates.previous_hosts"}]
    patch["spec"]["jsonPatches"][0]["name"] = "llm/inference-gateway/http"     # the other listener
    assert len(failover(objs)) == 1
    patch["spec"]["jsonPatches"][0]["name"] = "llm/inference-gateway/llm-gw"
    predicate["jsonPath"] = predicate["jsonPath"].replace("extproc/0", "extproc/1")   # another filter
    assert len(failover(objs)) == 1
    patch["spec"]["jsonPatches"].pop(0)
    assert len(failover(objs)) == 1

