"""KV-cache events: the vLLM leaders publish them where the picker subscribes, and only the
picker can connect.

- `kv_events_config_matches_ports`: every leader's `vllm serve` has `--kv-events-config` (valid
  JSON, events enabled, the ZMQ publisher) whose `endpoint` and `replay_endpoint` are bound
  (`tcp://*:PORT`: vLLM connects instead of binding to any other address) on the ports of the
  container ports named kv-events and kv-replay; the topic names the pod (`$(VAR)` of an env var
  read from metadata.name); prefix caching is not switched off (no events without it); no Service
  that selects the leaders exposes those ports (the picker connects to each leader pod; a Service
  port is what a Gateway route can send Envoy to).
- `kv_events_isolated`: on each leader, the rules that admit those ports admit the picker pods
  and nobody else (rules of the leader's own group excepted: Ray needs every port there), and
  the picker's egress is closed by a policy that lets it reach the leaders on those ports, with
  no other peer allowed on them.
"""
from __future__ import annotations

import json
import re

from validation.isolation import (ANY_PORT, KV_EVENT_PORT_NAMES, LWS_GROUP, LWS_NAME, Pod,
                                  _named_ports, _picker_labels, ingress_rules, is_pod_of, lws_pods,
                                  selects)
from validation.manifests import (argv, has_flag, flag_values, of_kind, ns_of, picker_container,
                                  pod_templates, vllm_container)
from validation.problems import describe

FLAG = "--kv-events-config"
WILDCARDS = ("*", "0.0.0.0", "::", "[::]")
LEADER_LABELS = {"app": "distributed-serving", "role": "leader"}


def _bound_port(endpoint) -> tuple[int | None, str | None]:
    """(port, None) for `tcp://<wildcard>:PORT`, else (None, why)."""
    if not isinstance(endpoint, str):
        return None, "is missing"
    m = re.fullmatch(r"tcp://(.+):(\d+)", endpoint)
    if not m:
        return None, f"{endpoint!r} is not tcp://*:PORT"
    if m.group(1) not in WILDCARDS:
        return None, (f"{endpoint!r} names a host: vLLM then connects to it instead of binding, "
                      f"so the picker has nothing to subscribe to (use tcp://*:PORT)")
    return int(m.group(2)), None


def _pod_name_vars(container) -> set[str]:
    return {e.get("name") for e in container.get("env") or []
            if ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") == "metadata.name"}


def _config_problems(where: str, container, named: dict[str, int]) -> list[str]:
    args = argv(container)
    values = flag_values(args, FLAG)
    if not values:
        return [f"{where}: vllm serve has no {FLAG}: the leader publishes no KV-cache events, "
                f"so the picker cannot route on what it has cached"]
    try:
        config = json.loads(values[0])
    except json.JSONDecodeError as err:
        return [f"{where}: {FLAG} is not valid JSON ({err})"]
    if not isinstance(config, dict):
        return [f"{where}: {FLAG} must be a JSON object"]
    problems = []
    if config.get("enable_kv_cache_events") is not True:
        problems.append(f"{where}: {FLAG} must set \"enable_kv_cache_events\": true")
    if config.get("publisher", "zmq") != "zmq":
        problems.append(f"{where}: {FLAG} publisher {config.get('publisher')!r}: the picker "
                        f"subscribes over ZMQ (\"publisher\": \"zmq\")")
    for key, name in (("endpoint", KV_EVENT_PORT_NAMES[0]), ("replay_endpoint", KV_EVENT_PORT_NAMES[1])):
        port, why = _bound_port(config.get(key))
        if why:
            problems.append(f"{where}: {FLAG} {key} {why}")
        elif name not in named:
            problems.append(f"{where}: no container port named {name!r} for the {key} "
                            f"(port {port}); the NetworkPolicies name it")
        elif named[name] != port:
            problems.append(f"{where}: {FLAG} {key} port {port} != container port {name!r} "
                            f"{named[name]}")
    topic = config.get("topic") or ""
    used = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", topic))
    if not used & _pod_name_vars(container):
        problems.append(f"{where}: {FLAG} topic {topic!r} does not name the pod: use $(VAR) of "
                        f"an env var read from metadata.name (fieldRef)")
    if has_flag(args, "--no-enable-prefix-caching"):
        problems.append(f"{where}: --no-enable-prefix-caching: vLLM publishes no KV-cache "
                        f"events without the prefix cache")
    return problems


def kv_events_config_matches_ports(objs):
    problems = []
    for t in pod_templates(objs):
        if t.role != "leader":
            continue
        path, container = vllm_container(t)
        if container is None:
            continue
        named = _named_ports(t)
        problems += _config_problems(f"{t.where}: {path}", container, named)
        ports = {named[n] for n in KV_EVENT_PORT_NAMES if n in named}
        for svc in of_kind(objs, "Service"):
            selector = (svc.get("spec") or {}).get("selector") or {}
            if ns_of(svc) != ns_of(t.owner) or not selector or not selects(
                    {"matchLabels": selector}, t.labels):
                continue
            for i, p in enumerate((svc.get("spec") or {}).get("ports") or []):
                target = p.get("targetPort", p.get("port"))
                number = named.get(target) if isinstance(target, str) else target
                if number in ports or target in KV_EVENT_PORT_NAMES:
                    problems.append(f"{describe(svc)} spec.ports[{i}]: exposes the KV-cache "
                                    f"event port {target} of the leaders; only the picker may "
                                    f"reach it, directly on each pod")
    return problems


# ---------------------------------------------------------------- isolation

def _same_group_only(rule, pod: Pod) -> bool:
    group = {LWS_NAME: pod.labels[LWS_NAME], LWS_GROUP: pod.labels[LWS_GROUP]}
    return rule.peers is not None and all(is_pod_of(p, group) for p in rule.peers)


def _leader_ingress_problems(objs, picker: dict) -> tuple[list[str], dict[str, int]]:
    problems, names = [], {}
    for pod in lws_pods(objs):
        if pod.template.role != "leader":
            continue
        named = _named_ports(pod.template)
        ports = [named[n] for n in KV_EVENT_PORT_NAMES if n in named]
        names.update({n: named[n] for n in KV_EVENT_PORT_NAMES if n in named})
        if not ports:
            continue
        rules = ingress_rules(objs, ns_of(pod.template.owner), pod.labels, named)
        if rules is None:
            problems.append(f"{pod.where}: no NetworkPolicy selects the leader pods, so any pod "
                            f"can read the KV-cache events on {ports}")
            continue
        for port in ports:
            for r in rules:
                if not r.admits(port) or _same_group_only(r, pod):
                    continue
                if r.peers is None:
                    problems.append(f"{r.where}: admits every source to KV-cache event port "
                                    f"{port} of {pod.where}; only the picker may connect")
                    continue
                for i, peer in enumerate(r.peers):
                    if not (picker and is_pod_of(peer, picker)):
                        problems.append(f"{r.where}.from[{i}]: {peer} may reach KV-cache event "
                                        f"port {port} of {pod.where}; only the picker may connect")
            if picker and not any(r.admits(port) and r.peers and any(is_pod_of(p, picker) for p in r.peers)
                                  for r in rules):
                problems.append(f"{pod.where}: the picker cannot reach KV-cache event port {port}")
    return problems, names


def _egress_rules(objs, namespace: str, labels: dict) -> list | None:
    """(policy, index, rule) of every egress rule that applies to a pod; None when no policy
    restricts its egress."""
    restricted, out = False, []
    for np in of_kind(objs, "NetworkPolicy"):
        spec = np.get("spec") or {}
        if ns_of(np) != namespace or not selects(spec.get("podSelector"), labels):
            continue
        if "Egress" not in (spec.get("policyTypes") or []):
            continue
        restricted = True
        out += [(np, i, rule) for i, rule in enumerate(spec.get("egress") or [])]
    return out if restricted else None


def _egress_ports(rule: dict, named: dict[str, int]) -> list[int] | None:
    ports = rule.get("ports")
    if not ports:
        return None
    out = []
    for p in ports:
        value = p.get("port")
        if value is None:
            return None
        number = named.get(value) if isinstance(value, str) else int(value)
        if number is not None:
            out.extend(range(number, int(p.get("endPort") or number) + 1))
    return out


def _is_leader_peer(peer: dict) -> bool:
    have = (peer.get("podSelector") or {}).get("matchLabels") or {}
    return ("ipBlock" not in peer and "namespaceSelector" not in peer and "podSelector" in peer
            and all(have.get(k) == v for k, v in LEADER_LABELS.items()))


def _picker_egress_problems(objs, names: dict[str, int]) -> list[str]:
    deployment, _ = picker_container(objs)
    if deployment is None or not names:
        return []
    t = next(t for t in pod_templates(objs) if t.owner is deployment)
    rules = _egress_rules(objs, ns_of(deployment), t.labels)
    if rules is None:
        return [f"{describe(deployment)}: no NetworkPolicy restricts the picker's egress; it "
                f"must reach the leaders' KV-cache event ports and be limited to its peers"]
    problems = []
    for port_name, port in names.items():
        reached = False
        for np, i, rule in rules:
            ports = _egress_ports(rule, names)
            if ports is not None and port not in ports and ANY_PORT not in ports:
                continue
            peers = rule.get("to")
            if not peers:
                problems.append(f"{describe(np)} spec.egress[{i}]: lets the picker reach every "
                                f"destination on port {port} ({port_name}); only the leaders")
                continue
            for j, peer in enumerate(peers):
                if _is_leader_peer(peer):
                    reached = True
                else:
                    problems.append(f"{describe(np)} spec.egress[{i}].to[{j}]: {peer} on port "
                                    f"{port} ({port_name}); the picker's KV-cache event egress "
                                    f"goes to the leaders only")
        if not reached:
            problems.append(f"{describe(deployment)}: the picker's egress policies do not let it "
                            f"reach the leaders on {port_name} ({port})")
    return problems


def kv_events_isolated(objs):
    picker = _picker_labels(objs)
    problems, names = _leader_ingress_problems(objs, picker)
    return problems + _picker_egress_problems(objs, names)


KV_EVENTS_CHECKS = [kv_events_config_matches_ports, kv_events_isolated]
