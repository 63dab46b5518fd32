"""What the rendered manifests say the local stack should look like: simulated groups from the
LeaderWorkerSets, the Services and routes over them, the picker's objects from its
InferenceObjectives and InferenceModelRewrite, Envoy Gateway's input from the gateway objects.
Reads, renders and checks; starts nothing.

Everything comes from one render of the overlay a cluster would deploy, without the parts that
need cluster Secrets: overlays/a10-open-gateway (overlays/a10-canary-open-gateway with --canary;
components/buffered-body with --body-mode buffered) plus the cluster's edge
(components/edge-security: API keys, rate limits, connection limit; plain HTTP, no TLS;
--no-edge-security leaves it out). overlays/a10 is exactly that plus TLS and the verified picker
hop."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from local import dataplane
from local.stack.config import REPO, StackConfig, StackError
from validation import manifests
from validation.render import kustomize as render_target

STABLE_SERVICE = "qwq-dist-v1"
OBJECT_KINDS = {"InferenceObjective", "InferenceModelRewrite"}


@dataclass
class SimGroup:
    lws: str  # the LeaderWorkerSet it stands in for
    port: int
    served_model_names: list[str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Topology:
    """What the manifests say the local stack should look like."""

    sims: list[SimGroup]
    services: dict[str, list[str]]             # Service name -> addresses of the leaders it selects
    http_route: list[tuple[str, int, list[str]]]  # (Service, weight, addresses) on listener `http`
    llm_route: list[tuple[str, int, list[str]]]   # the same on `llm-gw`
    objects: list[dict]                        # InferenceObjectives and InferenceModelRewrites
    gateway: list[dict]                        # the Gateway API and Envoy Gateway objects, as rendered
    body_mode: str                             # the picker's --request-body-mode, from the policy
    docs: list[dict]                           # the whole render (the picker's RBAC, control_plane.py)


def kustomize(path: str | Path) -> list[dict]:
    """The objects of a kustomization, rendered as `make validate` renders them."""
    result = render_target(REPO, str(path))
    if result.problems:
        raise StackError("; ".join(str(p) for p in result.problems))
    return result.objects


def render(config: StackConfig) -> list[dict]:
    """The overlay a cluster would deploy, with the config's components, rendered by kustomize."""
    if not config.components:
        return kustomize(config.overlay)
    with tempfile.TemporaryDirectory(prefix="local-render-") as tmp:
        # kustomize takes directories anywhere, but only by relative path
        def rel(path: str) -> str:
            return os.path.relpath(REPO / path, tmp)

        kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                         "resources": [rel(config.overlay)], "components": [rel(c) for c in config.components]}
        # the components' own objects land in the overlay's namespace, as in an overlay that lists them
        namespace = yaml.safe_load((REPO / config.overlay / "kustomization.yaml").read_text()).get("namespace")
        if namespace:
            kustomization["namespace"] = namespace
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return kustomize(tmp)


def _route_refs(docs: list[dict], section: str) -> list[tuple[str, int]]:
    routes = manifests.routes_on_listener(docs, section)
    if not routes:
        raise StackError(f"no HTTPRoute attached to listener {section!r} in the rendered manifests")
    return [(r["name"], int(r.get("weight", 1))) for r in manifests.backend_refs(routes[0])]


def _leader_sets(docs: list[dict]) -> list[tuple[str, dict, list[str]]]:
    """(LWS name, leader pod labels, served model names) for every LeaderWorkerSet."""
    served = manifests.served_model_names(docs)
    out = []
    for t in manifests.pod_templates(docs):
        if t.role != "leader":
            continue
        name = manifests.name_of(t.owner)
        if not served.get(name):
            raise StackError(f"LeaderWorkerSet {name!r}: no --served-model-name in its leader container")
        out.append((name, t.labels, served[name]))
    return out


BODY_MODES = {"Buffered": "buffered", "FullDuplexStreamed": "full-duplex"}


def _body_mode(docs: list[dict]) -> str:
    policy = next((d for d in docs if d.get("kind") == "EnvoyExtensionPolicy" and d["spec"].get("extProc")), None)
    if policy is None:
        raise StackError("the rendered manifests have no EnvoyExtensionPolicy (the picker's ext_proc)")
    mode = ((policy["spec"]["extProc"][0].get("processingMode") or {}).get("request") or {}).get("body")
    if mode not in BODY_MODES:
        raise StackError(f"EnvoyExtensionPolicy {policy['metadata']['name']}: request body mode {mode!r}; "
                         f"the picker supports {sorted(BODY_MODES)}")
    return BODY_MODES[mode]


def topology(config: StackConfig) -> Topology:
    """Every LeaderWorkerSet of the overlay becomes simulated groups (the stable one `groups` of
    them, every other one a single group); each Service gets the groups its selector matches, as
    Kubernetes endpoints would."""
    ports = list(config.sim_ports or [])
    needed = config.groups + (1 if config.canary else 0)
    if not ports:
        ports = [config.sim_base_port + i for i in range(needed)]
    if len(ports) < needed:
        raise StackError(f"{needed} simulator ports needed, {len(ports)} given")
    docs = render(config)
    sims: list[SimGroup] = []
    labels_of: dict[str, dict] = {}
    free = iter(ports)
    for name, labels, served in _leader_sets(docs):
        labels_of[name] = labels
        count = config.groups if name == STABLE_SERVICE else 1
        sims += [SimGroup(name, next(free), served) for _ in range(count)]
    if not any(s.lws == STABLE_SERVICE for s in sims) or len(sims) != needed:
        raise StackError(f"{config.overlay}: expected LeaderWorkerSet {STABLE_SERVICE!r}"
                         f"{' and one canary' if config.canary else ''}, found {sorted(labels_of)}")
    services = {manifests.name_of(svc): [s.address for s in sims if manifests.matches(
                    (svc.get("spec") or {}).get("selector") or {}, labels_of[s.lws])]
                for svc in manifests.of_kind(docs, "Service")}

    def route(section: str) -> list[tuple[str, int, list[str]]]:
        groups = []
        for service, weight in _route_refs(docs, section):
            if not services.get(service):
                raise StackError(f"{config.overlay}: HTTPRoute ({section}) backendRef Service {service!r} "
                                 "selects no leader")
            groups.append((service, weight, services[service]))
        return groups

    body_mode = _body_mode(docs)
    if config.body_mode and config.body_mode != body_mode:
        raise StackError(f"body mode {config.body_mode!r} asked, but the rendered EnvoyExtensionPolicy says "
                         f"{body_mode!r}")
    return Topology(sims, {k: v for k, v in services.items() if v}, route("http"), route("llm-gw"),
                    _objects(docs), dataplane.envoy_gateway_inputs(docs), body_mode, docs)


def _objects(docs: list[dict]) -> list[dict]:
    objects = [d for d in docs if d.get("kind") in OBJECT_KINDS]
    if not objects:
        raise StackError("the rendered manifests contain no InferenceObjective or InferenceModelRewrite")
    return objects


def listener_ports(topo: Topology, config: StackConfig) -> dict[str, int]:
    """Listener name -> local port: the config's, else the cluster port + the local offset."""
    ports = {}
    for gw in (d for d in topo.gateway if d["kind"] == "Gateway"):
        for listener in gw["spec"]["listeners"]:
            explicit = {"http": config.http_port, "llm-gw": config.llm_port}.get(listener["name"])
            ports[listener["name"]] = explicit or dataplane.local_listener_port(listener["port"])
    return ports


def picker_tls(topo: Topology) -> bool:
    """TLS to the picker exactly when the gateway's Backend for it says so (base/gateway: yes)."""
    return any(d["kind"] == "Backend" and dataplane.is_picker_backend(d) and "tls" in d["spec"]
               for d in topo.gateway)
