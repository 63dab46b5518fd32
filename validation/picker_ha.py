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
"""
from __future__ import annotations

from validation.manifests import argv, flag_values, name_of, ns_of, of_kind, pod_templates
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


PICKER_HA_CHECKS = [picker_replicas_route_as_one, picker_leader_election_works]
