"""Cross-object policy checks over rendered manifests (used by tests/policy).

Each check takes the objects of one render target and returns a list of problem strings that
name the object and the field. An empty list means the check holds.

Why one file of this size: it is a catalogue of short, independent checks read one at a time
(topics with their own vocabulary live beside it: isolation.py, edge.py, kv_events.py,
autoscaling.py); rules.py says which of them apply to which target.
"""
from __future__ import annotations

import base64
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from kubernetes.utils import parse_quantity

from validation.manifests import (GPU, PodTemplate, argv, flag_values, gpu_limit, has_flag, seconds,  # noqa: F401
                                  matches, name_of, ns_of, of_kind, picker_container,
                                  pod_templates, routes_on_port, rule_backend_refs, served_model_names,
                                  services_selecting, spec_rules, vllm_container)
from validation.problems import describe

ENDPOINT_HEADER = "x-gateway-destination-endpoint"


# ---------------------------------------------------------------- Argo CD chart sources

REPO_SECRET_TYPES = ("repository", "repo-creds")


def _secret_value(secret, key):
    if key in (secret.get("stringData") or {}):
        return str(secret["stringData"][key])
    raw = (secret.get("data") or {}).get(key)
    return base64.b64decode(raw).decode(errors="replace") if raw is not None else None


def oci_helm_repositories(objs) -> list[tuple[str, str]]:
    """(secret type, url) of every Argo CD repository Secret that declares an OCI Helm repository."""
    out = []
    for secret in of_kind(objs, "Secret"):
        kind = ((secret.get("metadata") or {}).get("labels") or {}).get("argocd.argoproj.io/secret-type")
        if kind in REPO_SECRET_TYPES and _secret_value(secret, "type") == "helm" \
                and _secret_value(secret, "enableOCI") == "true" and _secret_value(secret, "url"):
            out.append((kind, _secret_value(secret, "url").rstrip("/")))
    return out


def _app_sources(app):
    spec = app.get("spec") or {}
    if spec.get("sources"):
        return [(f"spec.sources[{i}]", s) for i, s in enumerate(spec["sources"])]
    return [("spec.source", spec["source"])] if spec.get("source") else []


def chart_sources_resolve(objs):
    """Every Helm chart an Application names is in a form Argo CD fetches:
    - native OCI: `repoURL: oci://<registry>/<chart>`, `path: .`, no `chart` (public: nothing else);
    - classic Helm repository: `repoURL: https://...` + `chart`;
    - classic form on an OCI registry (`repoURL: <registry>/<path>` without a scheme + `chart`)
      only with a repository Secret (or repo-creds prefix) of type helm with enableOCI "true";
      without one Argo CD fetches `<repoURL>/index.yaml`, which OCI registries do not serve."""
    problems = []
    declared = oci_helm_repositories(objs)
    for app in of_kind(objs, "Application"):
        for path, src in _app_sources(app):
            url = str(src.get("repoURL", "")).rstrip("/")
            where = f"{describe(app)}: {path}"
            if url.startswith("oci://"):
                if src.get("chart"):
                    problems.append(f"{where}.chart: an oci:// repoURL is Argo CD's native OCI source, which "
                                    f"takes no chart: name the chart in the repoURL (oci://<registry>/<chart>) "
                                    f"with path: .")
                elif src.get("path") != ".":
                    problems.append(f"{where}.path: {src.get('path')!r}: an OCI Helm chart source needs path: .")
            elif src.get("chart") and "://" not in url and not url.startswith("git@"):
                if not any(url == u if kind == "repository" else url.startswith(u) for kind, u in declared):
                    problems.append(f"{where}.repoURL: {url!r} + chart {src['chart']!r} is Argo CD's classic Helm "
                                    f"form on an OCI registry, which needs a repository Secret (type: helm, "
                                    f"enableOCI: \"true\") for that URL and the repo declares none: use "
                                    f"repoURL: oci://{url}/{src['chart']}, path: . and no chart")
    return problems


# ---------------------------------------------------------------- checks

def volume_mounts_have_volumes(objs):
    problems = []
    for t in pod_templates(objs):
        volumes = {v.get("name") for v in t.spec.get("volumes") or []}
        for path, c in t.containers():
            for i, m in enumerate(c.get("volumeMounts") or []):
                if m.get("name") not in volumes:
                    problems.append(f"{describe(t.owner)}: {path}.volumeMounts[{i}].name: {m.get('name')!r} "
                                    f"is not a volume of the pod (volumes: {sorted(volumes)})")
    return problems


def pool_selects_leaders_only(objs):
    problems = []
    templates = list(pod_templates(objs))
    for pool in of_kind(objs, "InferencePool"):
        selector = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        selected = [t for t in templates if ns_of(t.owner) == ns_of(pool) and matches(selector, t.labels)]
        for t in selected:
            if t.role != "leader":
                problems.append(f"{describe(pool)}: spec.selector.matchLabels {selector} also selects "
                                f"{t.where} (role {t.role or 'non-LWS pod'})")
        leaders = [t for t in templates if t.role == "leader" and ns_of(t.owner) == ns_of(pool)]
        for t in leaders:
            if t not in selected and vllm_container(t)[1] is not None:
                problems.append(f"{describe(pool)}: spec.selector.matchLabels {selector} misses the leaders "
                                f"of {describe(t.owner)}")
        if not selected:
            problems.append(f"{describe(pool)}: spec.selector.matchLabels {selector} selects no pods")
    return problems


def ports_agree(objs):
    """pool targetPort = vLLM --port = containerPort = Service targetPort = probe ports."""
    problems = []
    for pool in of_kind(objs, "InferencePool"):
        pool_ports = {p.get("number") for p in (pool.get("spec") or {}).get("targetPorts") or []}
        selector = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        for t in pod_templates(objs):
            if t.role != "leader" or not matches(selector, t.labels):
                continue
            path, c = vllm_container(t)
            if c is None:
                problems.append(f"{t.where}: no container runs `vllm serve`")
                continue
            port_flag = flag_values(argv(c), "--port")
            vllm_port = int(port_flag[0]) if port_flag else 8000
            if pool_ports != {vllm_port}:
                problems.append(f"{describe(pool)}: spec.targetPorts {sorted(pool_ports)} != vLLM --port "
                                f"{vllm_port} of {describe(t.owner)}")
            named = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
            if vllm_port not in named.values():
                problems.append(f"{describe(t.owner)}: {path}.ports: no containerPort {vllm_port} (has "
                                f"{sorted(v for v in named.values() if v)})")
            for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
                spec = c.get(probe) or {}
                for kind in ("httpGet", "tcpSocket", "grpc"):
                    if kind in spec:
                        port = spec[kind].get("port")
                        port = named.get(port, port)
                        if port != vllm_port:
                            problems.append(f"{describe(t.owner)}: {path}.{probe}.{kind}.port {port} "
                                            f"!= vLLM --port {vllm_port}")
            for svc in services_selecting(objs, t.labels, ns_of(t.owner)):
                for i, p in enumerate((svc.get("spec") or {}).get("ports") or []):
                    target = p.get("targetPort", p.get("port"))
                    target = named.get(target, target)
                    if target != vllm_port:
                        problems.append(f"{describe(svc)}: spec.ports[{i}].targetPort {target} != vLLM "
                                        f"--port {vllm_port} of {describe(t.owner)}")
    return problems


def parallelism_matches_resources(objs):
    """GPU limit per pod = --tensor-parallel-size; LWS size = --pipeline-parallel-size."""
    problems = []
    for lws in of_kind(objs, "LeaderWorkerSet"):
        templates = [t for t in pod_templates([lws])]
        leader = next(t for t in templates if t.role == "leader")
        path, c = vllm_container(leader)
        if c is None:
            problems.append(f"{describe(lws)}: leader runs no `vllm serve`")
            continue
        args = argv(c)
        tp = int((flag_values(args, "--tensor-parallel-size") or ["1"])[0])
        pp = int((flag_values(args, "--pipeline-parallel-size") or ["1"])[0])
        size = ((lws.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size", 1)
        if size != pp:
            problems.append(f"{describe(lws)}: spec.leaderWorkerTemplate.size {size} != "
                            f"--pipeline-parallel-size {pp}")
        for t in templates:
            gpus = [gpu_limit(ctr) or 0 for _, ctr in t.containers()]
            if sum(gpus) != tp:
                problems.append(f"{describe(lws)}: {t.path} requests {sum(gpus)} {GPU} per pod != "
                                f"--tensor-parallel-size {tp}")
    return problems


def served_names_cover_rewrites(objs):
    served = {n for names in served_model_names(objs).values() for n in names}
    problems = []
    for rw in of_kind(objs, "InferenceModelRewrite"):
        for i, rule in enumerate(spec_rules(rw)):
            for j, target in enumerate(rule.get("targets") or []):
                if target.get("modelRewrite") not in served:
                    problems.append(f"{describe(rw)}: spec.rules[{i}].targets[{j}].modelRewrite "
                                    f"{target.get('modelRewrite')!r} is served by no vLLM leader "
                                    f"(served: {sorted(served)})")
    return problems


def route_backends_exist(objs):
    problems = []
    services = {(ns_of(s), name_of(s)): s for s in of_kind(objs, "Service")}
    for route in of_kind(objs, "HTTPRoute"):
        for path, refs in rule_backend_refs(route):
            for j, ref in enumerate(refs):
                if ref.get("kind", "Service") != "Service" or ref.get("group", "") != "":
                    continue
                key = (ref.get("namespace") or ns_of(route), ref.get("name"))
                where = f"{describe(route)}: {path}[{j}]"
                svc = services.get(key)
                if svc is None:
                    problems.append(f"{where}: Service {key[0]}/{key[1]} does not exist")
                    continue
                ports = {p.get("port") for p in (svc.get("spec") or {}).get("ports") or []}
                if ref.get("port") not in ports:
                    problems.append(f"{where}.port: {ref.get('port')} is not a port of Service "
                                    f"{key[1]} ({sorted(ports)})")
    return problems


def _picker_service_and_port(objs, picker):
    """(Service, service port) that forwards to the picker's --grpc-port."""
    deployment, c = picker
    grpc_port = int((flag_values(argv(c), "--grpc-port") or ["9002"])[0])
    labels = (((deployment.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}
    for svc in services_selecting(objs, labels, ns_of(deployment)):
        for p in (svc.get("spec") or {}).get("ports") or []:
            if p.get("targetPort", p.get("port")) == grpc_port:
                return svc, p.get("port")
    return None, None


def _services_forwarding(objs, svc, svc_port) -> list[tuple[dict, int]]:
    """`svc` on `svc_port`, then every other Service of its namespace with the same selector and
    a port to the same target."""
    spec = svc.get("spec") or {}
    target = next((p.get("targetPort", p.get("port")) for p in spec.get("ports") or []
                   if p.get("port") == svc_port), svc_port)
    out = [(svc, svc_port)]
    for other in of_kind(objs, "Service"):
        o = other.get("spec") or {}
        if other is svc or ns_of(other) != ns_of(svc) or o.get("selector") != spec.get("selector"):
            continue
        out += [(other, p.get("port")) for p in o.get("ports") or []
                if p.get("targetPort", p.get("port")) == target]
    return out


def extension_policy_wiring(objs):
    """EnvoyExtensionPolicy on the 8081 route -> the picker's ext_proc port, TLS and body mode agree
    with the picker's flags, failOpen agrees with the pool, envoy.lb metadata writable."""
    problems = []
    picker = picker_container(objs)
    if picker[0] is None:
        return ["no picker Deployment (`python -m picker`) in the rendered output"]
    args = argv(picker[1])
    secure = not has_flag(args, "--no-secure-serving")
    svc, svc_port = _picker_service_and_port(objs, picker)
    if svc is None:
        return [f"{describe(picker[0])}: no Service forwards to the picker's --grpc-port"]
    llm_routes = {name_of(r) for r in routes_on_port(objs, 8081)}
    # the picker's policies (others, e.g. components/token-budget's Lua on 8080, call no ext_proc)
    policies = [p for p in of_kind(objs, "EnvoyExtensionPolicy") if (p.get("spec") or {}).get("extProc")]
    if not policies:
        problems.append("no EnvoyExtensionPolicy: port 8081 would not go through the picker")
    for eep in policies:
        spec = eep.get("spec") or {}
        targets = {r.get("name") for r in spec.get("targetRefs") or [] if r.get("kind") == "HTTPRoute"}
        if not targets or not targets <= llm_routes:
            problems.append(f"{describe(eep)}: spec.targetRefs {sorted(targets)} must be the 8081 route(s) "
                            f"{sorted(llm_routes)}")
        for i, ext in enumerate(spec.get("extProc") or []):
            where = f"{describe(eep)}: spec.extProc[{i}]"
            for j, ref in enumerate(ext.get("backendRefs") or []):
                problems.extend(picker_ref_problems(objs, ref, f"{where}.backendRefs[{j}]", svc, svc_port, secure))
            if ext.get("failOpen", False):
                problems.append(f"{where}.failOpen: must be false (pool failureMode FailClose)")
            body = ((ext.get("processingMode") or {}).get("request") or {}).get("body")
            mode = flag_values(args, "--request-body-mode")
            expected = {"Buffered": "buffered", "FullDuplexStreamed": "full-duplex"}.get(body)
            if expected is None:
                problems.append(f"{where}.processingMode.request.body: {body!r} is not a mode the picker "
                                f"supports (Buffered, FullDuplexStreamed)")
            elif mode and mode[0] != expected:
                problems.append(f"{where}.processingMode.request.body {body} but the picker runs "
                                f"--request-body-mode {mode[0]}")
            writable = (ext.get("metadata") or {}).get("writableNamespaces") or []
            if "envoy.lb" not in writable:
                problems.append(f"{where}.metadata.writableNamespaces: must include envoy.lb")
    for pool in of_kind(objs, "InferencePool"):
        ref = (pool.get("spec") or {}).get("endpointPickerRef") or {}
        if ref.get("name") != name_of(svc) or (ref.get("port") or {}).get("number") != svc_port:
            problems.append(f"{describe(pool)}: spec.endpointPickerRef {ref.get('name')}:"
                            f"{(ref.get('port') or {}).get('number')} != picker Service {name_of(svc)}:{svc_port}")
        if ref.get("failureMode", "FailClose") != "FailClose":
            problems.append(f"{describe(pool)}: spec.endpointPickerRef.failureMode must be FailClose "
                            f"(the EnvoyExtensionPolicy uses failOpen: false)")
        pool_flag = flag_values(args, "--pool-name")
        if pool_flag and pool_flag[0] != name_of(pool):
            problems.append(f"{describe(picker[0])}: --pool-name {pool_flag[0]} != InferencePool {name_of(pool)}")
    return problems


def picker_ref_problems(objs, ref, where, svc, svc_port, secure, target="picker Service", flag=""):
    """Problems of a backendRef that must reach the picker Service's port `svc_port` (`target`
    names it in messages, `flag` the picker flag behind it): that Service and port directly when
    the picker serves plaintext, else a Backend whose fqdn is the Service, with TLS."""
    kind = ref.get("kind", "Service")
    if kind == "Service":
        out = []
        if ref.get("name") != name_of(svc) or ref.get("port") != svc_port:
            out.append(f"{where}: {ref.get('name')}:{ref.get('port')} != {target} {name_of(svc)}:{svc_port}")
        if secure:
            out.append(f"{where}: plaintext Service reference but the picker serves TLS (--secure-serving); "
                       f"use a Backend with tls or run the picker with --no-secure-serving")
        return out
    if kind != "Backend":
        return [f"{where}: unsupported kind {kind}"]
    backend = next((b for b in of_kind(objs, "Backend") if name_of(b) == ref.get("name")), None)
    if backend is None:
        return [f"{where}: Backend {ref.get('name')} does not exist"]
    out = []
    # the picker Service, or another Service over the same pods and port (the replicas' headless
    # one, which resolves to every replica: base/picker/service.yaml)
    names = [f"{name_of(s)}.{ns_of(s)}.svc.cluster.local:{port}"
             for s, port in _services_forwarding(objs, svc, svc_port)]
    endpoints = (backend.get("spec") or {}).get("endpoints") or []
    if not endpoints:
        out.append(f"{describe(backend)}: spec.endpoints: empty; {target} is {names[0]}{flag}")
    for k, ep in enumerate(endpoints):
        host, port = (ep.get("fqdn") or {}).get("hostname"), (ep.get("fqdn") or {}).get("port")
        if host is None or f"{host.rstrip('.')}:{port}" not in names:
            out.append(f"{describe(backend)}: spec.endpoints[{k}].fqdn {host}:{port} != {target} "
                       f"{' or '.join(names)}{flag}")
    has_tls = bool((backend.get("spec") or {}).get("tls"))
    if has_tls != secure:
        out.append(f"{describe(backend)}: spec.tls {'set' if has_tls else 'missing'} but the picker runs "
                   f"{'--secure-serving' if secure else '--no-secure-serving'}")
    return out


def endpoint_override_on_8081(objs):
    problems = []
    routes = {name_of(r) for r in routes_on_port(objs, 8081)}
    if not routes:
        return ["no HTTPRoute on the 8081 listener"]
    covered = set()
    for btp in of_kind(objs, "BackendTrafficPolicy"):
        spec = btp.get("spec") or {}
        targets = {r.get("name") for r in spec.get("targetRefs") or [] if r.get("kind") == "HTTPRoute"}
        if not targets & routes:
            continue
        lb = spec.get("loadBalancer") or {}
        headers = [e.get("header") for e in (lb.get("endpointOverride") or {}).get("extractFrom") or []]
        if ENDPOINT_HEADER not in headers:
            problems.append(f"{describe(btp)}: spec.loadBalancer.endpointOverride.extractFrom must read "
                            f"header {ENDPOINT_HEADER}")
        if not lb.get("type"):
            problems.append(f"{describe(btp)}: spec.loadBalancer.type is required with endpointOverride")
        covered |= targets & routes
    for route in sorted(routes - covered):
        problems.append(f"HTTPRoute {route}: no BackendTrafficPolicy with endpointOverride targets it")
    return problems


def _shares(weights: dict) -> dict:
    total = sum(weights.values())
    return {k: Fraction(v, total) for k, v in weights.items()} if total else {}


def canary_weights_agree(objs):
    """Traffic share per model version is the same on 8080 (route weights) and 8081 (rewrite)."""
    problems = []
    served = served_model_names(objs)
    lws_by_name = {name_of(o): o for o in of_kind(objs, "LeaderWorkerSet")}
    # Service -> first served model name of the LWS whose leaders it selects.
    service_model = {}
    for svc in of_kind(objs, "Service"):
        selector = (svc.get("spec") or {}).get("selector") or {}
        for t in pod_templates(list(lws_by_name.values())):
            if t.role == "leader" and matches(selector, t.labels) and served.get(name_of(t.owner)):
                service_model[name_of(svc)] = served[name_of(t.owner)][0]
    for rw in of_kind(objs, "InferenceModelRewrite"):
        for i, rule in enumerate(spec_rules(rw)):
            rewrite = _shares({t["modelRewrite"]: t.get("weight", 1) for t in rule.get("targets") or []})
            for port in (8080,):   # 8081 has a single backend: see llm_route_holds_whole_pool
                for route in routes_on_port(objs, port):
                    for path, refs in rule_backend_refs(route):
                        if len(refs) < 2 and len(rewrite) < 2:
                            continue
                        by_model = defaultdict(int)
                        for ref in refs:
                            by_model[service_model.get(ref.get("name"), f"<{ref.get('name')}>")] += ref.get("weight", 1)
                        route_shares = _shares(dict(by_model))
                        if route_shares != rewrite:
                            show = lambda s: {m: f"{float(v):.0%}" for m, v in sorted(s.items())}
                            problems.append(f"{describe(route)} (port {port}): {path} weights "
                                            f"{show(route_shares)} != {describe(rw)} spec.rules[{i}].targets "
                                            f"{show(rewrite)}")
    return problems


def llm_route_holds_whole_pool(objs):
    """Each 8081 route rule has one backend, a Service selecting exactly the pool's leaders: Envoy
    draws a weighted backend first and applies endpointOverride only inside it, so the picker's
    choice must always be inside the one backend."""
    problems = []
    pools = of_kind(objs, "InferencePool")
    services = {(ns_of(s), name_of(s)): s for s in of_kind(objs, "Service")}
    templates = [t for t in pod_templates(objs)]
    for route in routes_on_port(objs, 8081):
        for path, refs in rule_backend_refs(route):
            where = f"{describe(route)}: {path}"
            if len(refs) != 1:
                problems.append(f"{where}: {len(refs)} backends; the 8081 route needs exactly one holding "
                                f"every leader of the pool (split versions with the InferenceModelRewrite)")
                continue
            svc = services.get((refs[0].get("namespace") or ns_of(route), refs[0].get("name")))
            if svc is None:
                continue   # route_backends_exist reports it
            selector = (svc.get("spec") or {}).get("selector") or {}
            via_service = {id(t) for t in templates if ns_of(t.owner) == ns_of(svc) and matches(selector, t.labels)}
            for pool in pools:
                pool_sel = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
                via_pool = {id(t) for t in templates if ns_of(t.owner) == ns_of(pool) and matches(pool_sel, t.labels)}
                if via_service != via_pool:
                    problems.append(f"{where}[0]: Service {name_of(svc)} selector {selector} does not select the "
                                    f"same pods as {describe(pool)} spec.selector.matchLabels {pool_sel}")
    return problems


@dataclass(frozen=True)
class NodeShape:
    gpus: int
    cpu: str
    memory: str
    reserved_cpu: str        # kubelet/system reservation + DaemonSets
    reserved_memory: str


A10_NODE = NodeShape(gpus=4, cpu="128", memory="752Gi", reserved_cpu="16", reserved_memory="64Gi")


def _requests(t: PodTemplate, resource: str):
    total = 0
    for _, c in t.containers():
        res = c.get("resources") or {}
        value = (res.get("requests") or {}).get(resource) or (res.get("limits") or {}).get(resource)
        total += parse_quantity(value) if value is not None else 0
    return total


def gpu_pods_fit_node(objs, node: NodeShape = A10_NODE):
    """Pods that fill a node's GPUs also fit its allocatable CPU and memory."""
    problems = []
    cpu = parse_quantity(node.cpu) - parse_quantity(node.reserved_cpu)
    memory = parse_quantity(node.memory) - parse_quantity(node.reserved_memory)
    for t in pod_templates(objs):
        gpus = sum(gpu_limit(c) or 0 for _, c in t.containers())
        if not gpus:
            continue
        if gpus > node.gpus:
            problems.append(f"{t.where}: {gpus} GPUs per pod > {node.gpus} per node")
            continue
        per_node = node.gpus // gpus
        need_cpu, need_mem = _requests(t, "cpu") * per_node, _requests(t, "memory") * per_node
        if not _requests(t, "cpu") or not _requests(t, "memory"):
            problems.append(f"{t.where}: GPU pod without CPU/memory requests")
        if need_cpu > cpu:
            problems.append(f"{t.where}: {per_node} pods x {_requests(t, 'cpu')} CPU = {need_cpu} > "
                            f"{cpu} allocatable CPU per node")
        if need_mem > memory:
            problems.append(f"{t.where}: {per_node} pods x {_requests(t, 'memory') / 2**30:.0f}Gi = "
                            f"{need_mem / 2**30:.0f}Gi > {memory / 2**30:.0f}Gi allocatable memory per node")
    return problems


def images_pinned(objs):
    problems = []
    for t in pod_templates(objs):
        for path, c in t.containers():
            image = str(c.get("image", ""))
            last = image.rsplit("/", 1)[-1]
            if "@sha256:" in image:
                continue
            if ":" not in last:
                problems.append(f"{describe(t.owner)}: {path}.image {image!r} has no tag")
            elif last.rsplit(":", 1)[1] in ("latest", ""):
                problems.append(f"{describe(t.owner)}: {path}.image {image!r} uses the `latest` tag")
    return problems


def no_secret_data(objs):
    return [f"{describe(o)}: data/stringData must not be committed (reference a Secret created out of band)"
            for o in of_kind(objs, "Secret") if o.get("data") or o.get("stringData")]


def secret_refs_in_namespace(objs, namespace):
    """Cluster-scoped objects that reference Secrets (the OSS PV) name the workload namespace."""
    problems = []
    for pv in of_kind(objs, "PersistentVolume"):
        ref = ((pv.get("spec") or {}).get("csi") or {}).get("nodePublishSecretRef")
        if ref and ref.get("namespace") != namespace:
            problems.append(f"{describe(pv)}: spec.csi.nodePublishSecretRef.namespace {ref.get('namespace')!r} "
                            f"!= workload namespace {namespace!r}")
    return problems


# The picker's own defaults for its flow-control age bounds (picker/src/picker/defaults.py), used
# when the manifest turns flow control on without naming them (tests/policy keeps them equal).
FLOW_MAX_WAIT_DEFAULT = 30.0
FLOW_MAX_WAIT_SHEDDABLE_DEFAULT = 5.0
FLOW_DECISION_MARGIN = 1.0  # seconds for the decision and the answer after the longest hold
EXT_PROC_MESSAGE_TIMEOUT_DEFAULT = 0.2  # Envoy Gateway's default messageTimeout


def _flow_max_wait(args) -> float | None:
    """The longest hold of the picker's flow control (seconds), None when it is off."""
    on = [a for a in args if a in ("--flow-control", "--no-flow-control")]
    if not on or on[-1] != "--flow-control":
        return None
    waits = []
    for flag, default in (("--flow-max-wait", FLOW_MAX_WAIT_DEFAULT),
                          ("--flow-max-wait-sheddable", FLOW_MAX_WAIT_SHEDDABLE_DEFAULT)):
        value = flag_values(args, flag)
        waits.append(float(value[0]) if value else default)
    return max(waits)


def flow_control_fits_timeouts(objs):
    """With --flow-control the picker holds a request up to its age bound before answering the
    ext_proc stream. Envoy must wait for that answer (EnvoyExtensionPolicy messageTimeout), the
    hold counts in the listener's requestReceivedTimeout (ClientTrafficPolicy: the request is not
    yet sent upstream), and the 8081 route's request timeout must leave room for it. Each must
    exceed the longest hold plus FLOW_DECISION_MARGIN, whatever the body mode."""
    picker = picker_container(objs)
    if picker[0] is None:
        return []
    hold = _flow_max_wait(argv(picker[1]))
    if hold is None:
        return []
    need = hold + FLOW_DECISION_MARGIN
    bound = (f"the picker's longest hold {hold:g}s (--flow-max-wait / --flow-max-wait-sheddable "
             f"in {describe(picker[0])}) + {FLOW_DECISION_MARGIN:g}s")
    problems = []
    llm_routes = {name_of(r) for r in routes_on_port(objs, 8081)}
    for eep in of_kind(objs, "EnvoyExtensionPolicy"):
        for i, ext in enumerate((eep.get("spec") or {}).get("extProc") or []):
            raw = ext.get("messageTimeout")
            timeout = seconds(raw) if raw is not None else EXT_PROC_MESSAGE_TIMEOUT_DEFAULT
            if timeout is None or timeout <= need:
                problems.append(f"{describe(eep)}: spec.extProc[{i}].messageTimeout "
                                f"{raw or 'unset (200ms)'} must exceed {bound}")
    for ctp in of_kind(objs, "ClientTrafficPolicy"):
        raw = ((((ctp.get("spec") or {}).get("timeout") or {}).get("http") or {})
               .get("requestReceivedTimeout"))
        timeout = seconds(raw) if raw is not None else None
        if raw is not None and (timeout is None or timeout <= need):
            problems.append(f"{describe(ctp)}: spec.timeout.http.requestReceivedTimeout {raw} must "
                            f"exceed {bound}")
    for btp in of_kind(objs, "BackendTrafficPolicy"):
        spec = btp.get("spec") or {}
        targets = {r.get("name") for r in spec.get("targetRefs") or [] if r.get("kind") == "HTTPRoute"}
        raw = ((spec.get("timeout") or {}).get("http") or {}).get("requestTimeout")
        if targets & llm_routes and raw is not None and (seconds(raw) or 0) <= need:
            problems.append(f"{describe(btp)}: spec.timeout.http.requestTimeout {raw} must exceed {bound}")
    for route in routes_on_port(objs, 8081):
        for i, rule in enumerate((route.get("spec") or {}).get("rules") or []):
            raw = (rule.get("timeouts") or {}).get("request")
            if raw is not None and (seconds(raw) or 0) <= need:
                problems.append(f"{describe(route)}: spec.rules[{i}].timeouts.request {raw} must "
                                f"exceed {bound}")
    return problems


ALL_CHECKS = [volume_mounts_have_volumes, pool_selects_leaders_only, ports_agree, parallelism_matches_resources,
              served_names_cover_rewrites, route_backends_exist, extension_policy_wiring,
              endpoint_override_on_8081, canary_weights_agree, llm_route_holds_whole_pool, images_pinned,
              no_secret_data, flow_control_fits_timeouts]
