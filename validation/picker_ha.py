"""Picker replicas route as one: a picker Deployment with more than one replica runs
active-passive (`--leader-election`), unless it says it runs active-active on purpose with the
annotation HA_MODE_ANNOTATION: "active-active" (each replica then decides alone from its own
state: measured +15.6 % mean TTFT with 2 replicas, +33.6 % with 4 on shared prefixes,
BENCHMARKS.md "Picker replicas with precise prefix routing").

With `--leader-election` (`picker_leader_election_works`):
- the Deployment's ServiceAccount is bound (RoleBinding in the Lease's namespace, to a Role or
  ClusterRole) to get and update the Lease (`leases` in coordination.k8s.io, resourceNames empty
  or naming it: `--leader-election-lease-name`, else `<pool-name>-picker`) and to create leases
  (create cannot be limited by resourceNames);
- only the leader is Ready, so a rollout with maxUnavailable below 100 % never deletes the old
  leader (new pods cannot become Ready while it holds the Lease: the rollout is stuck), and a
  PodDisruptionBudget that protects any pod (minAvailable > 0, maxUnavailable below the replica
  count) leaves the leader 0 disruptions (a node drain waits forever).

And, with more than one replica, a failover Envoy sees at once (`picker_failover_visible`):
- the replicas are linked (`--peers` naming a headless Service over the picker pods, with
  publishNotReadyAddresses, on `--peer-port`; the NetworkPolicies let the pods reach each other
  there): otherwise a standby learns that the leader is gone only when the Lease expires;
- the gateway's ext_proc Backend names such a Service on the ext_proc port (every replica, ready
  or not), and its backendSettings health-check them over gRPC on that port for a service only
  the acting leader answers SERVING ("", readiness or the ext_proc name; not `liveness` or `warm`,
  which every replica answers), often enough that the stopping leader's --drain-seconds outlast
  one check (interval + timeout);
- panicThreshold above 0 (with no replica SERVING, at a takeover, Envoy tries them all instead of
  failing) and below 100 / replicas (one SERVING replica keeps Envoy out of panic, which would
  send streams to the standbys);
- a retry on connect-failure (a stream to a leader that just died goes to another replica), kept
  off the replicas the stream already tried: an EnvoyPatchPolicy adds the previous_hosts retry
  host predicate to the ext_proc filter's retry policy on every listener of the route (Envoy
  Gateway does not expose it; without it, at a takeover, when no replica is healthy yet, every try
  can pick the dead one).
"""
from __future__ import annotations

import re

from validation.manifests import (argv, flag_values, matches, name_of, ns_of, of_kind,
                                  pod_templates, seconds)
from validation.problems import describe

HA_MODE_ANNOTATION = "picker.llm-gitops.io/ha-mode"
ACTIVE_ACTIVE, ACTIVE_PASSIVE = "active-active", "active-passive"
LEASE_GROUP, LEASES = "coordination.k8s.io", "leases"
LEASE_VERBS = ("get", "update", "create")


def _pickers(objs):
    """(Deployment, container) of every Deployment running `python -m picker`."""
    for t in pod_templates(objs):
        if t.owner.get("kind") != "Deployment":
            continue
        for _, c in t.containers():
            args = argv(c)
            if "-m" in args and "picker" in args:
                yield t.owner, c


def leader_election_on(args: list[str]) -> bool:
    """The last of --leader-election / --no-leader-election wins (argparse)."""
    on = False
    for a in args:
        if a in ("--leader-election", "--leader-election=true"):
            on = True
        elif a == "--no-leader-election":
            on = False
    return on


def _flag(args, flag, default=None):
    values = flag_values(args, flag)
    return values[0] if values else default


def _resolve_namespace(value: str | None, deployment, container) -> str:
    """A `$(VAR)` read from metadata.namespace (the downward API) is the Deployment's own."""
    own = ns_of(deployment)
    if not value:
        return own
    if value.startswith("$(") and value.endswith(")"):
        var = value[2:-1]
        for e in container.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("fieldRef") or {}
            if e.get("name") == var and ref.get("fieldPath") == "metadata.namespace":
                return own
    return value


def lease_of(deployment, container) -> tuple[str, str]:
    """(namespace, name) of the Lease the picker competes for (picker/src/picker/config.py)."""
    args = argv(container)
    name = _flag(args, "--leader-election-lease-name") or \
        f"{_flag(args, '--pool-name', 'reasoning-pool')}-picker"
    namespace = _flag(args, "--leader-election-namespace") or _flag(args, "--pool-namespace",
                                                                     "default")
    return _resolve_namespace(namespace, deployment, container), name


def _rules_granted(objs, namespace: str, service_account: str, sa_namespace: str) -> list[dict]:
    """The rules of every Role/ClusterRole bound in `namespace` to the ServiceAccount."""
    rules = []
    for binding in of_kind(objs, "RoleBinding"):
        if ns_of(binding) != namespace:
            continue
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == service_account
                   and (s.get("namespace") or ns_of(binding)) == sa_namespace
                   for s in binding.get("subjects") or []):
            continue
        ref = binding.get("roleRef") or {}
        for role in of_kind(objs, ref.get("kind", "Role")):
            if name_of(role) == ref.get("name") and (ref.get("kind") == "ClusterRole"
                                                     or ns_of(role) == namespace):
                rules += role.get("rules") or []
    return rules


def _grants(rules: list[dict], verb: str, lease: str) -> bool:
    for r in rules:
        if not {LEASE_GROUP, "*"} & set(r.get("apiGroups") or []):
            continue
        if not {LEASES, "*"} & set(r.get("resources") or []):
            continue
        if not {verb, "*"} & set(r.get("verbs") or []):
            continue
        names = r.get("resourceNames") or []
        if not names or (verb != "create" and lease in names):
            return True
    return False


def _percent_or_int(value, replicas: int) -> int:
    if isinstance(value, str) and value.endswith("%"):
        return -(-int(value[:-1]) * replicas // 100)  # ceil, as the controllers round up
    return int(value)


def picker_replicas_route_as_one(objs) -> list[str]:
    """More than one picker replica: --leader-election, or the active-active annotation."""
    problems = []
    for d, c in _pickers(objs):
        where = describe(d)
        replicas = (d.get("spec") or {}).get("replicas", 1)
        mode = ((d.get("metadata") or {}).get("annotations") or {}).get(HA_MODE_ANNOTATION)
        elected = leader_election_on(argv(c))
        if mode not in (None, ACTIVE_ACTIVE, ACTIVE_PASSIVE):
            problems.append(f"{where}: annotation {HA_MODE_ANNOTATION}: {mode!r} is neither "
                            f"{ACTIVE_PASSIVE!r} nor {ACTIVE_ACTIVE!r}")
        elif mode == ACTIVE_ACTIVE and elected:
            problems.append(f"{where}: annotation {HA_MODE_ANNOTATION}: {ACTIVE_ACTIVE} but the "
                            f"picker runs --leader-election (only one replica serves)")
        elif mode == ACTIVE_PASSIVE and not elected:
            problems.append(f"{where}: annotation {HA_MODE_ANNOTATION}: {ACTIVE_PASSIVE} but the "
                            f"picker has no --leader-election")
        elif isinstance(replicas, int) and replicas > 1 and not elected and mode != ACTIVE_ACTIVE:
            problems.append(f"{where}: spec.replicas {replicas} without --leader-election: each "
                            f"replica routes from its own state, as independent pickers (mean "
                            f"TTFT +15.6 % with 2 on shared prefixes, BENCHMARKS.md). Add "
                            f"--leader-election (one leader routes, the others are warm "
                            f"standbys), or annotate the Deployment {HA_MODE_ANNOTATION}: "
                            f"{ACTIVE_ACTIVE} to mean it")
    return problems


def picker_leader_election_works(objs) -> list[str]:
    """With --leader-election: the Lease verbs granted, and a rollout and a drain that can
    replace the leader."""
    problems = []
    for d, c in _pickers(objs):
        if not leader_election_on(argv(c)):
            continue
        where = describe(d)
        spec = d.get("spec") or {}
        pod_spec = (spec.get("template") or {}).get("spec") or {}
        sa = pod_spec.get("serviceAccountName") or "default"
        namespace, lease = lease_of(d, c)
        rules = _rules_granted(objs, namespace, sa, ns_of(d))
        missing = [v for v in LEASE_VERBS if not _grants(rules, v, lease)]
        if missing:
            problems.append(f"{where}: --leader-election, but ServiceAccount {sa} may not "
                            f"{'/'.join(missing)} the Lease {namespace}/{lease} (a RoleBinding in "
                            f"{namespace} to a Role with apiGroups [{LEASE_GROUP}], resources "
                            f"[{LEASES}], verbs get/update with resourceNames [{lease}] and "
                            f"create): no replica can lead, none gets ready")
        problems += _rollout_problems(where, spec)
        problems += _budget_problems(objs, d, where, spec.get("replicas", 1))
    return problems


def _rollout_problems(where: str, spec: dict) -> list[str]:
    strategy = spec.get("strategy") or {}
    if strategy.get("type") == "Recreate":
        return []
    replicas = spec.get("replicas", 1)
    unavailable = (strategy.get("rollingUpdate") or {}).get("maxUnavailable", "25%")
    if _percent_or_int(unavailable, replicas) >= replicas:
        return []
    return [f"{where}: --leader-election with rollingUpdate maxUnavailable {unavailable}: only "
            f"the leader is Ready and new pods cannot get Ready while it holds the Lease, so the "
            f"rollout never deletes it (stuck). Use maxUnavailable: 100% (or Recreate)"]


def _budget_problems(objs, d, where: str, replicas: int) -> list[str]:
    labels = (((d.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}
    problems = []
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        spec = pdb.get("spec") or {}
        selector = (spec.get("selector") or {}).get("matchLabels") or {}
        if ns_of(pdb) != ns_of(d) or not selector or \
                any(labels.get(k) != v for k, v in selector.items()):
            continue
        if "minAvailable" in spec:
            blocks = _percent_or_int(spec["minAvailable"], replicas) > 0
            field = f"minAvailable {spec['minAvailable']}"
        else:
            blocks = _percent_or_int(spec.get("maxUnavailable", 0), replicas) < replicas
            field = f"maxUnavailable {spec.get('maxUnavailable')}"
        if blocks:
            problems.append(f"{where}: --leader-election with {describe(pdb)} {field}: a budget "
                            f"counts Ready pods and only the leader is Ready, so the leader gets "
                            f"0 disruptions and a node drain waits on it forever. Use "
                            f"maxUnavailable: 100% (the handover on SIGTERM protects the route)")
    return problems


EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
ACTING_SERVICES = ("", "readiness", EXT_PROC_SERVICE)   # SERVING only on the acting leader
DEFAULTS = {"--grpc-port": "9002", "--peer-port": "9005", "--drain-seconds": "1"}


def last_flag(args: list[str], flag: str) -> str | None:
    """The value of the last `--flag v` / `--flag=v` (argparse: the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value if value is not None else DEFAULTS.get(flag)


def _service_of_host(objs, host: str, namespace: str):
    """The Service a cluster DNS name (name, name.ns, name.ns.svc[.cluster.local]) resolves to."""
    parts = host.rstrip(".").split(".")
    name, ns = parts[0], parts[1] if len(parts) > 1 else namespace
    ns = namespace if ns == "$(POD_NAMESPACE)" else ns
    return next((s for s in of_kind(objs, "Service") if name_of(s) == name and ns_of(s) == ns),
                None)


def _every_replica(svc, labels: dict, target: int) -> str | None:
    """Why `svc` does not resolve to every picker replica on `target`, or None."""
    spec = (svc.get("spec") or {}) if svc else {}
    if svc is None:
        return "no such Service"
    if not matches(spec.get("selector") or {}, labels):
        return "it does not select the picker pods"
    if spec.get("clusterIP") != "None":
        return "it is not headless (clusterIP: None): its name resolves to one virtual IP"
    if not spec.get("publishNotReadyAddresses"):
        return ("it lacks publishNotReadyAddresses: true: a standby (not Ready) is left out of "
                "DNS until it leads")
    if not any(p.get("targetPort", p.get("port")) == target for p in spec.get("ports") or []):
        return f"no port forwards to {target}"
    return None


def _admits(policy: dict, labels: dict, port: int, direction: str) -> bool:
    key, peer = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for rule in (policy.get("spec") or {}).get(key) or []:
        ports = [p.get("port") for p in rule.get("ports") or []]
        if ports and port not in ports:
            continue
        if any(matches((f.get("podSelector") or {}).get("matchLabels") or {}, labels)
               and not f.get("namespaceSelector") for f in rule.get(peer) or []):
            return True
    return False


def _link_problems(objs, where, d, args, labels) -> list[str]:
    peers = last_flag(args, "--peers")
    peer_port = int(last_flag(args, "--peer-port"))
    if not peers:
        return [f"{where}: {d['spec'].get('replicas')} replicas with --leader-election but no "
                f"--peers: a standby learns that the leader is gone only when the Lease expires "
                f"(a second of 5xx per second of lease duration), and routes without the leader's "
                f"in-flight counts. Add --peers <headless Service>:{peer_port}"]
    problems = []
    for item in peers.split(","):
        host, _, port = item.strip().rpartition(":")
        svc = _service_of_host(objs, host, ns_of(d))
        why = _every_replica(svc, labels, peer_port)
        if why or not port.isdigit() or not any(p.get("port") == int(port)
                                                for p in (svc.get("spec") or {}).get("ports") or []):
            problems.append(f"{where}: --peers {item}: the replicas find each other through a "
                            f"headless Service over the picker pods on --peer-port {peer_port}; "
                            f"{why or f'port {port} is not one of its ports'}")
    for policy in of_kind(objs, "NetworkPolicy"):
        spec = policy.get("spec") or {}
        if ns_of(policy) != ns_of(d) or not matches(
                (spec.get("podSelector") or {}).get("matchLabels") or {}, labels):
            continue
        for direction in spec.get("policyTypes") or ["Ingress"]:
            if not _admits(policy, labels, peer_port, direction):
                problems.append(f"{where}: {describe(policy)} ({direction}) does not let the "
                                f"picker pods reach each other on --peer-port {peer_port}: the "
                                f"replicas' link is cut")
    return problems


def _envoy_problems(objs, where, d, args, labels, replicas: int) -> list[str]:
    grpc_port, drain = int(last_flag(args, "--grpc-port")), float(last_flag(args, "--drain-seconds"))
    problems = []
    backends = {name_of(b): b for b in of_kind(objs, "Backend")}
    for eep in of_kind(objs, "EnvoyExtensionPolicy"):
        for i, ext in enumerate((eep.get("spec") or {}).get("extProc") or []):
            at = f"{describe(eep)}: spec.extProc[{i}]"
            for ref in ext.get("backendRefs") or []:
                backend = backends.get(ref.get("name")) if ref.get("kind") == "Backend" else None
                for ep in ((backend or {}).get("spec") or {}).get("endpoints") or []:
                    host = (ep.get("fqdn") or {}).get("hostname")
                    if host is None:
                        continue
                    why = _every_replica(_service_of_host(objs, host, ns_of(d)), labels, grpc_port)
                    if why:
                        problems.append(f"{describe(backend)}: fqdn {host}: Envoy must reach every "
                                        f"picker replica to fail over without waiting for "
                                        f"Kubernetes to move a Service; {why}")
            settings = ext.get("backendSettings") or {}
            hc = settings.get("healthCheck") or {}
            active = hc.get("active") or {}
            service = (active.get("grpc") or {}).get("service", "")
            override = (active.get("overrides") or {}).get("port")
            if active.get("type") != "GRPC" or service not in ACTING_SERVICES or \
                    override not in (None, grpc_port):
                problems.append(f"{at}.backendSettings.healthCheck.active: Envoy must ask each "
                                f"replica's ext_proc port (no overrides.port) over gRPC for a service "
                                f"only the acting leader answers SERVING ({', '.join(repr(s) for s in ACTING_SERVICES)}); "
                                f"without it every stream may reach a standby or a dead leader")
            else:
                check = (seconds(active.get("interval", "3s")) or 3.0) + \
                    (seconds(active.get("timeout", "1s")) or 1.0)
                if drain < check:
                    problems.append(f"{at}.backendSettings.healthCheck.active: interval + timeout "
                                    f"{check:g} s exceed the picker's --drain-seconds {drain:g}: a "
                                    f"stopping leader stops answering before Envoy has seen it "
                                    f"stop serving")
            problems += _cadence_problems(objs, eep, i, active)
            panic = hc.get("panicThreshold")
            if panic is None or not 0 < panic < 100 / replicas:
                problems.append(f"{at}.backendSettings.healthCheck.panicThreshold: "
                                f"{'unset (50 %)' if panic is None else panic} must be above 0 "
                                f"(with no replica SERVING, at a takeover, Envoy then tries every "
                                f"replica instead of failing) and below 100 / {replicas} replicas "
                                f"(one SERVING replica keeps Envoy out of panic, which would send "
                                f"streams to the standbys)")
            triggers = ((settings.get("retry") or {}).get("retryOn") or {}).get("triggers") or []
            if "connect-failure" not in triggers:
                problems.append(f"{at}.backendSettings.retry.retryOn.triggers: must include "
                                f"connect-failure: a stream to a leader that just died goes to "
                                f"another replica instead of failing")
            else:
                problems += _retry_host_problems(objs, eep, i)
    return problems


NO_TRAFFIC = ("/health_checks/0/no_traffic_interval", "/health_checks/0/no_traffic_healthy_interval")
AUTHORITY = "/health_checks/0/grpc_health_check/authority"


def _host_name(value) -> bool:
    return isinstance(value, str) and bool(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", value))


def _cadence_problems(objs, eep, i: int, active: dict) -> list[str]:
    """Envoy checks every 60 s (no_traffic_interval) until the cluster has made a connection:
    an EnvoyPatchPolicy must set both no-traffic intervals of this ext_proc cluster to at most
    the policy's interval, and the check's :authority to a host name."""
    cluster = f"envoyextensionpolicy/{ns_of(eep)}/{name_of(eep)}/extproc/{i}"
    interval = seconds(active.get("interval", "3s")) or 3.0
    patched, authorities = {}, []
    for epp in of_kind(objs, "EnvoyPatchPolicy"):
        if ns_of(epp) != ns_of(eep):
            continue
        for patch in (epp.get("spec") or {}).get("jsonPatches") or []:
            op = patch.get("operation") or {}
            if patch.get("name") == cluster and op.get("path") in NO_TRAFFIC:
                patched[op["path"]] = seconds(op.get("value"))
            if patch.get("name") == cluster and op.get("path") == AUTHORITY:
                authorities.append(op.get("value"))
    short = all(patched.get(path) is not None and patched[path] <= interval for path in NO_TRAFFIC)
    problems = [] if authorities and all(_host_name(a) for a in authorities) else [
        f"{describe(eep)}: spec.extProc[{i}]: no EnvoyPatchPolicy sets the health check's "
        f"grpc_health_check.authority of cluster {cluster} to a host name (got "
        f"{authorities or 'none'}): Envoy then sends the cluster's name, slashes and all, and the "
        f"picker's compiled ext_proc server resets such a request, so every check fails and Envoy "
        f"spreads the streams over every replica (base/gateway/picker-health-check.yaml)"]
    if short:
        return problems
    return problems + [f"{describe(eep)}: spec.extProc[{i}]: no EnvoyPatchPolicy sets the health check's "
            f"no_traffic_interval and no_traffic_healthy_interval of cluster {cluster} to at most "
            f"its interval ({interval:g} s): until that cluster has made a connection (for up to "
            f"a minute after each Envoy start) Envoy checks the replicas every 60 s and does not "
            f"see a failover (base/gateway/picker-health-check.yaml)"]


PREVIOUS_HOSTS = "envoy.retry_host_predicates.previous_hosts"


def _listeners_of(objs, eep) -> list[str]:
    """Envoy Gateway's names (NS/GATEWAY/LISTENER) of the listeners of the routes `eep` targets."""
    gateways = {(ns_of(g), name_of(g)): g for g in of_kind(objs, "Gateway")}
    names = []
    for ref in (eep.get("spec") or {}).get("targetRefs") or []:
        route = next((r for r in of_kind(objs, ref.get("kind", "")) if name_of(r) == ref.get("name")
                      and ns_of(r) == ns_of(eep)), None)
        for parent in ((route or {}).get("spec") or {}).get("parentRefs") or []:
            ns = parent.get("namespace") or ns_of(route)
            gateway = gateways.get((ns, parent.get("name")))
            listeners = [parent["sectionName"]] if parent.get("sectionName") else [
                listener.get("name") for listener in ((gateway or {}).get("spec") or {}).get("listeners") or []]
            names += [f"{ns}/{parent.get('name')}/{listener}" for listener in listeners]
    return names


def _retry_host_problems(objs, eep, i: int) -> list[str]:
    """Every listener of the policy's routes gets the previous_hosts retry host predicate on this
    ext_proc filter's retry policy (an EnvoyPatchPolicy's JSONPath naming the filter)."""
    filter_name = f"envoy.filters.http.ext_proc/envoyextensionpolicy/{ns_of(eep)}/{name_of(eep)}/extproc/{i}"
    patched = set()
    for epp in of_kind(objs, "EnvoyPatchPolicy"):
        for patch in (epp.get("spec") or {}).get("jsonPatches") or [] if ns_of(epp) == ns_of(eep) else []:
            op = patch.get("operation") or {}
            where = f"{op.get('jsonPath', '')}{op.get('path', '')}"
            values = op.get("value") if isinstance(op.get("value"), list) else []
            if patch.get("type", "").endswith(".Listener") and op.get("op") == "add" \
                    and f"'{filter_name}'" in where and where.endswith("retry_policy/retry_host_predicate") \
                    and any(isinstance(v, dict) and v.get("name") == PREVIOUS_HOSTS for v in values):
                patched.add(patch.get("name"))
    missing = [name for name in _listeners_of(objs, eep) if name not in patched]
    if not missing:
        return []
    return [f"{describe(eep)}: spec.extProc[{i}].backendSettings.retry: no EnvoyPatchPolicy adds "
            f"the {PREVIOUS_HOSTS} retry host predicate to filter {filter_name}'s "
            f"grpc_service.retry_policy on listener(s) {', '.join(missing)}: at a takeover, with "
            f"no replica healthy yet, every retry of a stream can pick the replica that just died "
            f"(base/gateway/picker-health-check.yaml)"]


def picker_failover_visible(objs) -> list[str]:
    """More than one replica with --leader-election: linked replicas, and a gateway that reaches
    and health-checks every one of them (see the module docstring)."""
    problems = []
    for d, c in _pickers(objs):
        args = argv(c)
        replicas = (d.get("spec") or {}).get("replicas", 1)
        if not leader_election_on(args) or not isinstance(replicas, int) or replicas < 2:
            continue
        labels = (((d.get("spec") or {}).get("template") or {}).get("metadata") or {}).get(
            "labels") or {}
        where = describe(d)
        problems += _link_problems(objs, where, d, args, labels)
        problems += _envoy_problems(objs, where, d, args, labels, replicas)
    return problems


PICKER_HA_CHECKS = [picker_replicas_route_as_one, picker_leader_election_works,
                    picker_failover_visible]
