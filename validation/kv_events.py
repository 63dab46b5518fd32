"""KV-cache events: the vLLM leaders publish them where the picker subscribes, and only the
picker can connect.

- `kv_events_config_matches_ports`: every leader's `vllm serve` has `--kv-events-config` (valid
  JSON, events enabled, the ZMQ publisher) whose `endpoint` and `replay_endpoint` are bound
  (`tcp://*:PORT`: vLLM connects instead of binding to any other address) on the ports of the
  container ports named kv-events and kv-replay; the topic names the pod (`$(VAR)` of an env var
  read from metadata.name); prefix caching is not switched off (no events without it); no Service
  that selects the leaders exposes those ports (the picker connects to each leader pod; a Service
  port is what a Gateway route can send Envoy to); the picker's `--kv-events-port` and
  `--kv-replay-port` (its fallback when a leader's /kv_event_sources does not answer) are those
  ports; with `--precise-prefix` (the picker's default) it has `--tokenizer DIR` and DIR lies on
  a read-only mount of the leaders' model volume (the same PersistentVolumeClaim).
- `kv_events_isolated`: on each leader, the rules that admit those ports admit the picker pods
  and nobody else (rules of the leader's own group excepted: Ray needs every port there), and
  the picker's egress is closed by a policy that lets it reach the leaders on those ports, with
  no other peer allowed on them.
"""
from __future__ import annotations

import json
import re

from validation.isolation import (ANY_PORT, KV_EVENT_PORT_NAMES, Pod, rule_ports,
                                  _named_ports, _picker_labels, ingress_rules, is_pod_of, lws_pods,
                                  ray_peers, selects)
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


PICKER_DEFAULTS = {"--kv-events-port": 5557, "--kv-replay-port": 5558}
PICKER_PORT_FLAGS = {"--kv-events-port": KV_EVENT_PORT_NAMES[0], "--kv-replay-port": KV_EVENT_PORT_NAMES[1]}


def _claims(t, container) -> dict[str, str]:
    """mountPath -> (claimName, readOnly) of a container's PersistentVolumeClaim mounts."""
    volumes = {v.get("name"): (v.get("persistentVolumeClaim") or {}).get("claimName")
               for v in t.spec.get("volumes") or []}
    return {m.get("mountPath", "").rstrip("/"): (volumes.get(m.get("name")), bool(m.get("readOnly")))
            for m in container.get("volumeMounts") or [] if volumes.get(m.get("name"))}


def _picker_problems(objs, leader_ports: dict[str, int], model_claims: set[str]) -> list[str]:
    deployment, container = picker_container(objs)
    if deployment is None:
        return []
    args, where = argv(container), describe(deployment)
    problems = []
    for flag, name in PICKER_PORT_FLAGS.items():
        values = flag_values(args, flag)
        port = int(values[0]) if values else PICKER_DEFAULTS[flag]
        if name in leader_ports and port != leader_ports[name]:
            problems.append(f"{where}: the picker's {flag} {port} != the leaders' container port "
                            f"{name!r} {leader_ports[name]}")
    if has_flag(args, "--no-precise-prefix"):
        return problems
    tokenizer = flag_values(args, "--tokenizer")
    if not tokenizer:
        return problems + [f"{where}: --precise-prefix without --tokenizer: the picker cannot "
                           f"compute the engines' token ids and routes on its approximate index "
                           f"(give it the model volume's directory)"]
    t = next(t for t in pod_templates(objs) if t.owner is deployment)
    path = tokenizer[0].rstrip("/")
    mounts = _claims(t, container)
    mount = max((m for m in mounts if path == m or path.startswith(m + "/")), key=len, default=None)
    if mount is None:
        return problems + [f"{where}: --tokenizer {tokenizer[0]} is on no volume mount of the "
                           f"model's PersistentVolumeClaim"]
    claim, read_only = mounts[mount]
    if model_claims and claim not in model_claims:
        problems.append(f"{where}: --tokenizer {tokenizer[0]} is on claim {claim!r}, not the "
                        f"leaders' model volume ({', '.join(sorted(model_claims))})")
    if not read_only:
        problems.append(f"{where}: the model volume at {mount} must be mounted readOnly: true "
                        f"in the picker")
    return problems


def kv_events_config_matches_ports(objs):
    problems = []
    leader_ports: dict[str, int] = {}
    model_claims: set[str] = set()
    for t in pod_templates(objs):
        if t.role != "leader":
            continue
        path, container = vllm_container(t)
        if container is None:
            continue
        named = _named_ports(t)
        problems += _config_problems(f"{t.where}: {path}", container, named)
        leader_ports.update({n: named[n] for n in KV_EVENT_PORT_NAMES if n in named})
        model_dirs = [a for a in argv(container) if a.startswith("/")]
        model_claims.update(claim for mount, (claim, _) in _claims(t, container).items()
                            if any(d.rstrip("/") == mount for d in model_dirs))
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
    return problems + _picker_problems(objs, leader_ports, model_claims)


# ---------------------------------------------------------------- isolation

def _same_group_only(objs, rule, pod: Pod) -> bool:
    """The rule admits only the pod's Ray peers: its group, or its LeaderWorkerSet when autoscaled."""
    peers, _ = ray_peers(objs, pod)
    return rule.peers is not None and all(is_pod_of(p, peers) for p in rule.peers)


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
                if not r.admits(port) or _same_group_only(objs, r, pod):
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
            ports = rule_ports(rule, names)
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
