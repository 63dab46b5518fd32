"""What the design needs, checked in the xDS Envoy Gateway generates (`egctl x translate --to xds`).

Every expected value is read from the policies of the render, not written here: on the route an
EnvoyExtensionPolicy targets, an ext_proc filter to its backend with the policy's body mode,
failure mode, status on error, message timeout and writable metadata namespaces; on the clusters
of a route whose BackendTrafficPolicy has `endpointOverride`, the override-host policy reading
those headers with the policy's type as fallback; on every other route's clusters, least request
(the design's 8080 baseline); the ClientTrafficPolicy's body limit and timeouts on its listeners;
the BackendTrafficPolicy's request and connect timeouts on its routes and clusters.
"""
from __future__ import annotations

from validation.manifests import seconds
from validation.problems import Problem, describe

_SOURCE = "envoy-gateway xds"
BODY_MODES = {"Buffered": "BUFFERED", "FullDuplexStreamed": "FULL_DUPLEX_STREAMED", "Streamed": "STREAMED",
              "BufferedPartial": "BUFFERED_PARTIAL"}
LB_TYPES = {"LeastRequest": "least_request", "RoundRobin": "round_robin", "Random": "random",
            "ConsistentHash": "ring_hash"}
# Envoy's HttpStatus enum names for the codes statusOnError may carry
HTTP_STATUS = {500: "InternalServerError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout",
               429: "TooManyRequests", 400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound"}


# -- reading the config dump ---------------------------------------------------------------------

def _configs(xds) -> list[dict]:
    docs = xds if isinstance(xds, list) else [xds]
    return [c for d in docs if isinstance(d, dict) for c in d.get("configs", [])]


def listeners(xds) -> list[dict]:
    return [entry.get("activeState", {}).get("listener", {}) for c in _configs(xds)
            for entry in c.get("dynamicListeners", [])]


def clusters(xds) -> dict[str, dict]:
    return {e["cluster"]["name"]: e["cluster"] for c in _configs(xds) for e in c.get("dynamicActiveClusters", [])}


def routes(xds) -> list[tuple[str, dict]]:
    """(route config name, route) for every route of every virtual host."""
    return [(e["routeConfig"]["name"], r) for c in _configs(xds) for e in c.get("dynamicRouteConfigs", [])
            for vh in e["routeConfig"].get("virtualHosts", []) for r in vh.get("routes", [])]


def _hcms(listener: dict) -> list[dict]:
    chains = list(listener.get("filterChains", []))
    if listener.get("defaultFilterChain"):
        chains.append(listener["defaultFilterChain"])
    return [f["typedConfig"] for chain in chains for f in chain.get("filters", [])
            if f.get("name") == "envoy.filters.network.http_connection_manager"]


def listener_port(listener: dict) -> int | None:
    return (listener.get("address", {}).get("socketAddress", {}) or {}).get("portValue")


def route_clusters(route: dict) -> list[str]:
    action = route.get("route") or {}
    if "cluster" in action:
        return [action["cluster"]]
    return [w["name"] for w in (action.get("weightedClusters") or {}).get("clusters", [])]


# -- which routes belong to which objects -------------------------------------------------------

def _ns(obj: dict, default: str) -> str:
    return (obj.get("metadata") or {}).get("namespace") or default


def routes_of(xds, namespace: str, route_name: str) -> list[tuple[str, dict]]:
    prefix = f"httproute/{namespace}/{route_name}/"
    return [(cfg, r) for cfg, r in routes(xds) if r.get("name", "").startswith(prefix)]


def _targets(policy: dict, kind: str) -> list[str]:
    return [t["name"] for t in policy["spec"].get("targetRefs", []) if t.get("kind") == kind]


def _listener_of(xds, route_config: str) -> dict | None:
    for listener in listeners(xds):
        for hcm in _hcms(listener):
            if (hcm.get("rds") or {}).get("routeConfigName") == route_config:
                return listener
    return None


# -- rules --------------------------------------------------------------------------------------

def xds_problems(target: str, objs: list[dict], xds) -> list[Problem]:
    gw = next((o for o in objs if o.get("kind") == "Gateway"), None)
    if gw is None:
        return []
    namespace = _ns(gw, "default")
    problems: list[Problem] = []
    for policy in (o for o in objs if o.get("kind") == "EnvoyExtensionPolicy"):
        problems += _ext_proc(target, policy, namespace, xds, objs)
    overridden = set()
    for policy in (o for o in objs if o.get("kind") == "BackendTrafficPolicy"):
        problems += _backend_policy(target, policy, namespace, xds)
        if (policy["spec"].get("loadBalancer") or {}).get("endpointOverride"):
            overridden |= set(_targets(policy, "HTTPRoute"))
    for route in (o for o in objs if o.get("kind") == "HTTPRoute"):
        if route["metadata"]["name"] in overridden:
            problems += _picker_in_front(target, route, namespace, objs, xds)
        else:
            problems += _least_request(target, route, namespace, xds)
    for policy in (o for o in objs if o.get("kind") == "ClientTrafficPolicy"):
        problems += _client_policy(target, policy, namespace, xds)
    problems += _limits_before_picker(target, gw, xds)
    return problems


GATE_FILTERS = ("envoy.filters.http.api_key_auth", "envoy.filters.http.jwt_authn",
                "envoy.filters.http.local_ratelimit", "envoy.filters.http.ratelimit")


def _limits_before_picker(target: str, gw: dict, xds) -> list[Problem]:
    """Authentication and rate limits run before the picker's ext_proc: a request they refuse must
    never reach the picker, which would count it against an endpoint (and do its work for nothing)."""
    problems = []
    for listener in listeners(xds):
        for hcm in _hcms(listener):
            names = [f.get("name", "") for f in hcm.get("httpFilters", [])]
            ext_proc = next((i for i, n in enumerate(names) if n.startswith("envoy.filters.http.ext_proc")), None)
            # a filter of a shared global rate limit is named envoy.filters.http.ratelimit/<domain>
            late = ([n for n in names[ext_proc:] if n.split('/')[0] in GATE_FILTERS]
                    if ext_proc is not None else [])
            if late:
                problems.append(Problem(
                    target, f"listener {listener.get('name')}: Envoy runs {', '.join(late)} after the picker's "
                    "ext_proc, so requests it refuses are still routed by the picker (set the EnvoyProxy's "
                    "spec.filterOrder)", describe(gw), "spec.infrastructure.parametersRef", source=_SOURCE))
    return problems


def _ext_proc(target: str, policy: dict, namespace: str, xds, objs: list[dict]) -> list[Problem]:
    problems = []
    name = policy["metadata"]["name"]

    def add(message, field="spec.extProc[0]"):
        problems.append(Problem(target, message, describe(policy), field, source=_SOURCE))

    for i, proc in enumerate(policy["spec"].get("extProc", [])):
        filter_name = f"envoy.filters.http.ext_proc/envoyextensionpolicy/{namespace}/{name}/extproc/{i}"
        for route_name in _targets(policy, "HTTPRoute"):
            found = routes_of(xds, namespace, route_name)
            if not found:
                add(f"no Envoy route for HTTPRoute {route_name}: the ext_proc filter is on no route", "spec.targetRefs")
                continue
            for cfg, route in found:
                listener = _listener_of(xds, cfg)
                filters = [f for hcm in _hcms(listener or {}) for f in hcm.get("httpFilters", [])
                           if f.get("name") == filter_name]
                if not filters:
                    add(f"listener of route {route['name']} has no filter {filter_name}", f"spec.extProc[{i}]")
                    continue
                enabled = not filters[0].get("disabled") or filter_name in (route.get("typedPerFilterConfig") or {})
                if not enabled:
                    add(f"route {route['name']} does not enable {filter_name}", f"spec.extProc[{i}]")
                problems += _ext_proc_settings(target, policy, i, proc, filters[0].get("typedConfig", {}),
                                               clusters(xds))
                problems += _retry_predicates(target, policy, i, listener.get("name", ""), filter_name,
                                              filters[0].get("typedConfig", {}), objs)
    return problems


def _retry_predicates(target, policy, i, listener, filter_name, config, objs) -> list[Problem]:
    """An EnvoyPatchPolicy that adds retry host predicates to this filter on this listener landed
    (Envoy Gateway's translator drops a patch whose JSONPath matches nothing without a word)."""
    wanted = [v.get("name") for epp in objs if epp.get("kind") == "EnvoyPatchPolicy"
              for patch in (epp.get("spec") or {}).get("jsonPatches") or [] if patch.get("name") == listener
              for op in [patch.get("operation") or {}]
              if f"'{filter_name}'" in op.get("jsonPath", "") and op.get("path") == "/retry_host_predicate"
              for v in (op.get("value") if isinstance(op.get("value"), list) else []) if isinstance(v, dict)]
    got = [p.get("name") for p in ((config.get("grpcService") or {}).get("retryPolicy") or {}).get(
        "retryHostPredicate") or []]
    if not wanted or set(wanted) <= set(got):
        return []
    return [Problem(target, f"an EnvoyPatchPolicy adds retry host predicates {wanted} to {filter_name} on "
                    f"listener {listener}, but the generated retry policy has {got}: its JSONPath matches "
                    f"nothing", describe(policy), f"spec.extProc[{i}].backendSettings.retry", source=_SOURCE)]


def _ext_proc_settings(target, policy, i, proc, config, all_clusters) -> list[Problem]:
    problems = []

    def expect(field, want, got):
        if want != got:
            problems.append(Problem(target, f"generated ext_proc has {got!r}, the policy says {want!r}",
                                    describe(policy), f"spec.extProc[{i}].{field}", source=_SOURCE))

    mode = config.get("processingMode") or {}
    body = ((proc.get("processingMode") or {}).get("request") or {}).get("body")
    expect("processingMode.request.body", BODY_MODES.get(body, "NONE"), mode.get("requestBodyMode", "NONE"))
    expect("failOpen", bool(proc.get("failOpen", False)), bool(config.get("failureModeAllow", False)))
    if "statusOnError" in proc:
        code = (config.get("statusOnError") or {}).get("code")
        want = proc["statusOnError"]
        expect("statusOnError", want, want if code in (want, HTTP_STATUS.get(want)) else code)
    if "messageTimeout" in proc:
        expect("messageTimeout", seconds(proc["messageTimeout"]), seconds(config.get("messageTimeout")))
    writable = (proc.get("metadata") or {}).get("writableNamespaces") or []
    receiving = (((config.get("metadataOptions") or {}).get("receivingNamespaces") or {}).get("untyped")) or []
    for ns in writable:
        if ns not in receiving:
            problems.append(Problem(target, f"generated ext_proc does not accept dynamic metadata {ns!r}",
                                    describe(policy), f"spec.extProc[{i}].metadata.writableNamespaces",
                                    source=_SOURCE))
    cluster = ((config.get("grpcService") or {}).get("envoyGrpc") or {}).get("clusterName")
    if not cluster or cluster not in all_clusters:
        problems.append(Problem(target, f"ext_proc gRPC service points at cluster {cluster!r}, which does not exist",
                                describe(policy), f"spec.extProc[{i}].backendRefs", source=_SOURCE))
    return problems


def _lb_policy(cluster: dict) -> tuple[str | None, dict | None]:
    """(policy name, its typed config) of a cluster: load_balancing_policy first, else lb_policy."""
    for p in (cluster.get("loadBalancingPolicy") or {}).get("policies", []):
        typed = p.get("typedExtensionConfig") or {}
        return typed.get("name"), typed.get("typedConfig")
    return {"LEAST_REQUEST": "least_request", "ROUND_ROBIN": "round_robin", "RANDOM": "random"}.get(
        cluster.get("lbPolicy", "ROUND_ROBIN")), None


def _is(name: str | None, typed: dict | None, kind: str) -> bool:
    return bool(name and (name.endswith(kind) or kind in (typed or {}).get("@type", "")))


def _backend_policy(target: str, policy: dict, namespace: str, xds) -> list[Problem]:
    problems = []
    spec = policy["spec"]
    all_clusters = clusters(xds)

    def add(message, field):
        problems.append(Problem(target, message, describe(policy), field, source=_SOURCE))

    for route_name in _targets(policy, "HTTPRoute"):
        found = routes_of(xds, namespace, route_name)
        if not found:
            add(f"no Envoy route for HTTPRoute {route_name}: the policy applies to nothing", "spec.targetRefs")
            continue
        timeout = seconds(((spec.get("timeout") or {}).get("http") or {}).get("requestTimeout"))
        connect = seconds(((spec.get("timeout") or {}).get("tcp") or {}).get("connectTimeout"))
        lb = spec.get("loadBalancer") or {}
        for _, route in found:
            if timeout is not None and seconds((route.get("route") or {}).get("timeout")) != timeout:
                add(f"route {route['name']} timeout is {(route.get('route') or {}).get('timeout')!r}",
                    "spec.timeout.http.requestTimeout")
            for name in route_clusters(route):
                cluster = all_clusters.get(name, {})
                if connect is not None and seconds(cluster.get("connectTimeout")) != connect:
                    add(f"cluster {name} connectTimeout is {cluster.get('connectTimeout')!r}",
                        "spec.timeout.tcp.connectTimeout")
                if lb:
                    problems += _lb_problems(target, policy, lb, name, cluster)
    return problems


def _lb_problems(target, policy, lb, name, cluster) -> list[Problem]:
    lb_name, typed = _lb_policy(cluster)
    want = LB_TYPES.get(lb.get("type"), str(lb.get("type")).lower())
    override = lb.get("endpointOverride")
    if not override:
        ok = _is(lb_name, typed, want)
        return [] if ok else [Problem(target, f"cluster {name} balances with {lb_name}, the policy says {want}",
                                      describe(policy), "spec.loadBalancer.type", source=_SOURCE)]
    problems = []
    if not _is(lb_name, typed, "override_host") and "OverrideHost" not in (typed or {}).get("@type", ""):
        return [Problem(target, f"cluster {name} has no override-host load balancing policy ({lb_name})",
                        describe(policy), "spec.loadBalancer.endpointOverride", source=_SOURCE)]
    sources = [s.get("header") for s in (typed or {}).get("overrideHostSources", [])]
    for i, source in enumerate(override.get("extractFrom", [])):
        if source.get("header") and source["header"] not in sources:
            problems.append(Problem(target, f"cluster {name} does not read header {source['header']!r} "
                                    f"(reads {sources})", describe(policy),
                                    f"spec.loadBalancer.endpointOverride.extractFrom[{i}]", source=_SOURCE))
    fallback = [p.get("typedExtensionConfig", {}).get("name", "")
                for p in ((typed or {}).get("fallbackPolicy") or {}).get("policies", [])]
    if not any(f.endswith("least_request") for f in fallback):
        problems.append(Problem(target, f"cluster {name} falls back to {fallback}, not least request",
                                describe(policy), "spec.loadBalancer.type", source=_SOURCE))
    return problems


def _picker_in_front(target, route, namespace, objs, xds) -> list[Problem]:
    """A route whose destination comes from a request header must run an ext_proc filter (the
    picker) on every one of its Envoy routes, or clients would choose the backend themselves."""
    problems = []
    for _, r in routes_of(xds, _ns(route, namespace), route["metadata"]["name"]):
        if not any(name.startswith("envoy.filters.http.ext_proc/") for name in r.get("typedPerFilterConfig") or {}):
            problems.append(Problem(target, f"route {r['name']} takes its endpoint from a request header but runs "
                                    "no ext_proc filter: nothing sets that header but the client",
                                    describe(route), "spec.rules", source=_SOURCE))
    return problems


def _least_request(target, route, namespace, xds) -> list[Problem]:
    """Every route the picker does not steer balances with least request (the 8080 baseline)."""
    problems = []
    all_clusters = clusters(xds)
    for _, r in routes_of(xds, _ns(route, namespace), route["metadata"]["name"]):
        for name in route_clusters(r):
            lb_name, typed = _lb_policy(all_clusters.get(name, {}))
            if not _is(lb_name, typed, "least_request"):
                problems.append(Problem(target, f"cluster {name} balances with {lb_name}, not least request",
                                        describe(route), "spec.rules", source=_SOURCE))
    return problems


_UNITS = {"Ki": 1024, "Mi": 1024 ** 2, "Gi": 1024 ** 3, "K": 1000, "M": 1000 ** 2, "G": 1000 ** 3}


def quantity(text) -> int | None:
    if text is None:
        return None
    text = str(text)
    for unit, factor in _UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _client_policy(target: str, policy: dict, namespace: str, xds) -> list[Problem]:
    """On every listener of the Gateways the policy targets (Envoy Gateway names them
    `<namespace>/<gateway>/<listener>`)."""
    problems = []
    spec = policy["spec"]
    limit = quantity((spec.get("connection") or {}).get("bufferLimit"))
    http = (spec.get("timeout") or {}).get("http") or {}
    prefixes = tuple(f"{_ns(policy, namespace)}/{name}/" for name in _targets(policy, "Gateway"))
    found = [listener for listener in listeners(xds) if listener.get("name", "").startswith(prefixes)]

    def add(message, field):
        problems.append(Problem(target, message, describe(policy), field, source=_SOURCE))

    for listener in found:
        name = listener.get("name")
        if limit is not None and int(listener.get("perConnectionBufferLimitBytes", -1)) != limit:
            add(f"listener {name} buffer limit is {listener.get('perConnectionBufferLimitBytes')}, want {limit}",
                "spec.connection.bufferLimit")
        for hcm in _hcms(listener):
            for field, xds_field in (("streamIdleTimeout", "streamIdleTimeout"),
                                     ("requestReceivedTimeout", "requestTimeout"),
                                     ("requestHeadersReceivedTimeout", "requestHeadersTimeout")):
                if field in http and seconds(hcm.get(xds_field)) != seconds(http[field]):
                    add(f"listener {name} {xds_field} is {hcm.get(xds_field)!r}, want {http[field]}",
                        f"spec.timeout.http.{field}")
    if not found:
        add("no listener in the generated xDS", "spec.targetRefs")
    return problems
