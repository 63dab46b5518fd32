"""Every policy check holds on every overlay, and fails on a fixture broken the way it guards."""
from __future__ import annotations

import pytest

from validation import policy
from validation.canary import split_weights
from tests.policy.conftest import NAMESPACE, OVERLAYS, ROOT, find, rendered

CANARY = "overlays/a10-canary"


def leader(objs, lws="qwq-dist-v1"):
    return find(objs, "LeaderWorkerSet", lws)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]


def worker(objs, lws="qwq-dist-v1"):
    return find(objs, "LeaderWorkerSet", lws)["spec"]["leaderWorkerTemplate"]["workerTemplate"]


def vllm_args(objs, lws="qwq-dist-v1"):
    return leader(objs, lws)["spec"]["containers"][0]["args"]


def set_flag(args, flag, value):
    args[args.index(flag) + 1] = value


def test_overlays_exist():
    assert {"overlays/a10", CANARY} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", policy.ALL_CHECKS + [policy.gpu_pods_fit_node], ids=lambda c: c.__name__)
def test_policy_holds(overlay, check):
    assert check(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secret_refs_name_the_workload_namespace(overlay):
    assert policy.secret_refs_in_namespace(rendered(overlay), NAMESPACE) == []


# ------------------------------------------------------------------ broken fixtures

def test_mount_without_volume_is_caught():
    objs = rendered("overlays/a10")
    leader(objs)["spec"]["containers"][0]["volumeMounts"][0]["name"] = "llm-models"  # the article's typo
    problems = policy.volume_mounts_have_volumes(objs)
    assert len(problems) == 1 and "'llm-models' is not a volume" in problems[0]
    assert "leaderTemplate.spec.containers[0].volumeMounts[0].name" in problems[0]


def test_pool_selecting_workers_is_caught():
    objs = rendered("overlays/a10")
    del find(objs, "InferencePool")["spec"]["selector"]["matchLabels"]["role"]
    problems = policy.pool_selects_leaders_only(objs)
    assert any("workerTemplate (role worker)" in p for p in problems)


def test_pool_missing_leaders_is_caught():
    objs = rendered("overlays/a10")
    find(objs, "InferencePool")["spec"]["selector"]["matchLabels"]["release"] = "qwq-dist-v9"
    assert any("selects no pods" in p for p in policy.pool_selects_leaders_only(objs))


@pytest.mark.parametrize("breakage", ["pool", "flag", "containerPort", "probe", "service"])
def test_port_mismatch_is_caught(breakage):
    objs = rendered("overlays/a10")
    container = leader(objs)["spec"]["containers"][0]
    if breakage == "pool":
        find(objs, "InferencePool")["spec"]["targetPorts"][0]["number"] = 8001
    elif breakage == "flag":
        set_flag(container["args"], "--port", "8001")
    elif breakage == "containerPort":
        container["ports"][0]["containerPort"] = 8001
    elif breakage == "probe":
        container["readinessProbe"]["httpGet"]["port"] = 8001
    else:
        find(objs, "Service", "qwq-dist-v1")["spec"]["ports"][0]["targetPort"] = 8001
    assert policy.ports_agree(objs), breakage


def test_gpu_count_not_tensor_parallel_is_caught():
    objs = rendered("overlays/a10")
    worker(objs)["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "4"
    problems = policy.parallelism_matches_resources(objs)
    assert len(problems) == 1 and "workerTemplate requests 4 nvidia.com/gpu" in problems[0]


def test_group_size_not_pipeline_parallel_is_caught():
    objs = rendered("overlays/a10")
    find(objs, "LeaderWorkerSet", "qwq-dist-v1")["spec"]["leaderWorkerTemplate"]["size"] = 3
    assert any("size 3 != --pipeline-parallel-size 2" in p for p in policy.parallelism_matches_resources(objs))


def test_rewrite_target_not_served_is_caught():
    objs = rendered(CANARY)
    set_flag(vllm_args(objs, "qwq-dist-v2"), "--served-model-name", "qwq-v2")
    problems = policy.served_names_cover_rewrites(objs)
    assert len(problems) == 1 and "'qwq-canary' is served by no vLLM leader" in problems[0]


@pytest.mark.parametrize("field,value,expect", [("name", "qwq-dist", "does not exist"),
                                                ("port", 80, "is not a port of Service")])
def test_route_to_missing_service_or_port_is_caught(field, value, expect):
    objs = rendered("overlays/a10")
    find(objs, "HTTPRoute", "reasoning-backend")["spec"]["rules"][0]["backendRefs"][0][field] = value
    problems = policy.route_backends_exist(objs)
    assert len(problems) == 1 and expect in problems[0]


def test_extension_policy_on_the_8080_route_is_caught():
    objs = rendered("overlays/a10")
    find(objs, "EnvoyExtensionPolicy", "reasoning-inference-picker")["spec"]["targetRefs"][0]["name"] = "reasoning-backend"
    assert any("must be the 8081 route" in p for p in policy.extension_policy_wiring(objs))


def test_extension_policy_wrong_picker_port_is_caught():
    objs = rendered("overlays/a10")
    find(objs, "Backend")["spec"]["endpoints"][0]["fqdn"]["port"] = 9003
    assert any("fqdn" in p and "9003" in p for p in policy.extension_policy_wiring(objs))


def test_backend_in_another_namespace_is_caught():
    objs = rendered("overlays/a10")
    find(objs, "Backend")["spec"]["endpoints"][0]["fqdn"]["hostname"] = \
        "inference-gateway-ext-proc.default.svc.cluster.local"
    assert any("!= picker Service inference-gateway-ext-proc.llm.svc" in p
               for p in policy.extension_policy_wiring(objs))


def test_plaintext_picker_behind_tls_backend_is_caught():
    objs = rendered("overlays/a10")
    args = find(objs, "Deployment", "inference-gateway-ext-proc")["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--secure-serving")] = "--no-secure-serving"
    assert any("spec.tls set but the picker runs --no-secure-serving" in p
               for p in policy.extension_policy_wiring(objs))


def test_service_ref_to_tls_picker_is_caught():
    objs = rendered("overlays/a10")
    ext = find(objs, "EnvoyExtensionPolicy", "reasoning-inference-picker")["spec"]["extProc"][0]
    ext["backendRefs"] = [{"group": "", "kind": "Service", "name": "inference-gateway-ext-proc", "port": 9002}]
    assert any("picker serves TLS" in p for p in policy.extension_policy_wiring(objs))


@pytest.mark.parametrize("mutate,expect", [
    (lambda e: e.update(failOpen=True), "failOpen: must be false"),
    (lambda e: e["processingMode"]["request"].update(body="Streamed"), "not a mode the picker supports"),
    (lambda e: e["processingMode"]["request"].update(body="Buffered"), "--request-body-mode full-duplex"),
    (lambda e: e["metadata"].update(writableNamespaces=[]), "must include envoy.lb"),
])
def test_extension_policy_settings_are_checked(mutate, expect):
    objs = rendered("overlays/a10")
    mutate(find(objs, "EnvoyExtensionPolicy", "reasoning-inference-picker")["spec"]["extProc"][0])
    assert any(expect in p for p in policy.extension_policy_wiring(objs))


def test_pool_picker_reference_is_checked():
    objs = rendered("overlays/a10")
    find(objs, "InferencePool")["spec"]["endpointPickerRef"]["port"]["number"] = 9090
    assert any("endpointPickerRef" in p for p in policy.extension_policy_wiring(objs))


def test_missing_endpoint_override_is_caught():
    objs = rendered("overlays/a10")
    del find(objs, "BackendTrafficPolicy", "reasoning-inference")["spec"]["loadBalancer"]["endpointOverride"]
    assert any("x-gateway-destination-endpoint" in p for p in policy.endpoint_override_on_8081(objs))


def test_canary_weights_differ_between_ports_is_caught():
    objs = rendered(CANARY)
    split = split_weights(ROOT)
    stable, canary = split["stableWeight"], split["canaryWeight"]
    refs = find(objs, "HTTPRoute", "reasoning-backend")["spec"]["rules"][0]["backendRefs"]
    assert {r["name"]: r["weight"] for r in refs} == {"qwq-dist-v1": stable, "qwq-dist-v2": canary}
    refs[1]["weight"] = canary + stable     # 8080 now sends a different share to the canary
    problems = policy.canary_weights_agree(objs)
    share = f"{(canary + stable) / (canary + 2 * stable):.0%}"
    assert len(problems) == 1 and "(port 8080)" in problems[0] and f"'qwq-canary': '{share}'" in problems[0]


def test_canary_only_on_one_port_is_caught():
    objs = rendered("overlays/a10")
    find(objs, "InferenceModelRewrite", "qwq")["spec"]["rules"][0]["targets"].append(
        {"modelRewrite": "qwq-canary", "weight": 10})
    problems = policy.canary_weights_agree(objs)
    assert len(problems) == 1 and "(port 8080)" in problems[0]


def test_weighted_backends_on_the_8081_route_are_caught():
    objs = rendered(CANARY)
    refs = find(objs, "HTTPRoute", "reasoning-inference")["spec"]["rules"][0]["backendRefs"]
    assert [r["name"] for r in refs] == ["qwq-leaders"]
    refs[:] = [{"name": "qwq-dist-v1", "port": 8000, "weight": 90}, {"name": "qwq-dist-v2", "port": 8000, "weight": 10}]
    problems = policy.llm_route_holds_whole_pool(objs)
    assert len(problems) == 1 and "2 backends" in problems[0]


def test_8081_backend_missing_part_of_the_pool_is_caught():
    objs = rendered(CANARY)
    find(objs, "HTTPRoute", "reasoning-inference")["spec"]["rules"][0]["backendRefs"][0]["name"] = "qwq-dist-v1"
    problems = policy.llm_route_holds_whole_pool(objs)
    assert len(problems) == 1 and "does not select the same pods as InferencePool llm/reasoning-pool" in problems[0]


def test_pods_that_do_not_fit_the_node_are_caught():
    objs = rendered("overlays/a10")
    res = worker(objs)["spec"]["containers"][0]["resources"]
    res["requests"]["cpu"] = res["limits"]["cpu"] = "64"
    res["requests"]["memory"] = res["limits"]["memory"] = "400Gi"
    problems = policy.gpu_pods_fit_node(objs)
    assert len(problems) == 2 and "allocatable CPU" in problems[0] and "allocatable memory" in problems[1]


@pytest.mark.parametrize("image,expect", [("vllm/vllm-openai:latest", "latest"), ("vllm/vllm-openai", "no tag"),
                                          ("registry:5000/vllm", "no tag")])
def test_unpinned_image_is_caught(image, expect):
    objs = rendered("overlays/a10")
    worker(objs)["spec"]["containers"][0]["image"] = image
    problems = policy.images_pinned(objs)
    assert len(problems) == 1 and expect in problems[0]


def test_committed_secret_data_is_caught():
    objs = rendered("overlays/a10") + [{"apiVersion": "v1", "kind": "Secret",
                                        "metadata": {"name": "oss-secret", "namespace": "llm"},
                                        "stringData": {"akId": "x", "akSecret": "y"}}]
    assert policy.no_secret_data(objs) == [
        "Secret llm/oss-secret: data/stringData must not be committed (reference a Secret created out of band)"]


def test_pv_secret_in_other_namespace_is_caught():
    objs = rendered("overlays/a10")
    find(objs, "PersistentVolume")["spec"]["csi"]["nodePublishSecretRef"]["namespace"] = "default"
    assert len(policy.secret_refs_in_namespace(objs, NAMESPACE)) == 1


# ------------------------------------------------------------------ flow control vs gateway timeouts

def picker_args(objs):
    deployment = find(objs, "Deployment", "inference-gateway-ext-proc")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def with_flow_control(objs, *flags):
    args = picker_args(objs)
    for flag in ("--flow-control", "--no-flow-control", "--flow-max-wait", "--flow-max-wait-sheddable"):
        while flag in args:
            i = args.index(flag)
            del args[i:i + (1 if flag.endswith("flow-control") else 2)]
    args += ["--flow-control", *flags]
    return objs


def test_flow_control_defaults_match_the_picker():
    from picker import defaults
    assert policy.FLOW_MAX_WAIT_DEFAULT == defaults.FLOW_MAX_WAIT
    assert policy.FLOW_MAX_WAIT_SHEDDABLE_DEFAULT == defaults.FLOW_MAX_WAIT_SHEDDABLE


@pytest.mark.parametrize("overlay", ["overlays/a10", "overlays/a10-buffered"])  # both body modes
def test_flow_control_hold_longer_than_the_message_timeout_is_caught(overlay):
    objs = with_flow_control(rendered(overlay), "--flow-max-wait", "600")
    problems = policy.flow_control_fits_timeouts(objs)
    assert any("messageTimeout" in p and "600s" in p and "EnvoyExtensionPolicy" in p for p in problems), problems
    assert any("requestReceivedTimeout 60s" in p for p in problems), problems
    ok = with_flow_control(rendered(overlay), "--flow-max-wait", "5", "--flow-max-wait-sheddable", "2")
    assert policy.flow_control_fits_timeouts(ok) == []


def test_flow_control_without_a_message_timeout_is_caught():
    objs = with_flow_control(rendered("overlays/a10"))
    del find(objs, "EnvoyExtensionPolicy", "reasoning-inference-picker")["spec"]["extProc"][0]["messageTimeout"]
    problems = policy.flow_control_fits_timeouts(objs)
    assert any("unset (200ms)" in p for p in problems), problems


def test_flow_control_route_timeout_shorter_than_the_hold_is_caught():
    objs = with_flow_control(rendered("overlays/a10"), "--flow-max-wait", "5")
    btp = find(objs, "BackendTrafficPolicy", "reasoning-inference")
    btp["spec"]["timeout"]["http"]["requestTimeout"] = "4s"
    problems = policy.flow_control_fits_timeouts(objs)
    assert any("requestTimeout 4s" in p for p in problems), problems


def test_flow_control_off_needs_nothing():
    objs = rendered("overlays/a10")
    args = picker_args(objs)
    args += ["--no-flow-control", "--flow-max-wait", "600"]
    assert policy.flow_control_fits_timeouts(objs) == []
