"""KV-cache events: the leaders' --kv-events-config, their named ports, the Services and the
NetworkPolicies agree on every overlay, and each check fails on a fixture broken the way it
guards."""
from __future__ import annotations

import json

import pytest

from tests.policy.conftest import OVERLAYS, find, rendered
from validation import isolation, kv_events

OVERLAY = "overlays/a10"


def leader(objs, lws="qwq-dist-v1"):
    return find(objs, "LeaderWorkerSet", lws)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]


def set_config(container, change):
    args = container["args"]
    i = args.index("--kv-events-config") + 1
    config = json.loads(args[i])
    change(config)
    args[i] = json.dumps(config)


def policy(objs, name):
    return find(objs, "NetworkPolicy", name)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", kv_events.KV_EVENTS_CHECKS, ids=lambda c: c.__name__)
def test_kv_events_agree_on_every_overlay(overlay, check):
    assert check(rendered(overlay)) == []


def test_the_canary_leaders_publish_too():
    objs = rendered("overlays/a10-canary")
    assert "--kv-events-config" in leader(objs, "qwq-dist-v2")["args"]


def test_missing_flag_is_caught():
    objs = rendered(OVERLAY)
    args = leader(objs)["args"]
    i = args.index("--kv-events-config")
    del args[i:i + 2]
    assert any("has no --kv-events-config" in p for p in kv_events.kv_events_config_matches_ports(objs))


def test_bad_json_is_caught():
    objs = rendered(OVERLAY)
    args = leader(objs)["args"]
    args[args.index("--kv-events-config") + 1] = "{enable_kv_cache_events: true"
    assert any("not valid JSON" in p for p in kv_events.kv_events_config_matches_ports(objs))


def test_endpoint_with_a_host_is_caught():
    objs = rendered(OVERLAY)
    set_config(leader(objs), lambda c: c.update(endpoint="tcp://kv.example:5557"))
    problems = kv_events.kv_events_config_matches_ports(objs)
    assert any("endpoint" in p and "connects to it instead of binding" in p for p in problems)


def test_port_that_differs_from_the_named_container_port_is_caught():
    objs = rendered(OVERLAY)
    set_config(leader(objs), lambda c: c.update(replay_endpoint="tcp://*:5600"))
    problems = kv_events.kv_events_config_matches_ports(objs)
    assert any("replay_endpoint port 5600 != container port 'kv-replay' 5558" in p for p in problems)


def test_missing_named_port_is_caught():
    objs = rendered(OVERLAY)
    ports = leader(objs)["ports"]
    ports[:] = [p for p in ports if p["name"] != "kv-events"]
    assert any("no container port named 'kv-events'" in p
               for p in kv_events.kv_events_config_matches_ports(objs))


def test_disabled_events_and_topic_without_the_pod_are_caught():
    objs = rendered(OVERLAY)
    set_config(leader(objs), lambda c: c.update(enable_kv_cache_events=False, topic="kv"))
    problems = kv_events.kv_events_config_matches_ports(objs)
    assert any('"enable_kv_cache_events": true' in p for p in problems)
    assert any("does not name the pod" in p for p in problems)


def test_prefix_caching_off_is_caught():
    objs = rendered(OVERLAY)
    leader(objs)["args"].append("--no-enable-prefix-caching")
    assert any("without the prefix cache" in p for p in kv_events.kv_events_config_matches_ports(objs))


def test_a_service_exposing_the_event_port_is_caught():
    objs = rendered(OVERLAY)
    find(objs, "Service", "qwq-leaders")["spec"]["ports"].append(
        {"name": "kv", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"})
    problems = kv_events.kv_events_config_matches_ports(objs)
    assert any("Service" in p and "qwq-leaders" in p and "spec.ports[1]" in p for p in problems)


def test_envoy_allowed_on_the_event_ports_is_caught():
    objs = rendered(OVERLAY)
    envoy = policy(objs, "distributed-serving-api")["spec"]["ingress"][0]["from"][0]
    policy(objs, "distributed-serving-kv-events")["spec"]["ingress"][0]["from"].append(envoy)
    problems = kv_events.kv_events_isolated(objs)
    assert problems and all("from[1]" in p and "only the picker may connect" in p for p in problems)


def test_event_ports_open_to_every_source_are_caught():
    objs = rendered(OVERLAY)
    del policy(objs, "distributed-serving-kv-events")["spec"]["ingress"][0]["from"]
    assert any("admits every source to KV-cache event port 5557" in p
               for p in kv_events.kv_events_isolated(objs))


def test_picker_cut_off_from_the_events_is_caught():
    objs = [o for o in rendered(OVERLAY) if not (o.get("kind") == "NetworkPolicy" and
                                                  o["metadata"]["name"] == "distributed-serving-kv-events")]
    problems = kv_events.kv_events_isolated(objs)
    assert any("the picker cannot reach KV-cache event port 5557" in p for p in problems)
    assert any("the picker cannot reach KV-cache event port 5558" in p for p in problems)


def test_open_picker_egress_is_caught():
    objs = [o for o in rendered(OVERLAY) if not (o.get("kind") == "NetworkPolicy" and o["metadata"]["name"]
                                                  .startswith("inference-gateway-ext-proc-"))]
    assert any("no NetworkPolicy restricts the picker's egress" in p
               for p in kv_events.kv_events_isolated(objs))


def test_picker_egress_on_event_ports_to_anywhere_is_caught():
    objs = rendered(OVERLAY)
    egress = policy(objs, "inference-gateway-ext-proc-egress")["spec"]["egress"]
    egress[2]["ports"].append({"port": 5558, "protocol": "TCP"})      # the API server rule
    problems = kv_events.kv_events_isolated(objs)
    assert any("spec.egress[2].to[0]" in p and "5558" in p for p in problems)


def test_picker_egress_without_the_event_ports_is_caught():
    objs = rendered(OVERLAY)
    rule = policy(objs, "inference-gateway-ext-proc-egress")["spec"]["egress"][0]
    rule["ports"] = [p for p in rule["ports"] if p["port"] != "kv-replay"]
    assert any("do not let it reach the leaders on kv-replay (5558)" in p
               for p in kv_events.kv_events_isolated(objs))


def test_ray_check_still_flags_other_ports_from_the_picker():
    """The KV-event rule is exempt from the same-group check only for the event ports."""
    objs = rendered(OVERLAY)
    policy(objs, "distributed-serving-kv-events")["spec"]["ingress"][0]["ports"].append(
        {"port": 6379, "protocol": "TCP"})
    assert any("Ray/NCCL ports" in p for p in isolation.ray_ports_isolated(objs))


# ------------------------------------------------------------------ the picker's side

def picker(objs):
    return find(objs, "Deployment", "inference-gateway-ext-proc")["spec"]["template"]["spec"]


def test_the_picker_reads_the_tokenizer_from_the_model_volume():
    spec = picker(rendered(OVERLAY))
    args = spec["containers"][0]["args"]
    assert "--precise-prefix" in args and args[args.index("--tokenizer") + 1] == "/mnt/models"
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/mnt/models")
    assert mount["readOnly"] is True


def test_picker_port_that_differs_from_the_leaders_is_caught():
    objs = rendered(OVERLAY)
    args = picker(objs)["containers"][0]["args"]
    args[args.index("--kv-replay-port") + 1] = "6000"
    assert any("--kv-replay-port 6000 != the leaders' container port 'kv-replay' 5558" in p
               for p in kv_events.kv_events_config_matches_ports(objs))


def test_picker_default_port_is_checked_when_the_flag_is_absent():
    objs = rendered(OVERLAY)
    args = picker(objs)["containers"][0]["args"]
    i = args.index("--kv-events-port")
    del args[i:i + 2]
    leader(objs)["ports"][1]["containerPort"] = 5600
    set_config(leader(objs), lambda c: c.update(endpoint="tcp://*:5600"))
    assert any("--kv-events-port 5557 != the leaders' container port 'kv-events' 5600" in p
               for p in kv_events.kv_events_config_matches_ports(objs))


def test_precise_without_tokenizer_is_caught():
    objs = rendered(OVERLAY)
    args = picker(objs)["containers"][0]["args"]
    i = args.index("--tokenizer")
    del args[i:i + 2]
    assert any("--precise-prefix without --tokenizer" in p
               for p in kv_events.kv_events_config_matches_ports(objs))
    args.append("--no-precise-prefix")
    assert kv_events.kv_events_config_matches_ports(objs) == []


def test_tokenizer_off_the_model_volume_or_writable_is_caught():
    objs = rendered(OVERLAY)
    spec = picker(objs)
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/mnt/models")
    mount["readOnly"] = False
    assert any("must be mounted readOnly: true" in p for p in kv_events.kv_events_config_matches_ports(objs))
    spec["containers"][0]["volumeMounts"].remove(mount)
    assert any("--tokenizer /mnt/models is on no volume mount" in p
               for p in kv_events.kv_events_config_matches_ports(objs))
