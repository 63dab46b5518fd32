"""Envoy Gateway's translator (egctl x translate, the pinned version) over the rendered gateway
objects: the shipped overlays pass, and each broken fixture fails with a message naming the
target, the object and the field."""
from __future__ import annotations


import pytest

from tests.policy.conftest import CACHE, OVERLAYS, ROOT, find, rendered  # noqa: F401  (shared render cache)
from validation import edge, gateway
from validation.gateway_xds import _hcms, clusters, listener_port, listeners, routes_of

EGCTL = ROOT / ".tools" / "bin" / "egctl"
pytestmark = pytest.mark.skipif(not EGCTL.is_file(), reason="egctl not built (make tools)")


def check(objs, target="fixture") -> list[str]:
    return [str(p) for p in gateway.check_target(EGCTL, target, objs)]


@pytest.mark.parametrize("target", [*OVERLAYS, "base/gateway"])
def test_the_shipped_gateway_objects_translate_cleanly(target):
    assert check(rendered(target), target) == []


def test_a_policy_on_a_missing_route_applies_to_nothing():
    objs = rendered("overlays/a10")
    find(objs, "BackendTrafficPolicy", "reasoning-inference")["spec"]["targetRefs"][0]["name"] = "reasoning-inferense"
    found = check(objs)
    assert any("BackendTrafficPolicy llm/reasoning-inference: spec.targetRefs" in p and "applies to nothing" in p
               for p in found), found
    # and the generated config shows it: no Envoy route carries that policy's settings
    assert any("no Envoy route for HTTPRoute reasoning-inferense" in p for p in found), found


def test_a_route_on_a_listener_that_does_not_exist_is_reported():
    objs = rendered("overlays/a10")
    find(objs, "HTTPRoute", "reasoning-inference")["spec"]["parentRefs"][0]["sectionName"] = "llm"
    found = check(objs)
    assert any("HTTPRoute llm/reasoning-inference: status.parents[0]" in p and "Accepted=False" in p
               for p in found), found


def test_a_client_policy_on_a_missing_gateway_is_reported():
    objs = rendered("overlays/a10")
    find(objs, "ClientTrafficPolicy")["spec"]["targetRefs"][0]["name"] = "other-gateway"
    found = check(objs)
    assert any("ClientTrafficPolicy llm/inference-gateway-client: spec.targetRefs" in p for p in found), found


def test_fail_open_with_streamed_bodies_is_rejected_by_envoy_gateway():
    objs = rendered("overlays/a10")
    find(objs, "EnvoyExtensionPolicy", "reasoning-inference-picker")["spec"]["extProc"][0]["failOpen"] = True
    found = check(objs)
    assert any("reasoning-inference-picker" in p and "spec.extProc[0]" in p and "FailOpen must be false" in p
               for p in found), found


def test_an_ext_proc_to_a_missing_backend_is_reported():
    objs = rendered("overlays/a10")
    find(objs, "EnvoyExtensionPolicy", "reasoning-inference-picker")["spec"]["extProc"][0]["backendRefs"][0]["name"] = "no-such-picker"
    found = check(objs)
    assert any("EnvoyExtensionPolicy llm/reasoning-inference-picker" in p for p in found), found


def test_endpoint_override_without_the_picker_in_front_is_reported():
    """Without the EnvoyExtensionPolicy, the header that names the backend comes from the client."""
    objs = [o for o in rendered("overlays/a10") if o.get("kind") != "EnvoyExtensionPolicy"]
    found = check(objs)
    assert any("HTTPRoute llm/reasoning-inference: spec.rules" in p and "runs no ext_proc filter" in p
               for p in found), found


def test_a_rate_limit_after_the_picker_is_reported():
    """Without the EnvoyProxy's filterOrder, Envoy Gateway runs the local rate limit after ext_proc."""
    objs = [o for o in rendered("overlays/a10") if o.get("kind") != "EnvoyProxy"]
    del find(objs, "Gateway", "inference-gateway")["spec"]["infrastructure"]
    found = check(objs)
    late = [p for p in found if "Gateway llm/inference-gateway: spec.infrastructure.parametersRef" in p
            and "after the picker's ext_proc" in p]
    # both the request limit and the token budget (shared global rate limit) would run too late
    assert late and all("envoy.filters.http.local_ratelimit" in p for p in late), found
    assert all("envoy.filters.http.ratelimit/llm/inference-gateway-token-budget" in p for p in late), found


def test_the_baseline_listener_must_balance_by_least_request():
    objs = rendered("overlays/a10")
    find(objs, "BackendTrafficPolicy", "reasoning-backend")["spec"]["loadBalancer"] = {"type": "RoundRobin"}
    found = check(objs)
    assert any("HTTPRoute llm/reasoning-backend" in p and "not least request" in p for p in found), found


def test_the_override_falls_back_to_least_request():
    objs = rendered("overlays/a10")
    find(objs, "BackendTrafficPolicy", "reasoning-inference")["spec"]["loadBalancer"]["type"] = "Random"
    found = check(objs)
    assert any("BackendTrafficPolicy llm/reasoning-inference: spec.loadBalancer.type" in p for p in found), found


def test_xds_rules_read_the_generated_config():
    """The xDS rules compare against values Envoy Gateway generated: a dump without the ext_proc
    filter or with another body mode is caught."""
    from validation.gateway_xds import xds_problems

    objs = rendered("overlays/a10")
    _, xds = gateway.translate(EGCTL, objs)
    assert xds_problems("fixture", objs, xds) == []
    for cfg in xds["configs"]:
        for entry in cfg.get("dynamicListeners", []):
            for chain in [entry["activeState"]["listener"].get("defaultFilterChain") or {},
                          *entry["activeState"]["listener"].get("filterChains", [])]:
                for f in chain.get("filters", []):
                    for h in f.get("typedConfig", {}).get("httpFilters", []):
                        if h["name"].startswith("envoy.filters.http.ext_proc/"):
                            h["typedConfig"]["processingMode"]["requestBodyMode"] = "BUFFERED"
    found = [str(p) for p in xds_problems("fixture", objs, xds)]
    assert any("spec.extProc[0].processingMode.request.body" in p and "BUFFERED" in p for p in found), found


def _picker_filter(xds) -> dict:
    return next(h["typedConfig"] for listener in listeners(xds) if listener["name"] == "llm/inference-gateway/llm-gw"
                for hcm in _hcms(listener) for h in hcm.get("httpFilters", [])
                if h["name"].startswith("envoy.filters.http.ext_proc/"))


def test_the_picker_retries_land_on_another_replica():
    """base/gateway's EnvoyPatchPolicy puts previous_hosts on the ext_proc filter's retry policy;
    a JSONPath that matches nothing (a misspelt field) is caught, since Envoy Gateway says nothing
    about it (a patch naming another filter is picker_ha's finding)."""
    objs = rendered("overlays/a10")
    _, xds = gateway.translate(EGCTL, objs)
    policy = _picker_filter(xds)["grpcService"]["retryPolicy"]
    assert [p["name"] for p in policy["retryHostPredicate"]] == ["envoy.retry_host_predicates.previous_hosts"]
    assert int(policy["hostSelectionRetryMaxAttempts"]) >= 2 and policy["numRetries"] >= 1
    for patch in find(objs, "EnvoyPatchPolicy", "picker-retry-other-replica")["spec"]["jsonPatches"]:
        patch["operation"]["jsonPath"] = patch["operation"]["jsonPath"].replace(".grpc_service.", ".grpcService.")
    found = check(objs)
    assert any("EnvoyExtensionPolicy llm/reasoning-inference-picker: spec.extProc[0].backendSettings.retry" in p
               and "matches nothing" in p for p in found), found


def test_validate_cli_reports_envoy_gateway_findings(tmp_path, capsys):
    """`python -m validation` runs the translation: a broken copy of base/gateway fails it."""
    import shutil

    from validation.cli import main

    root = tmp_path / "repo"
    shutil.copytree(ROOT / "base" / "gateway", root / "base" / "gateway")
    policy = root / "base" / "gateway" / "backend-traffic-policies.yaml"
    policy.write_text(policy.read_text().replace("name: reasoning-inference\n  loadBalancer",
                                                 "name: no-such-route\n  loadBalancer"))
    assert "no-such-route" in policy.read_text()
    code = main(["--root", str(root), "base/gateway", "--skip-workflows", "--skip-kubeconform",
                 "--egctl", str(EGCTL), "--cache-dir", str(CACHE)])
    out = capsys.readouterr().out
    assert code == 1
    assert "[envoy-gateway] base/gateway: BackendTrafficPolicy default/reasoning-inference: spec.targetRefs" in out, out


def _conditions(objs, kind, name):
    obj = find(objs, kind, name)
    status = obj.get("status") or {}
    return [c for anc in status.get("ancestors") or status.get("parents") or [] for c in anc.get("conditions", [])]


def _without_secret(name):
    """The closed overlay with every Secret it references but `name` (placeholders stand in for those)."""
    objs = rendered("overlays/a10")
    return objs + [s for s in edge.placeholder_secrets(objs) if s["metadata"]["name"] != name]


def test_a_missing_api_key_secret_fails_closed():
    """Before the deploy step that creates the keys, Envoy Gateway refuses every request (500) on
    both listeners: the routes become direct responses, never a way to the model."""
    result, xds = gateway.translate(EGCTL, _without_secret("inference-gateway-api-keys"), placeholders=False)
    accepted = [c for c in _conditions(result, "SecurityPolicy", "inference-gateway-api-keys") if c["type"] == "Accepted"]
    assert accepted and accepted[0]["status"] == "False"
    assert "secret llm/inference-gateway-api-keys does not exist" in accepted[0]["message"]
    for route in ("reasoning-backend", "reasoning-inference"):
        found = routes_of(xds, "llm", route)
        assert found and all(r.get("directResponse", {}).get("status") == 500 and "route" not in r
                             for _, r in found), (route, found)


def test_a_missing_listener_certificate_fails_closed():
    """Without inference-gateway-tls neither listener is programmed: nothing listens on 8080 or 8081
    (no plain-HTTP fallback)."""
    result, xds = gateway.translate(EGCTL, _without_secret("inference-gateway-tls"), placeholders=False)
    gw = find(result, "Gateway", "inference-gateway")
    programmed = {l["name"]: next(c for c in l["conditions"] if c["type"] == "Programmed")
                  for l in gw["status"]["listeners"]}
    assert {n: c["status"] for n, c in programmed.items()} == {"http": "False", "llm-gw": "False"}
    assert not {listener_port(l) for l in listeners(xds)} & {8080, 8081}


def test_a_missing_picker_ca_fails_closed():
    """Without the picker's CA Envoy Gateway will not call the picker unverified: 8081 answers 500."""
    result, xds = gateway.translate(EGCTL, _without_secret("inference-gateway-ext-proc-tls"), placeholders=False)
    accepted = [c for c in _conditions(result, "EnvoyExtensionPolicy", "reasoning-inference-picker")
                if c["type"] == "Accepted"]
    assert accepted and accepted[0]["status"] == "False" and "inference-gateway-ext-proc-tls" in accepted[0]["message"]
    found = routes_of(xds, "llm", "reasoning-inference")
    assert found and all(r.get("directResponse", {}).get("status") == 500 for _, r in found), found


def test_the_picker_hop_verifies_the_picker_certificate():
    _, xds = gateway.translate(EGCTL, rendered("overlays/a10"))
    cluster = next(c for name, c in clusters(xds).items() if "reasoning-inference-picker" in name and "extproc" in name)
    socket = cluster["transportSocketMatches"][0]["transportSocket"]["typedConfig"]
    context = socket["commonTlsContext"]["combinedValidationContext"]
    assert socket["sni"] == "inference-gateway-ext-proc.llm.svc.cluster.local"
    assert context["defaultValidationContext"]["matchTypedSubjectAltNames"] == [
        {"matcher": {"exact": "inference-gateway-ext-proc.llm.svc.cluster.local"}, "sanType": "DNS"}]
    assert context["validationContextSdsSecretConfig"]["name"] == "inference-gateway-ext-proc/llm-ca"


def test_the_token_budget_is_one_count_per_client_charged_from_metadata():
    """Both routes charge the same shared domain (one budget per client across listeners and Envoy
    replicas), the prompt at admission and the completion at the stream's end, with the Lua filter
    that writes those numbers running before the rate limit, and both before the picker."""
    _, xds = gateway.translate(EGCTL, rendered("overlays/a10"))
    budget = "envoy.filters.http.ratelimit/llm/inference-gateway-token-budget"
    for route in ("reasoning-backend", "reasoning-inference"):
        (_, r), = routes_of(xds, "llm", route)
        config = r["typedPerFilterConfig"][budget]
        assert config["domain"] == "llm/inference-gateway-token-budget"
        addends = {(rl.get("applyOnStreamDone", False), rl["hitsAddend"]["format"]) for rl in config["rateLimits"]}
        assert addends == {(False, "%DYNAMIC_METADATA(llm-serving.tokens:prompt)%"),
                           (True, "%DYNAMIC_METADATA(llm-serving.tokens:settle)%")}
    for listener in listeners(xds):
        if listener_port(listener) not in (8080, 8081):
            continue
        names = [f["name"] for hcm in _hcms(listener) for f in hcm["httpFilters"]]
        lua = next(i for i, n in enumerate(names) if n.startswith("envoy.filters.http.lua/"))
        assert lua < names.index(budget)
        assert all(names.index(budget) < i for i, n in enumerate(names) if n.startswith("envoy.filters.http.ext_proc"))
