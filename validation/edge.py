"""Edge checks for cluster overlays: what every listener of the Gateway enforces before a request
reaches the picker or vLLM (components/edge-security, components/gateway-tls).

Each check takes the objects of one render target and returns problem strings naming the
object and the field; an empty list means the check holds.
"""
from __future__ import annotations

import base64
import datetime
import functools

from validation.manifests import gateway_listeners, name_of, ns_of, of_kind, routes_on_listener, seconds
from validation.problems import describe

GATEWAY = "inference-gateway"
ENDPOINT_HEADERS = ("x-gateway-destination-endpoint", "x-gateway-destination-endpoint-subset",
                    "x-gateway-destination-endpoint-served")
SAFE_RETRY_TRIGGERS = {"connect-failure", "reset-before-request"}


def _gateway(objs):
    return next((g for g in of_kind(objs, "Gateway") if name_of(g) == GATEWAY), None)


def _listeners(objs) -> list[str]:
    return [listener.get("name") for listener in gateway_listeners(objs, GATEWAY)]


def _covers(policy, listener: str) -> bool:
    """The policy targets the whole Gateway or this listener of it."""
    for ref in (policy.get("spec") or {}).get("targetRefs") or []:
        if ref.get("kind") == "Gateway" and ref.get("name") == GATEWAY \
                and ref.get("sectionName") in (None, listener):
            return True
    return False


def _route_policy(objs, kind: str, route: dict):
    for p in of_kind(objs, kind):
        if any(ref.get("kind") == "HTTPRoute" and ref.get("name") == name_of(route)
               for ref in (p.get("spec") or {}).get("targetRefs") or []):
            return p
    return None


def listeners_authenticate(objs):
    """Every listener needs an API key (or a JWT) from a Secret; the key never reaches backends;
    the client id goes on in a header the rate limits use."""
    problems = []
    used: dict[str, dict] = {}
    for listener in _listeners(objs):
        policies = [p for p in of_kind(objs, "SecurityPolicy") if _covers(p, listener)]
        auth = [p for p in policies if (p.get("spec") or {}).get("apiKeyAuth") or (p.get("spec") or {}).get("jwt")]
        if not auth:
            problems.append(f"Gateway {GATEWAY} listener {listener!r}: no SecurityPolicy with "
                            f"apiKeyAuth or jwt covers it, so anyone who reaches it can use the model")
        used.update((describe(p), p) for p in auth)
    for p in used.values():
        api = (p.get("spec") or {}).get("apiKeyAuth")
        if api is None:
            continue
        if not api.get("credentialRefs"):
            problems.append(f"{describe(p)}: spec.apiKeyAuth.credentialRefs names no Secret")
        if api.get("sanitize") is not True:
            problems.append(f"{describe(p)}: spec.apiKeyAuth.sanitize must be true (the key "
                            f"would be forwarded to the picker and vLLM)")
        if not api.get("forwardClientIDHeader"):
            problems.append(f"{describe(p)}: spec.apiKeyAuth.forwardClientIDHeader must name the "
                            f"header the per-client rate limits key on")
    return problems


def listeners_strip_endpoint_headers(objs):
    """Client-sent x-gateway-destination-endpoint* headers are removed before any filter runs."""
    problems = []
    for listener in _listeners(objs):
        removed = _early_removed(objs, listener)
        missing = [h for h in ENDPOINT_HEADERS if h not in removed]
        if missing:
            problems.append(f"Gateway {GATEWAY} listener {listener!r}: no ClientTrafficPolicy "
                            f"spec.headers.earlyRequestHeaders.remove lists {missing}, so a client "
                            f"can choose its backend")
    return problems


def _early_removed(objs, listener: str) -> set[str]:
    removed = set()
    for p in of_kind(objs, "ClientTrafficPolicy"):
        if _covers(p, listener):
            early = (((p.get("spec") or {}).get("headers") or {}).get("earlyRequestHeaders") or {})
            removed.update(h.lower() for h in early.get("remove") or [])
    return removed


def listeners_strip_client_id(objs):
    """The client id header (apiKeyAuth.forwardClientIDHeader) is removed from client requests before
    any filter runs: only authentication names the client. Otherwise, while the key Secret is missing
    (no API-key filter runs), a client could name itself, pass the check that refuses requests no key
    authenticated (components/token-budget) and reach the picker, under another client's limits."""
    problems = []
    for listener in _listeners(objs):
        for p in of_kind(objs, "SecurityPolicy"):
            header = (((p.get("spec") or {}).get("apiKeyAuth") or {}).get("forwardClientIDHeader") or "").lower()
            if _covers(p, listener) and header and header not in _early_removed(objs, listener):
                problems.append(f"Gateway {GATEWAY} listener {listener!r}: no ClientTrafficPolicy "
                                f"spec.headers.earlyRequestHeaders.remove lists {header!r} ({describe(p)} "
                                f"forwards the client id in it), so a client can name itself")
    return problems


def listeners_limit_connections(objs):
    problems = []
    for listener in _listeners(objs):
        limited = any(((p.get("spec") or {}).get("connection") or {}).get("connectionLimit")
                      for p in of_kind(objs, "ClientTrafficPolicy") if _covers(p, listener))
        if not limited:
            problems.append(f"Gateway {GATEWAY} listener {listener!r}: no ClientTrafficPolicy sets "
                            f"spec.connection.connectionLimit")
    return problems


def listeners_time_out_headers(objs):
    """Each listener bounds how long a client may take to send its headers, below the whole
    request's bound: without it a client dribbling header lines (slowloris) holds a connection,
    of the connectionLimit, for the whole requestReceivedTimeout."""
    problems = []
    for listener in _listeners(objs):
        covering = [p for p in of_kind(objs, "ClientTrafficPolicy") if _covers(p, listener)]
        http = [(p, (((p.get("spec") or {}).get("timeout") or {}).get("http") or {})) for p in covering]
        headers = [(p, t["requestHeadersReceivedTimeout"]) for p, t in http if t.get("requestHeadersReceivedTimeout")]
        if not headers or not seconds(headers[0][1]):
            problems.append(f"Gateway {GATEWAY} listener {listener!r}: no ClientTrafficPolicy sets "
                            f"spec.timeout.http.requestHeadersReceivedTimeout (a client dribbling its "
                            f"headers holds a connection for the whole request timeout)")
            continue
        whole = [t["requestReceivedTimeout"] for _, t in http if t.get("requestReceivedTimeout")]
        if whole and seconds(headers[0][1]) >= seconds(whole[0]):
            problems.append(f"{describe(headers[0][0])}: spec.timeout.http.requestHeadersReceivedTimeout "
                            f"{headers[0][1]} must be shorter than requestReceivedTimeout {whole[0]}")
    return problems


def routes_rate_limit(objs):
    """Each route of each listener: a per-client rate limit on the forwarded client id."""
    client_headers = {((p.get("spec") or {}).get("apiKeyAuth") or {}).get("forwardClientIDHeader")
                      for p in of_kind(objs, "SecurityPolicy")} - {None}
    problems = []
    for where, spec in _route_backend_policies(objs):
        rules = (((spec.get("rateLimit") or {}).get("local") or {}).get("rules") or [])
        selectors = [s.get("headers") or [] for r in rules for s in r.get("clientSelectors") or []]
        keyed = {h.get("name", "").lower() for headers in selectors for h in headers if h.get("type") == "Distinct"}
        if not keyed & {h.lower() for h in client_headers}:
            problems.append(f"{where}: spec.rateLimit.local has no rule per distinct client id "
                            f"({sorted(client_headers) or 'no forwarded client id header'})")
        # Envoy's local rate limit matches a per-value (wildcard) descriptor entry only at the
        # end of a descriptor: with another match after it, the rule never limits (measured).
        for headers in selectors:
            if any(h.get("type") == "Distinct" for h in headers[:-1]):
                problems.append(f"{where}: spec.rateLimit.local clientSelectors headers: the Distinct "
                                f"match must be the last one, or Envoy never applies the rule")
    return problems


def routes_check_health(objs):
    """Each route of each listener: active /health checks, passive outlier detection, retries only
    where no backend saw the request."""
    problems = []
    for where, spec in _route_backend_policies(objs):
        active = (spec.get("healthCheck") or {}).get("active") or {}
        if active.get("type") != "HTTP" or (active.get("http") or {}).get("path") != "/health":
            problems.append(f"{where}: spec.healthCheck.active must GET /health")
        if not (spec.get("healthCheck") or {}).get("passive"):
            problems.append(f"{where}: spec.healthCheck.passive (outlier detection) is not set")
        triggers = set((((spec.get("retry") or {}).get("retryOn") or {}).get("triggers")) or [])
        if spec.get("retry") is not None and not triggers:
            problems.append(f"{where}: spec.retry without retryOn.triggers retries on Envoy "
                            f"Gateway's defaults, which include 503 responses")
        if triggers - SAFE_RETRY_TRIGGERS:
            problems.append(f"{where}: spec.retry.retryOn.triggers {sorted(triggers - SAFE_RETRY_TRIGGERS)} "
                            f"can resend a request a backend already started generating")
        if not triggers:
            problems.append(f"{where}: spec.retry on connect-failure/reset-before-request is not set")
    return problems


def _route_backend_policies(objs) -> list[tuple[str, dict]]:
    """(where, BackendTrafficPolicy spec) of every route on every listener ({} when it has none)."""
    out = []
    for listener in _listeners(objs):
        for route in routes_on_listener(objs, listener, GATEWAY):
            btp = _route_policy(objs, "BackendTrafficPolicy", route)
            where = describe(btp) if btp else f"{describe(route)} (no BackendTrafficPolicy)"
            out.append((where, (btp or {}).get("spec") or {}))
    return out


def listeners_use_tls(objs):
    problems = []
    for i, l in enumerate(gateway_listeners(objs, GATEWAY)):
        refs = ((l.get("tls") or {}).get("certificateRefs")) or []
        if l.get("protocol") != "HTTPS" or not refs:
            problems.append(f"{describe(_gateway(objs))}: spec.listeners[{i}] ({l.get('name')}) must be HTTPS with "
                            f"tls.certificateRefs (components/gateway-tls)")
    return problems


def picker_hop_verified(objs):
    """The Backend the ext_proc filter calls verifies the picker's certificate against a CA."""
    problems = []
    names = {ref.get("name") for p in of_kind(objs, "EnvoyExtensionPolicy")
             for proc in (p.get("spec") or {}).get("extProc") or []
             for ref in proc.get("backendRefs") or [] if ref.get("kind") == "Backend"}
    for backend in of_kind(objs, "Backend"):
        if name_of(backend) not in names:
            continue
        tls = (backend.get("spec") or {}).get("tls") or {}
        if tls.get("insecureSkipVerify") or not (tls.get("caCertificateRefs") or tls.get("wellKnownCACertificates")):
            problems.append(f"{describe(backend)}: spec.tls must verify the picker's certificate "
                            f"(caCertificateRefs, no insecureSkipVerify; components/picker-tls): "
                            f"otherwise whoever answers on the picker's address sees every prompt "
                            f"and chooses every backend")
    return problems


def referenced_secrets(objs) -> list[tuple[str, str, str]]:
    """(namespace, name, type) of every Secret the gateway objects reference: API keys of a
    SecurityPolicy, listener certificates of a Gateway, the CA a Backend verifies its endpoints
    with (ca.crt). They are created out of band."""
    out = []
    for p in of_kind(objs, "SecurityPolicy"):
        for ref in ((p.get("spec") or {}).get("apiKeyAuth") or {}).get("credentialRefs") or []:
            if ref.get("kind", "Secret") == "Secret":
                out.append((ref.get("namespace") or ns_of(p), ref["name"], "Opaque"))
    for gw in of_kind(objs, "Gateway"):
        for listener in (gw.get("spec") or {}).get("listeners") or []:
            for ref in (listener.get("tls") or {}).get("certificateRefs") or []:
                if ref.get("kind", "Secret") == "Secret":
                    out.append((ref.get("namespace") or ns_of(gw), ref["name"], "kubernetes.io/tls"))
    for backend in of_kind(objs, "Backend"):
        for ref in ((backend.get("spec") or {}).get("tls") or {}).get("caCertificateRefs") or []:
            if ref.get("kind") == "Secret":
                out.append((ns_of(backend), ref["name"], "kubernetes.io/tls"))
    return list(dict.fromkeys(out))


def placeholder_secrets(objs) -> list[dict]:
    """Throw-away stand-ins for the referenced Secrets the render does not hold, for offline
    translation (`egctl x translate` marks a policy or listener invalid when its Secret is
    missing, as Envoy Gateway would in a cluster where nobody created it yet)."""
    present = {(ns_of(s), name_of(s)) for s in of_kind(objs, "Secret")}
    out = []
    for namespace, name, kind in referenced_secrets(objs):
        if (namespace, name) in present:
            continue
        data = dict(_self_signed()) if kind == "kubernetes.io/tls" else {"placeholder-client": "placeholder-key"}
        out.append({"apiVersion": "v1", "kind": "Secret", "type": kind,
                    "metadata": {"name": name, "namespace": namespace},
                    "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}})
    return out


@functools.cache  # one per process: identical translator inputs stay identical
def _self_signed() -> dict[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "placeholder")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    return {"tls.crt": pem, "ca.crt": pem,
            "tls.key": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()).decode()}


EDGE_CHECKS = [listeners_authenticate, listeners_strip_endpoint_headers, listeners_strip_client_id,
               listeners_limit_connections, listeners_time_out_headers, routes_rate_limit, listeners_use_tls, picker_hop_verified]
# what an Argo CD app's path must hold unless the app opts in to an open Gateway
CLOSED_CHECKS = [listeners_authenticate, routes_rate_limit]
# every overlay (components/healthy-backends is part of every overlay)
HEALTH_CHECKS = [routes_check_health]
