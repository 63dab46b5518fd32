"""NetworkPolicies and securityContext: each isolation rule holds on every overlay, and each check
fails on a fixture broken the way it guards."""
from __future__ import annotations

import pytest

from validation import isolation
from tests.policy.conftest import OVERLAYS, find, rendered

OVERLAY = "overlays/a10"


def policy(objs, name):
    return find(objs, "NetworkPolicy", name)


def leader_spec(objs, lws="qwq-dist-v1"):
    return find(objs, "LeaderWorkerSet", lws)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", isolation.ISOLATION_CHECKS, ids=lambda c: c.__name__)
def test_isolation_holds(overlay, check):
    assert check(rendered(overlay)) == []


def test_every_group_of_every_lws_is_checked():
    pods = list(isolation.lws_pods(rendered("overlays/a10-canary")))
    groups = {(p.labels[isolation.LWS_NAME], p.group, p.template.role) for p in pods}
    assert groups == {(lws, g, role) for lws, n in (("qwq-dist-v1", 3), ("qwq-dist-v2", 1))
                      for g in range(n) for role in ("leader", "worker")}


# ------------------------------------------------------------------ vLLM port 8000

def test_no_policy_on_vllm_is_caught():
    objs = [o for o in rendered(OVERLAY) if o.get("kind") != "NetworkPolicy"
            or not o["metadata"]["name"].startswith(("distributed-serving", "qwq-dist"))]
    problems = isolation.vllm_api_isolated(objs)
    assert any("any pod can call vLLM on 8000" in p for p in problems)
    assert any("can reach Ray" in p for p in isolation.ray_ports_isolated(objs))


def test_api_open_to_every_pod_is_caught():
    objs = rendered(OVERLAY)
    policy(objs, "distributed-serving-api")["spec"]["ingress"][0]["from"].append({"podSelector": {}})
    problems = isolation.vllm_api_isolated(objs)
    assert problems and all("spec.ingress[0].from[3]" in p and "port 8000" in p for p in problems)


def test_api_without_from_is_caught():
    objs = rendered(OVERLAY)
    del policy(objs, "distributed-serving-api")["spec"]["ingress"][0]["from"]
    assert any("admits every source to port 8000" in p for p in isolation.vllm_api_isolated(objs))


def test_envoy_peer_of_another_gateway_is_caught():
    objs = rendered(OVERLAY)
    envoy = policy(objs, "distributed-serving-api")["spec"]["ingress"][0]["from"][0]
    envoy["podSelector"]["matchLabels"]["gateway.envoyproxy.io/owning-gateway-name"] = "other"
    problems = isolation.vllm_api_isolated(objs)
    assert any("from[0]" in p for p in problems)
    assert any("Envoy pods cannot reach port 8000" in p for p in problems)


def test_envoy_namespace_any_pod_is_caught():
    objs = rendered(OVERLAY)
    del policy(objs, "distributed-serving-api")["spec"]["ingress"][0]["from"][0]["podSelector"]
    assert any("from[0]" in p for p in isolation.vllm_api_isolated(objs))


def test_picker_cut_off_from_vllm_is_caught():
    objs = rendered(OVERLAY)
    del policy(objs, "distributed-serving-api")["spec"]["ingress"][0]["from"][1]
    assert any("picker cannot reach port 8000" in p for p in isolation.vllm_api_isolated(objs))


def test_api_rule_without_ports_opens_ray_to_envoy():
    objs = rendered(OVERLAY)
    del policy(objs, "distributed-serving-api")["spec"]["ingress"][0]["ports"]
    problems = isolation.ray_ports_isolated(objs)
    assert any("Ray/NCCL ports" in p and "distributed-serving-api" in p for p in problems)


# ------------------------------------------------------------------ Ray: same group only

def test_group_policy_open_to_the_whole_lws_is_caught():
    objs = rendered(OVERLAY)
    peer = policy(objs, "qwq-dist-v1-group-1")["spec"]["ingress"][0]["from"][0]
    del peer["podSelector"]["matchLabels"][isolation.LWS_GROUP]
    problems = isolation.ray_ports_isolated(objs)
    assert all("group 1" in p for p in problems)
    assert any(p.startswith("NetworkPolicy llm/qwq-dist-v1-group-1 spec.ingress[0].from[0]")
               for p in problems)


def test_group_policy_from_another_namespace_is_caught():
    objs = rendered(OVERLAY)
    peer = policy(objs, "qwq-dist-v1-group-0")["spec"]["ingress"][0]["from"][0]
    peer["namespaceSelector"] = {}
    assert any("qwq-dist-v1-group-0" in p for p in isolation.ray_ports_isolated(objs))


def test_more_replicas_than_group_policies_is_caught():
    objs = rendered(OVERLAY)
    find(objs, "LeaderWorkerSet", "qwq-dist-v1")["spec"]["replicas"] = 4
    problems = isolation.ray_ports_isolated(objs)
    assert len(problems) == 2 and all("(group 3)" in p and "add a policy for group 3" in p
                                      for p in problems)


def test_missing_default_deny_is_caught_for_unlisted_groups():
    objs = [o for o in rendered(OVERLAY) if o["metadata"]["name"] != "distributed-serving-default-deny"]
    find(objs, "LeaderWorkerSet", "qwq-dist-v1")["spec"]["replicas"] = 4
    problems = isolation.ray_ports_isolated(objs)
    # the group-3 worker is selected by no policy at all: open to everyone
    assert any("workerTemplate (group 3): no NetworkPolicy selects" in p for p in problems)


# ------------------------------------------------------------------ picker

def test_picker_grpc_open_to_all_is_caught():
    objs = rendered(OVERLAY)
    policy(objs, "inference-gateway-ext-proc")["spec"]["ingress"][0]["from"].append(
        {"namespaceSelector": {}})
    problems = isolation.picker_isolated(objs)
    assert len(problems) == 1 and "from[1]" in problems[0] and "[9002, 9003, 9004]" in problems[0]


def test_picker_peer_link_open_to_other_pods_is_caught():
    """The replicas' link (--peer-port 9005) only from the picker's own pods."""
    objs = rendered(OVERLAY)
    rule = next(r for r in policy(objs, "inference-gateway-ext-proc")["spec"]["ingress"]
                if [p["port"] for p in r["ports"]] == [9005])
    rule["from"].append({"podSelector": {"matchLabels": {"app": "distributed-serving"}}})
    problems = isolation.picker_isolated(objs)
    assert len(problems) == 1 and "link port 9005" in problems[0] and "own pods" in problems[0]


def test_picker_metrics_open_to_all_is_caught():
    objs = rendered(OVERLAY)
    del policy(objs, "inference-gateway-ext-proc")["spec"]["ingress"][1]["from"]
    problems = isolation.picker_isolated(objs)
    assert len(problems) == 1 and "admits every source to the picker's /metrics port" in problems[0]


def test_picker_without_policy_is_caught():
    objs = [o for o in rendered(OVERLAY) if not (o.get("kind") == "NetworkPolicy"
                                                 and o["metadata"]["name"] == "inference-gateway-ext-proc")]
    assert any("no NetworkPolicy selects the picker" in p for p in isolation.picker_isolated(objs))


# ------------------------------------------------------------------ securityContext

@pytest.mark.parametrize("breakage, message", [
    ("root", "runAsNonRoot must be true"),
    ("escalation", "allowPrivilegeEscalation must be false"),
    ("capabilities", "capabilities.drop must contain ALL"),
    ("added-capability", "capabilities.add must be empty"),
    ("writable-root", "readOnlyRootFilesystem must be true"),
    ("no-tmp", "/tmp has no writable volumeMount"),
    ("no-home", "HOME must name a writable volume"),
    ("seccomp", "seccompProfile.type must be RuntimeDefault"),
])
def test_weakened_vllm_security_context_is_caught(breakage, message):
    objs = rendered(OVERLAY)
    spec = leader_spec(objs)
    c = spec["containers"][0]
    if breakage == "root":
        del spec["securityContext"]["runAsNonRoot"]
    elif breakage == "escalation":
        del c["securityContext"]["allowPrivilegeEscalation"]
    elif breakage == "capabilities":
        c["securityContext"]["capabilities"]["drop"] = ["NET_RAW"]
    elif breakage == "added-capability":
        c["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]
    elif breakage == "writable-root":
        c["securityContext"]["readOnlyRootFilesystem"] = False
    elif breakage == "no-tmp":
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/tmp"]
    elif breakage == "no-home":
        c["env"] = [e for e in c["env"] if e["name"] != "HOME"]
    elif breakage == "seccomp":
        del spec["securityContext"]["seccompProfile"]
    problems = isolation.vllm_pods_hardened(objs)
    assert len(problems) == 1 and message in problems[0], problems
    assert "leaderTemplate.spec.containers[0]" in problems[0]


# ------------------------------------------------------------------ request size limits

@pytest.mark.parametrize("where", ["gateway", "picker"])
def test_body_limits_that_disagree_are_caught(where):
    objs = rendered(OVERLAY)
    if where == "gateway":
        find(objs, "ClientTrafficPolicy")["spec"]["connection"]["bufferLimit"] = "4Mi"
    else:
        args = find(objs, "Deployment", "inference-gateway-ext-proc")["spec"]["template"]["spec"]["containers"][0]["args"]
        args[args.index("--max-body-bytes") + 1] = "1048576"
    problems = isolation.picker_body_limit_matches_gateway(objs)
    assert len(problems) == 1 and "spec.connection.bufferLimit" in problems[0]
    assert "--max-body-bytes" in problems[0]
