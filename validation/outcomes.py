"""The picker's outcome path is wired end to end (picker/README.md "Outcomes"): Envoy's gRPC access
log (an ALS sink of the EnvoyProxy the Gateway runs with) sends every routed request's entry to the
picker's --outcomes-port, and the entry carries what the picker learns from.

With the picker's --outcomes-port on (its default, 9004; 0 is off):
- `outcome_sink_reaches_picker`: the Gateway's EnvoyProxy (spec.infrastructure.parametersRef) has
  an ALS sink of type HTTP whose backendRefs reach the picker Service's port that forwards to
  --outcomes-port (a Backend whose fqdn is that Service and port, with TLS exactly when the picker
  serves it, or that Service and port directly when it does not); the picker container declares the
  port, and a NetworkPolicy that isolates the picker admits it from the Gateway's Envoy pods.
  Conversely an ALS sink to the picker while --outcomes-port is 0 is an error (Envoy would send to
  a closed port).
- `outcome_entries_carry_tokens`: the picker's EnvoyExtensionPolicy (the 8081 route's ext_proc)
  lists the picker's metadata namespace in metadata.writableNamespaces (else Envoy drops the
  request id and features the outcome is matched by) and runs a Lua ConfigMap that writes the token
  counts into the namespace the picker reads (else every outcome comes without tokens).
"""
from __future__ import annotations

from validation.isolation import _named_ports, ingress_rules, is_envoy
from validation.manifests import (argv, flag_values, has_flag, name_of, ns_of, of_kind,
                                  picker_container, pod_templates, routes_on_port)
from validation.policy import picker_ref_problems
from validation.problems import describe

# As picker/src/picker/signals/outcomes.py reads them (tests/policy/test_outcomes.py keeps them equal).
PICKER_NAMESPACE = "llm-serving.picker"
TOKENS_NAMESPACE = "llm-serving.tokens"
TOKEN_KEYS = ("prompt_tokens", "completion_tokens")
DEFAULT_OUTCOMES_PORT = 9004  # picker.defaults.OUTCOMES_PORT


def outcomes_port(container) -> int:
    values = flag_values(argv(container), "--outcomes-port")
    try:
        return int(values[0]) if values else DEFAULT_OUTCOMES_PORT
    except ValueError:
        return DEFAULT_OUTCOMES_PORT  # the picker refuses to start; its own check says why


def als_sinks(proxy: dict):
    """(field path, sink) of every ALS sink of an EnvoyProxy."""
    settings = (((proxy.get("spec") or {}).get("telemetry") or {}).get("accessLog") or {}).get("settings")
    for i, setting in enumerate(settings or []):
        for j, sink in enumerate(setting.get("sinks") or []):
            if sink.get("type") == "ALS":
                yield f"spec.telemetry.accessLog.settings[{i}].sinks[{j}]", sink


def gateway_proxies(objs) -> list[tuple[dict, dict | None]]:
    """(Gateway, the EnvoyProxy its infrastructure.parametersRef names, or None)."""
    out = []
    for gw in of_kind(objs, "Gateway"):
        ref = ((gw.get("spec") or {}).get("infrastructure") or {}).get("parametersRef") or {}
        proxy = next((p for p in of_kind(objs, "EnvoyProxy") if ref.get("kind") == "EnvoyProxy"
                      and name_of(p) == ref.get("name") and ns_of(p) == ns_of(gw)), None)
        out.append((gw, proxy))
    return out


def _picker_service(objs, deployment, target: int):
    """(Service, port) of the Service selecting the picker that forwards to container port target."""
    t = next(t for t in pod_templates(objs) if t.owner is deployment)
    named = _named_ports(t)
    for svc in of_kind(objs, "Service"):
        selector = (svc.get("spec") or {}).get("selector") or {}
        if ns_of(svc) != ns_of(deployment) or not selector or \
                any(t.labels.get(k) != v for k, v in selector.items()):
            continue
        for p in (svc.get("spec") or {}).get("ports") or []:
            tp = p.get("targetPort", p.get("port"))
            if (named.get(tp) if isinstance(tp, str) else tp) == target:
                return svc, p.get("port")
    return None, None


def _network_problems(objs, deployment, port: int) -> list[str]:
    t = next(t for t in pod_templates(objs) if t.owner is deployment)
    rules = ingress_rules(objs, ns_of(deployment), t.labels, _named_ports(t))
    if rules is None:
        return []  # not isolated: Envoy reaches it (isolation rules are checked elsewhere)
    if any(r.admits(port) and r.peers and any(is_envoy(p) for p in r.peers) for r in rules):
        return []
    policies = sorted({describe(r.policy) for r in rules})
    return [f"{', '.join(policies)}: spec.ingress: no rule admits the Gateway's Envoy pods to the "
            f"picker's outcome port {port} (--outcomes-port); Envoy's access log could not reach it"]


def outcome_sink_reaches_picker(objs) -> list[str]:
    deployment, container = picker_container(objs)
    if deployment is None:
        return []
    port = outcomes_port(container)
    secure = not has_flag(argv(container), "--no-secure-serving")
    proxies = gateway_proxies(objs)
    if not port:
        return [f"{describe(proxy)}: {path}.als.backendRefs: sends Envoy's access log to the picker, "
                f"whose --outcomes-port is 0 (off)" for _, proxy in proxies if proxy is not None
                for path, sink in als_sinks(proxy)
                if any(_names_picker(objs, deployment, r)
                       for r in (sink.get("als") or {}).get("backendRefs") or [])]
    problems = []
    declared = {p.get("containerPort") for p in container.get("ports") or []}
    if port not in declared:
        problems.append(f"{describe(deployment)}: container {container.get('name')}: ports: no "
                        f"containerPort {port} (--outcomes-port)")
    svc, svc_port = _picker_service(objs, deployment, port)
    if svc is None:
        return problems + [f"{describe(deployment)}: no Service forwards to the picker's "
                           f"--outcomes-port {port}"]
    for gw, proxy in proxies:
        if proxy is None:
            problems.append(f"{describe(gw)}: spec.infrastructure.parametersRef: names no EnvoyProxy, "
                            f"so Envoy never sends the picker its access log (--outcomes-port {port})")
            continue
        sinks = [(path, sink) for path, sink in als_sinks(proxy)
                 if (sink.get("als") or {}).get("type", "HTTP") == "HTTP"]
        if not sinks:
            problems.append(f"{describe(proxy)}: spec.telemetry.accessLog: no ALS sink of type HTTP "
                            f"to the picker's outcome port {name_of(svc)}:{svc_port}")
        for path, sink in sinks:
            refs = (sink.get("als") or {}).get("backendRefs") or []
            for i, ref in enumerate(refs):
                problems += picker_ref_problems(objs, ref, f"{describe(proxy)}: {path}.als.backendRefs[{i}]",
                                                svc, svc_port, secure, "the picker's outcome port",
                                                " (--outcomes-port)")
    return problems + _network_problems(objs, deployment, port)


def _names_picker(objs, deployment, ref: dict) -> bool:
    """A backendRef to a Service that selects the picker, or to a Backend whose fqdn is one."""
    t = next(t for t in pod_templates(objs) if t.owner is deployment)
    names = {name_of(s) for s in of_kind(objs, "Service") if ns_of(s) == ns_of(deployment)
             and (sel := (s.get("spec") or {}).get("selector") or {})
             and all(t.labels.get(k) == v for k, v in sel.items())}
    if ref.get("kind", "Service") == "Service":
        return ref.get("name") in names
    fqdns = {f"{n}.{ns_of(deployment)}.svc.cluster.local" for n in names}
    return any(((ep.get("fqdn") or {}).get("hostname") or "").rstrip(".") in fqdns
               for b in of_kind(objs, "Backend") if name_of(b) == ref.get("name")
               for ep in (b.get("spec") or {}).get("endpoints") or [])


def outcome_entries_carry_tokens(objs) -> list[str]:
    deployment, container = picker_container(objs)
    if deployment is None or not outcomes_port(container):
        return []
    routes = {name_of(r) for r in routes_on_port(objs, 8081)}
    policies = [p for p in of_kind(objs, "EnvoyExtensionPolicy") if (p.get("spec") or {}).get("extProc")
                and {r.get("name") for r in (p.get("spec") or {}).get("targetRefs") or []} & routes]
    scripts = {name_of(c): (c.get("data") or {}).get("lua") or "" for c in of_kind(objs, "ConfigMap")}
    problems = []
    for eep in policies:
        spec = eep["spec"]
        for i, ext in enumerate(spec.get("extProc") or []):
            writable = (ext.get("metadata") or {}).get("writableNamespaces") or []
            if PICKER_NAMESPACE not in writable:
                problems.append(f"{describe(eep)}: spec.extProc[{i}].metadata.writableNamespaces: must "
                                f"include {PICKER_NAMESPACE} (the picker's request id and features, "
                                f"brought back with each outcome)")
        lua = [((item.get("valueRef") or {}).get("name"), i) for i, item in enumerate(spec.get("lua") or [])
               if item.get("type") == "ValueRef"]
        writes = [name for name, _ in lua if name in scripts and TOKENS_NAMESPACE in scripts[name]
                  and all(f'"{key}"' in scripts[name] for key in TOKEN_KEYS)]
        if not writes:
            problems.append(f"{describe(eep)}: spec.lua: no ConfigMap script writes {', '.join(TOKEN_KEYS)} "
                            f"into {TOKENS_NAMESPACE} (base/gateway's token-accounting), so the picker's "
                            f"outcomes come without token counts")
    return problems


OUTCOME_CHECKS = [outcome_sink_reaches_picker, outcome_entries_carry_tokens]
