"""The edge of the closed overlays (components/edge-security, components/gateway-tls,
components/picker-tls): each check holds on them and fails on a fixture broken the way it guards."""
from __future__ import annotations

import pytest

from validation import edge
from tests.policy.conftest import OVERLAYS, find, rendered

CLUSTER_OVERLAYS = [o for o in OVERLAYS if not o.endswith("-open-gateway")]
OVERLAY = "overlays/a10"


@pytest.mark.parametrize("overlay", CLUSTER_OVERLAYS)
@pytest.mark.parametrize("check", edge.EDGE_CHECKS, ids=lambda c: c.__name__)
def test_edge_holds(overlay, check):
    assert check(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_checks_backend_health(overlay):
    assert edge.routes_check_health(rendered(overlay)) == []


def test_no_api_keys_is_caught():
    objs = [o for o in rendered(OVERLAY) if o.get("kind") != "SecurityPolicy"]
    problems = edge.listeners_authenticate(objs)
    assert len(problems) == 2 and all("anyone who reaches it" in p for p in problems)


def test_policy_on_one_listener_only_is_caught():
    objs = rendered(OVERLAY)
    find(objs, "SecurityPolicy")["spec"]["targetRefs"][0]["sectionName"] = "http"
    problems = edge.listeners_authenticate(objs)
    assert len(problems) == 1 and "listener 'llm-gw'" in problems[0]


@pytest.mark.parametrize("field, message", [("sanitize", "sanitize must be true"),
                                            ("forwardClientIDHeader", "forwardClientIDHeader")])
def test_key_forwarded_or_client_unnamed_is_caught(field, message):
    objs = rendered(OVERLAY)
    del find(objs, "SecurityPolicy")["spec"]["apiKeyAuth"][field]
    problems = edge.listeners_authenticate(objs)
    assert len(problems) == 1 and message in problems[0]


def test_endpoint_header_kept_is_caught():
    objs = rendered(OVERLAY)
    early = find(objs, "ClientTrafficPolicy")["spec"]["headers"]["earlyRequestHeaders"]
    early["remove"].remove("x-gateway-destination-endpoint")
    problems = edge.listeners_strip_endpoint_headers(objs)
    assert len(problems) == 2 and all("can choose its backend" in p for p in problems)


def test_client_id_kept_is_caught():
    objs = rendered(OVERLAY)
    find(objs, "ClientTrafficPolicy")["spec"]["headers"]["earlyRequestHeaders"]["remove"].remove("x-client-id")
    problems = edge.listeners_strip_client_id(objs)
    assert len(problems) == 2 and all("'x-client-id'" in p and "can name itself" in p for p in problems), problems
    assert edge.listeners_strip_client_id(rendered(OVERLAY)) == []


def test_no_connection_limit_is_caught():
    objs = rendered(OVERLAY)
    del find(objs, "ClientTrafficPolicy")["spec"]["connection"]["connectionLimit"]
    assert len(edge.listeners_limit_connections(objs)) == 2


def test_a_missing_or_too_long_header_timeout_is_caught():
    assert edge.listeners_time_out_headers(rendered(OVERLAY)) == []
    objs = rendered(OVERLAY)
    http = find(objs, "ClientTrafficPolicy")["spec"]["timeout"]["http"]
    del http["requestHeadersReceivedTimeout"]
    problems = edge.listeners_time_out_headers(objs)
    assert len(problems) == 2 and all("requestHeadersReceivedTimeout" in p for p in problems), problems
    http["requestHeadersReceivedTimeout"] = http["requestReceivedTimeout"]
    problems = edge.listeners_time_out_headers(objs)
    assert problems and all("must be shorter than requestReceivedTimeout" in p for p in problems), problems


@pytest.mark.parametrize("breakage, message", [
    ("rate-limit", "no rule per distinct client id"),
    ("rate-limit-exact", "no rule per distinct client id"),
    ("rate-limit-distinct-first", "the Distinct match must be the last one"),
    ("active", "must GET /health"),
    ("passive", "outlier detection"),
    ("retry-5xx", "can resend a request"),
    ("retry-default", "retries on Envoy Gateway's defaults"),
])
def test_backend_policy_breakage_is_caught(breakage, message):
    objs = rendered(OVERLAY)
    spec = find(objs, "BackendTrafficPolicy", "reasoning-inference")["spec"]
    if breakage == "rate-limit":
        del spec["rateLimit"]
    elif breakage.startswith("rate-limit-"):
        headers = spec["rateLimit"]["local"]["rules"][0]["clientSelectors"][0]["headers"]
        distinct = next(h for h in headers if h["type"] == "Distinct")
        if breakage == "rate-limit-exact":
            distinct.update(type="Exact", value="team-a")
        else:
            headers.remove(distinct)
            headers.insert(0, distinct)
    elif breakage == "active":
        spec["healthCheck"]["active"]["http"]["path"] = "/metrics"
    elif breakage == "passive":
        del spec["healthCheck"]["passive"]
    elif breakage == "retry-5xx":
        spec["retry"]["retryOn"]["triggers"].append("5xx")
    else:
        del spec["retry"]["retryOn"]
    check = edge.routes_rate_limit if breakage.startswith("rate-limit") else edge.routes_check_health
    problems = check(objs)
    assert problems and all("reasoning-inference" in p for p in problems)
    assert any(message in p for p in problems), problems


def test_plain_http_listener_is_caught():
    objs = rendered(OVERLAY)
    gw = find(objs, "Gateway", "inference-gateway")
    gw["spec"]["listeners"][1]["protocol"] = "HTTP"
    del gw["spec"]["listeners"][1]["tls"]
    problems = edge.listeners_use_tls(objs)
    assert len(problems) == 1 and "spec.listeners[1] (llm-gw)" in problems[0]


def test_placeholder_secrets_for_offline_translation():
    objs = rendered(OVERLAY)
    secrets = {(s["metadata"]["name"], s["type"]): s for s in edge.placeholder_secrets(objs)}
    assert set(secrets) == {("inference-gateway-api-keys", "Opaque"),
                            ("inference-gateway-tls", "kubernetes.io/tls"),
                            ("inference-gateway-ext-proc-tls", "kubernetes.io/tls")}
    assert all(s["metadata"]["namespace"] == "llm" for s in secrets.values())
    assert set(secrets[("inference-gateway-tls", "kubernetes.io/tls")]["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    present = objs + list(secrets.values())
    assert edge.placeholder_secrets(present) == []


def test_every_overlay_is_closed_but_the_open_ones():
    assert "overlays/a10" in CLUSTER_OVERLAYS and "overlays/a10-canary" in CLUSTER_OVERLAYS
    open_ones = sorted(set(OVERLAYS) - set(CLUSTER_OVERLAYS))
    assert open_ones == ["overlays/a10-canary-open-gateway", "overlays/a10-open-gateway"]
    for overlay in open_ones:  # they really are open: the rules would refuse them
        assert edge.listeners_authenticate(rendered(overlay)) and edge.routes_rate_limit(rendered(overlay))


@pytest.mark.parametrize("breakage", ["skip-verify", "no-ca"])
def test_unverified_picker_hop_is_caught(breakage):
    objs = rendered(OVERLAY)
    tls = find(objs, "Backend", "inference-gateway-ext-proc")["spec"]["tls"]
    if breakage == "skip-verify":
        tls["insecureSkipVerify"] = True
    else:
        del tls["caCertificateRefs"]
    problems = edge.picker_hop_verified(objs)
    assert len(problems) == 1 and "Backend" in problems[0] and "inference-gateway-ext-proc" in problems[0]


def test_picker_serves_the_verified_certificate():
    objs = rendered(OVERLAY)
    pod = find(objs, "Deployment", "inference-gateway-ext-proc")["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "serving-cert")
    volume = next(v for v in pod["volumes"] if v["name"] == "serving-cert")
    assert args[args.index("--cert-path") + 1] == mount["mountPath"]
    assert volume["secret"]["secretName"] == "inference-gateway-ext-proc-tls"
    backend = find(objs, "Backend", "inference-gateway-ext-proc")["spec"]
    assert backend["tls"]["caCertificateRefs"][0]["name"] == "inference-gateway-ext-proc-tls"
    # the name on the certificate is the picker Service's; the Backend resolves the replicas'
    # headless Service (every replica), and Envoy asks each for that name
    assert backend["tls"]["sni"] == "inference-gateway-ext-proc.llm.svc.cluster.local"
    assert backend["endpoints"][0]["fqdn"]["hostname"] == \
        "inference-gateway-ext-proc-replicas.llm.svc.cluster.local"
