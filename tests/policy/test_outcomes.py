"""The picker's outcome path is wired (validation/outcomes.py): every overlay holds, and each check
fails on a fixture broken the way it guards, with a message naming the object and field."""
from __future__ import annotations

import pytest

from tests.policy.conftest import OVERLAYS, find, rendered
from validation import outcomes, rules

OVERLAY = "overlays/a10"
PICKER = "inference-gateway-ext-proc"
PROXY = "inference-gateway-proxy"
BACKEND = "inference-gateway-ext-proc-outcomes"


def problems(objs):
    return [p for check in outcomes.OUTCOME_CHECKS for p in check(objs)]


def args(objs):
    return find(objs, "Deployment", PICKER)["spec"]["template"]["spec"]["containers"][0]["args"]


def sink(objs):
    return find(objs, "EnvoyProxy", PROXY)["spec"]["telemetry"]["accessLog"]["settings"][1]["sinks"][0]


def picker_policy(objs):
    return find(objs, "EnvoyExtensionPolicy", "reasoning-inference-picker")


def set_flag(objs, flag, value):
    a = args(objs)
    a[a.index(flag) + 1] = value


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_sends_outcomes_to_the_picker(overlay):
    assert problems(rendered(overlay)) == []


def test_the_rules_run_on_every_overlay_open_ones_too():
    for overlay in (OVERLAY, "overlays/a10-open-gateway"):
        assert set(outcomes.OUTCOME_CHECKS) <= set(rules.rules_for(overlay))


def test_the_namespaces_are_the_ones_the_picker_reads():
    from picker import defaults
    from picker.protocol import answers
    from picker.signals import outcomes as picker_outcomes
    assert outcomes.PICKER_NAMESPACE == picker_outcomes.PICKER_NAMESPACE == answers.PICKER_NAMESPACE
    assert outcomes.TOKENS_NAMESPACE == picker_outcomes.TOKENS_NAMESPACE
    assert outcomes.TOKEN_KEYS == (picker_outcomes.PROMPT_KEY, picker_outcomes.COMPLETION_KEY)
    assert outcomes.DEFAULT_OUTCOMES_PORT == defaults.OUTCOMES_PORT


def test_backend_on_another_port_fails():
    objs = rendered(OVERLAY)
    find(objs, "Backend", BACKEND)["spec"]["endpoints"][0]["fqdn"]["port"] = 9002
    found = outcomes.outcome_sink_reaches_picker(objs)
    assert found == [f"Backend llm/{BACKEND}: spec.endpoints[0].fqdn inference-gateway-ext-proc.llm.svc."
                     f"cluster.local:9002 != the picker's outcome port inference-gateway-ext-proc.llm.svc."
                     f"cluster.local:9004 (--outcomes-port)"], found


def test_picker_flag_that_disagrees_with_the_service_fails():
    objs = rendered(OVERLAY)
    set_flag(objs, "--outcomes-port", "9007")
    found = outcomes.outcome_sink_reaches_picker(objs)
    assert any("container picker: ports: no containerPort 9007" in p for p in found), found
    assert any("no Service forwards to the picker's --outcomes-port 9007" in p for p in found), found


def test_sink_pointing_elsewhere_fails():
    objs = rendered(OVERLAY)
    sink(objs)["als"]["backendRefs"][0]["name"] = PICKER  # ext_proc's Backend: port 9002
    found = outcomes.outcome_sink_reaches_picker(objs)
    assert any(p.startswith(f"Backend llm/{PICKER}: spec.endpoints[0].fqdn") and "9002" in p for p in found), found


def test_plaintext_backend_for_a_tls_picker_fails():
    objs = rendered("overlays/a10-open-gateway")
    del find(objs, "Backend", BACKEND)["spec"]["tls"]
    assert outcomes.outcome_sink_reaches_picker(objs) == [
        f"Backend llm/{BACKEND}: spec.tls missing but the picker runs --secure-serving"]


def test_gateway_without_its_envoy_proxy_fails():
    objs = rendered(OVERLAY)
    del find(objs, "Gateway", "inference-gateway")["spec"]["infrastructure"]
    found = outcomes.outcome_sink_reaches_picker(objs)
    assert found == ["Gateway llm/inference-gateway: spec.infrastructure.parametersRef: names no EnvoyProxy, "
                     "so Envoy never sends the picker its access log (--outcomes-port 9004)"], found


def test_envoy_proxy_without_the_sink_fails():
    objs = rendered(OVERLAY)
    find(objs, "EnvoyProxy", PROXY)["spec"]["telemetry"]["accessLog"]["settings"].pop(1)
    found = outcomes.outcome_sink_reaches_picker(objs)
    assert found == [f"EnvoyProxy llm/{PROXY}: spec.telemetry.accessLog: no ALS sink of type HTTP to the "
                     f"picker's outcome port inference-gateway-ext-proc:9004"], found


def test_network_policy_without_the_port_fails():
    objs = rendered(OVERLAY)
    rule = find(objs, "NetworkPolicy", PICKER)["spec"]["ingress"][0]
    rule["ports"] = [p for p in rule["ports"] if p["port"] != 9004]
    found = outcomes.outcome_sink_reaches_picker(objs)
    assert len(found) == 1 and found[0].startswith(f"NetworkPolicy llm/{PICKER}") and \
        "outcome port 9004" in found[0], found


def test_sink_to_a_picker_whose_outcome_port_is_off_fails():
    objs = rendered(OVERLAY)
    set_flag(objs, "--outcomes-port", "0")
    found = outcomes.outcome_sink_reaches_picker(objs)
    assert found == [f"EnvoyProxy llm/{PROXY}: spec.telemetry.accessLog.settings[1].sinks[0].als.backendRefs: "
                     "sends Envoy's access log to the picker, whose --outcomes-port is 0 (off)"], found
    # turned off on both sides: nothing to check
    find(objs, "EnvoyProxy", PROXY)["spec"]["telemetry"]["accessLog"]["settings"].pop(1)
    assert problems(objs) == []


def test_picker_namespace_not_writable_fails():
    objs = rendered(OVERLAY)
    picker_policy(objs)["spec"]["extProc"][0]["metadata"]["writableNamespaces"] = ["envoy.lb"]
    assert outcomes.outcome_entries_carry_tokens(objs) == [
        "EnvoyExtensionPolicy llm/reasoning-inference-picker: spec.extProc[0].metadata.writableNamespaces: "
        "must include llm-serving.picker (the picker's request id and features, brought back with each outcome)"]


@pytest.mark.parametrize("overlay", [OVERLAY, "overlays/a10-open-gateway"])
def test_picker_route_without_the_token_accounting_fails(overlay):
    objs = rendered(overlay)
    spec = picker_policy(objs)["spec"]
    spec["lua"] = [item for item in spec["lua"] if item["valueRef"]["name"] != "token-accounting"]
    found = outcomes.outcome_entries_carry_tokens(objs)
    assert found == ["EnvoyExtensionPolicy llm/reasoning-inference-picker: spec.lua: no ConfigMap script writes "
                     "prompt_tokens, completion_tokens into llm-serving.tokens (base/gateway's token-accounting), "
                     "so the picker's outcomes come without token counts"], found
