"""Isolation checks: which peers the NetworkPolicies let reach the model servers and the picker,
and the model servers' securityContext.

NetworkPolicy semantics (networking.k8s.io/v1): a pod selected by no Ingress policy accepts
everyone; a selected pod accepts the union of the rules of every policy selecting it. A rule
without `ports` admits every port, a rule without `from` admits every source; a peer without
`namespaceSelector` means the policy's own namespace. Each check derives the pods a template
will create (with the labels LeaderWorkerSet adds) and asks, per port, who may connect.
"""
from __future__ import annotations

from dataclasses import dataclass

from kubernetes.utils import parse_quantity

from validation.autoscaling import max_groups, scaled_lws
from validation.manifests import (PodTemplate, argv, flag_values, name_of, ns_of, of_kind,
                                  picker_container, pod_templates)
from validation.picker_ha import last_flag
from validation.problems import describe

LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER = "leaderworkerset.sigs.k8s.io/worker-index"
NS_NAME = "kubernetes.io/metadata.name"
GATEWAY = "inference-gateway"
ENVOY_NAMESPACE = "envoy-gateway-system"
ENVOY_LABELS = {"app.kubernetes.io/managed-by": "envoy-gateway",
                "app.kubernetes.io/component": "proxy",
                "gateway.envoyproxy.io/owning-gateway-name": GATEWAY}
MONITORING_NAMESPACE = "monitoring"
VLLM_PORT = 8000
PICKER_GRPC_PORTS = (9002, 9003)
PICKER_METRICS_PORT = 9090
KV_EVENT_PORT_NAMES = ("kv-events", "kv-replay")   # the leaders' KV-cache event ports
ANY_PORT = -1


# ---------------------------------------------------------------- selectors and rules

def selects(selector: dict | None, labels: dict) -> bool:
    """Label selector semantics: {} selects everything; matchLabels and matchExpressions AND."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


@dataclass
class Rule:
    policy: dict
    index: int
    ports: list[int] | None   # None = every port
    peers: list[dict] | None  # None = every source

    @property
    def where(self) -> str:
        return f"{describe(self.policy)} spec.ingress[{self.index}]"

    def admits(self, port: int) -> bool:
        return self.ports is None or port == ANY_PORT or port in self.ports


def rule_ports(rule: dict, named: dict[str, int]) -> list[int] | None:
    """The port numbers a NetworkPolicy rule admits (named ports resolved), None for every port."""
    ports = rule.get("ports")
    if not ports:
        return None
    out = []
    for p in ports:
        value = p.get("port")
        if value is None:
            return None  # a protocol without a port admits every port
        number = named.get(value) if isinstance(value, str) else int(value)
        if number is not None:
            end = p.get("endPort") or number
            out.extend(range(number, int(end) + 1))
    return out


def ingress_rules(objs, namespace: str, labels: dict, named_ports: dict[str, int]) -> list[Rule] | None:
    """The ingress rules that apply to a pod, or None when no policy isolates it."""
    isolated = False
    rules: list[Rule] = []
    for np in of_kind(objs, "NetworkPolicy"):
        spec = np.get("spec") or {}
        if ns_of(np) != namespace or not selects(spec.get("podSelector"), labels):
            continue
        types = spec.get("policyTypes") or ["Ingress"]
        if "Ingress" not in types:
            continue
        isolated = True
        for i, rule in enumerate(spec.get("ingress") or []):
            peers = rule.get("from")
            rules.append(Rule(np, i, rule_ports(rule, named_ports), peers or None))
    return rules if isolated else None


# ---------------------------------------------------------------- peers

def _labels(selector: dict | None) -> dict:
    return (selector or {}).get("matchLabels") or {}


def _narrow(selector: dict | None, required: dict) -> bool:
    have = _labels(selector)
    return all(have.get(k) == v for k, v in required.items())


def is_envoy(peer: dict) -> bool:
    """This Gateway's Envoy proxy pods (and nothing else) in Envoy Gateway's namespace."""
    return ("ipBlock" not in peer and "namespaceSelector" in peer
            and _narrow(peer["namespaceSelector"], {NS_NAME: ENVOY_NAMESPACE})
            and _narrow(peer.get("podSelector"), ENVOY_LABELS) and "podSelector" in peer)


def is_monitoring(peer: dict) -> bool:
    return ("ipBlock" not in peer and "namespaceSelector" in peer
            and _narrow(peer["namespaceSelector"], {NS_NAME: MONITORING_NAMESPACE}))


def is_pod_of(peer: dict, labels: dict) -> bool:
    """Pods of the policy's own namespace carrying all of `labels`."""
    return ("ipBlock" not in peer and "namespaceSelector" not in peer
            and "podSelector" in peer and bool(labels) and _narrow(peer["podSelector"], labels))


def _peer_problems(rule: Rule, port_text: str, allowed, allowed_text: str) -> list[str]:
    if rule.peers is None:
        return [f"{rule.where}: admits every source to {port_text}; only {allowed_text} may connect"]
    return [f"{rule.where}.from[{i}]: {peer} may reach {port_text}; only {allowed_text} may connect"
            for i, peer in enumerate(rule.peers) if not any(ok(peer) for ok in allowed)]


def _reaches(rules: list[Rule], port: int, ok) -> bool:
    return any(r.admits(port) and r.peers and any(ok(p) for p in r.peers) for r in rules)


# ---------------------------------------------------------------- pods the templates create

@dataclass
class Pod:
    template: PodTemplate
    labels: dict
    group: int | None

    @property
    def where(self) -> str:
        group = f" (group {self.group})" if self.group is not None else ""
        return f"{self.template.where}{group}"


def _named_ports(t: PodTemplate) -> dict[str, int]:
    out = {}
    for _, c in t.containers():
        for p in c.get("ports") or []:
            if p.get("name") and p.get("containerPort"):
                out[p["name"]] = int(p["containerPort"])
    return out


def lws_pods(objs):
    """One Pod per LeaderWorkerSet group and role, labelled as LWS labels them; for an autoscaled
    LeaderWorkerSet, every group up to its autoscaler's maximum."""
    for t in pod_templates(objs):
        if t.owner.get("kind") != "LeaderWorkerSet":
            continue
        for g in range(max_groups(objs, t.owner)):
            labels = {**t.labels, LWS_NAME: name_of(t.owner), LWS_GROUP: str(g),
                      LWS_WORKER: "0" if t.role == "leader" else "1"}
            yield Pod(t, labels, g)


def kv_event_ports(t: PodTemplate) -> set[int]:
    """The numbers of a template's KV-cache event ports (container ports kv-events, kv-replay)."""
    named = _named_ports(t)
    return {named[n] for n in KV_EVENT_PORT_NAMES if n in named}


def _group_labels(pod: Pod) -> dict:
    return {LWS_NAME: pod.labels[LWS_NAME], LWS_GROUP: pod.labels[LWS_GROUP]}


def ray_peers(objs, pod: Pod) -> tuple[dict, str]:
    """Who may reach a model pod's Ray/NCCL ports, and how to say it: the pods of its group, or,
    when an autoscaler adds groups no policy can list, the pods of its LeaderWorkerSet."""
    if (ns_of(pod.template.owner), pod.labels[LWS_NAME]) in scaled_lws(objs):
        return {LWS_NAME: pod.labels[LWS_NAME]}, f"pods of LeaderWorkerSet {pod.labels[LWS_NAME]}"
    return _group_labels(pod), f"pods of {pod.labels[LWS_NAME]} group {pod.group}"


def _picker_labels(objs) -> dict:
    deployment, _ = picker_container(objs)
    if deployment is None:
        return {}
    return ((((deployment.get("spec") or {}).get("template") or {}).get("metadata") or {})
            .get("labels") or {})


# ---------------------------------------------------------------- checks

def vllm_api_isolated(objs):
    """Leader port 8000 only from this Gateway's Envoy pods, the picker and `monitoring`; and
    both Envoy and the picker can reach it."""
    problems = []
    picker = _picker_labels(objs)
    allowed = [is_envoy, is_monitoring] + ([lambda p: is_pod_of(p, picker)] if picker else [])
    text = (f"the {GATEWAY} Envoy pods ({ENVOY_NAMESPACE}), the picker pods and namespace "
            f"{MONITORING_NAMESPACE!r}")
    for pod in lws_pods(objs):
        if pod.template.role != "leader":
            continue
        rules = ingress_rules(objs, ns_of(pod.template.owner), pod.labels, _named_ports(pod.template))
        if rules is None:
            problems.append(f"{pod.where}: no NetworkPolicy selects the leader pods, so any pod "
                            f"can call vLLM on {VLLM_PORT} past the Gateway")
            continue
        for r in rules:
            if r.admits(VLLM_PORT):
                peers, _ = ray_peers(objs, pod)
                same_group = r.peers is not None and all(is_pod_of(p, peers) for p in r.peers)
                if not same_group:
                    problems += _peer_problems(r, f"port {VLLM_PORT} of {pod.where}", allowed, text)
        if not _reaches(rules, VLLM_PORT, is_envoy):
            problems.append(f"{pod.where}: the {GATEWAY} Envoy pods cannot reach port {VLLM_PORT}")
        if picker and not _reaches(rules, VLLM_PORT, lambda p: is_pod_of(p, picker)):
            problems.append(f"{pod.where}: the picker cannot reach port {VLLM_PORT} (it scrapes /metrics)")
    return problems


def ray_ports_isolated(objs):
    """Every port other than the leader's 8000 only from pods of the same group (of the same
    LeaderWorkerSet when it is autoscaled), which can all reach each other (Ray, NCCL and Gloo
    use random ports)."""
    problems = []
    for pod in lws_pods(objs):
        group, text = ray_peers(objs, pod)
        rules = ingress_rules(objs, ns_of(pod.template.owner), pod.labels, _named_ports(pod.template))
        if rules is None:
            problems.append(f"{pod.where}: no NetworkPolicy selects these pods, so any pod can reach "
                            f"Ray (GCS 6379, client 10001)")
            continue
        kv_ports = kv_event_ports(pod.template) if pod.template.role == "leader" else set()
        for r in rules:
            # The API port and the KV-event ports have their own checks (vllm_api_isolated,
            # validation/kv_events.py).
            api_only = pod.template.role == "leader" and (
                r.ports == [VLLM_PORT] or bool(r.ports and set(r.ports) <= kv_ports))
            if not api_only:
                problems += _peer_problems(r, f"Ray/NCCL ports of {pod.where}",
                                           [lambda p, g=group: is_pod_of(p, g)], text)
        if not any(r.ports is None and r.peers and any(is_pod_of(p, group) for p in r.peers)
                   for r in rules):
            remedy = (f"add a policy for group {pod.group}" if LWS_GROUP in group
                      else f"add a policy admitting the pods of {pod.labels[LWS_NAME]}")
            problems.append(f"{pod.where}: {text} cannot reach every port of these pods, so Ray "
                            f"and NCCL cannot connect ({remedy})")
    return problems


def _peer_port(container) -> int | None:
    """The replicas' link port (--peer-port, 9005 by default) when the picker runs --peers."""
    args = argv(container)
    return int(last_flag(args, "--peer-port")) if last_flag(args, "--peers") else None


def picker_isolated(objs):
    """The picker's ext_proc and health ports only from Envoy, /metrics only from `monitoring`,
    the replicas' link (--peer-port) only from the picker's own pods."""
    deployment, container = picker_container(objs)
    if deployment is None:
        return []
    t = next(t for t in pod_templates(objs) if t.owner is deployment)
    rules = ingress_rules(objs, ns_of(deployment), t.labels, _named_ports(t))
    if rules is None:
        return [f"{describe(deployment)}: no NetworkPolicy selects the picker pods, so any pod can "
                f"send it requests"]
    problems = []
    peer = _peer_port(container)
    for r in rules:
        ports = r.ports if r.ports is not None else [ANY_PORT]
        if peer is not None and r.ports == [peer]:
            problems += _peer_problems(r, f"the replicas' link port {peer}",
                                       [lambda p: is_pod_of(p, t.labels)], "the picker's own pods")
        elif any(p != PICKER_METRICS_PORT for p in ports):
            problems += _peer_problems(r, f"the picker's ports {r.ports or 'all'}", [is_envoy],
                                       f"the {GATEWAY} Envoy pods")
        elif r.ports == [PICKER_METRICS_PORT]:
            problems += _peer_problems(r, "the picker's /metrics port", [is_monitoring],
                                       f"namespace {MONITORING_NAMESPACE!r}")
    if not _reaches(rules, PICKER_GRPC_PORTS[0], is_envoy):
        problems.append(f"{describe(deployment)}: the {GATEWAY} Envoy pods cannot reach ext_proc "
                        f"port {PICKER_GRPC_PORTS[0]}")
    return problems


WRITABLE_DIRS = ("/tmp",)


def vllm_pods_hardened(objs):
    """vLLM/Ray containers: non-root, no privilege escalation, no capabilities, read-only root
    filesystem with writable emptyDirs for /tmp (Ray's session files) and HOME (caches)."""
    problems = []
    for t in pod_templates(objs):
        if t.owner.get("kind") != "LeaderWorkerSet":
            continue
        pod_sc = t.spec.get("securityContext") or {}
        for path, c in t.containers():
            sc = c.get("securityContext") or {}
            where = f"{t.where}: {path}"
            if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))):
                problems.append(f"{where}.securityContext.runAsNonRoot must be true")
            if (sc.get("runAsUser", pod_sc.get("runAsUser")) or 0) == 0:
                problems.append(f"{where}.securityContext.runAsUser must be a non-zero uid")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}.securityContext.allowPrivilegeEscalation must be false")
            if sc.get("privileged"):
                problems.append(f"{where}.securityContext.privileged must not be set")
            if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                problems.append(f"{where}.securityContext.capabilities.drop must contain ALL")
            if (sc.get("capabilities") or {}).get("add"):
                problems.append(f"{where}.securityContext.capabilities.add must be empty")
            seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                problems.append(f"{where}: seccompProfile.type must be RuntimeDefault")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}.securityContext.readOnlyRootFilesystem must be true")
                continue
            mounts = {m.get("mountPath") for m in c.get("volumeMounts") or [] if not m.get("readOnly")}
            home = next((e.get("value") for e in c.get("env") or [] if e.get("name") == "HOME"), None)
            for needed in WRITABLE_DIRS + ((home,) if home else ()):
                if needed not in mounts:
                    problems.append(f"{where}: the root filesystem is read-only but {needed} has no "
                                    f"writable volumeMount")
            if home is None:
                problems.append(f"{where}.env: HOME must name a writable volume (caches; the image's "
                                f"/root is not writable by a non-root user)")
    return problems


def picker_body_limit_matches_gateway(objs):
    """The picker's --max-body-bytes equals the request size the gateway lets through (the
    ClientTrafficPolicy's connection.bufferLimit): smaller, the picker refuses requests the
    gateway accepted; larger, the replica budgets for bodies it never sees."""
    deployment, container = picker_container(objs)
    if deployment is None:
        return []
    values = flag_values(argv(container), "--max-body-bytes")
    picker_limit = int(values[0]) if values else 8 * 1024 * 1024  # the picker's default
    problems = []
    for ctp in of_kind(objs, "ClientTrafficPolicy"):
        limit = (((ctp.get("spec") or {}).get("connection") or {}).get("bufferLimit"))
        if limit is not None and int(parse_quantity(limit)) != picker_limit:
            problems.append(f"{describe(ctp)}: spec.connection.bufferLimit {limit} "
                            f"({int(parse_quantity(limit))} bytes) != the picker's --max-body-bytes "
                            f"{picker_limit} in {describe(deployment)}")
    return problems


ISOLATION_CHECKS = [vllm_api_isolated, ray_ports_isolated, picker_isolated, vllm_pods_hardened,
                    picker_body_limit_matches_gateway]
