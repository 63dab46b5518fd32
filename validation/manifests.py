"""One model of the rendered manifests, for every reader in the repo: the policy rules
(validation/policy.py), the local stack's topology (local/stack.py) and the gateway checks.

Objects are the dicts kustomize renders (validation.render). Queries: objects by kind, pod
templates (Deployments, LeaderWorkerSets' leader and worker), container flags in both spellings
(`--flag v` and `--flag=v`), served model names, routes per listener, label selectors.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from validation.problems import describe

GPU = "nvidia.com/gpu"
GATEWAY_GROUPS = ("gateway.networking.k8s.io", "gateway.envoyproxy.io")  # what Envoy Gateway reads


def of_kind(objs, kind):
    return [o for o in objs if o.get("kind") == kind]


def group_of(obj: dict) -> str:
    """The API group of an object ("" for the core group)."""
    api = obj.get("apiVersion", "")
    return api.split("/")[0] if "/" in api else ""


def gateway_objects(objs: list[dict]) -> list[dict]:
    """The objects Envoy Gateway reads: Gateway API and Envoy Gateway kinds."""
    return [o for o in objs if group_of(o) in GATEWAY_GROUPS]


def ns_of(obj, default="default"):
    return (obj.get("metadata") or {}).get("namespace") or default


def name_of(obj):
    return (obj.get("metadata") or {}).get("name", "")


@dataclass
class PodTemplate:
    owner: dict
    role: str            # "" for Deployments etc., "leader"/"worker" for LeaderWorkerSets
    path: str            # field path of the template
    template: dict

    @property
    def labels(self):
        return (self.template.get("metadata") or {}).get("labels") or {}

    @property
    def spec(self):
        return self.template.get("spec") or {}

    @property
    def where(self):
        return f"{describe(self.owner)} {self.path}"

    def containers(self):
        for field in ("initContainers", "containers"):
            for i, c in enumerate(self.spec.get(field) or []):
                yield f"{self.path}.spec.{field}[{i}]", c


def pod_templates(objs):
    for obj in objs:
        kind, spec = obj.get("kind"), obj.get("spec") or {}
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job") and spec.get("template"):
            yield PodTemplate(obj, "", "spec.template", spec["template"])
        elif kind == "CronJob":
            t = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template")
            if t:
                yield PodTemplate(obj, "", "spec.jobTemplate.spec.template", t)
        elif kind == "LeaderWorkerSet":
            lwt = spec.get("leaderWorkerTemplate") or {}
            worker = lwt.get("workerTemplate") or {}
            leader = lwt.get("leaderTemplate") or worker
            path = "leaderTemplate" if lwt.get("leaderTemplate") else "workerTemplate"
            yield PodTemplate(obj, "leader", f"spec.leaderWorkerTemplate.{path}", leader)
            yield PodTemplate(obj, "worker", "spec.leaderWorkerTemplate.workerTemplate", worker)


def argv(container) -> list[str]:
    return [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]


def flag_values(args: list[str], flag: str) -> list[str] | None:
    """Values of `--flag v1 v2` / `--flag=v` in an argument list; None if the flag is absent."""
    for i, a in enumerate(args):
        if a == flag:
            values = []
            for v in args[i + 1:]:
                if v.startswith("--"):
                    break
                values.append(v)
            return values
        if a.startswith(flag + "="):
            return [a.split("=", 1)[1]]
    return None


def has_flag(args, flag):
    return flag in args or any(a.startswith(flag + "=") for a in args)


def vllm_container(t: PodTemplate):
    """(path, container) of the container running `vllm serve`, or (None, None)."""
    for path, c in t.containers():
        args = argv(c)
        if "vllm" in args and "serve" in args:
            return path, c
    return None, None


def matches(selector: dict, labels: dict) -> bool:
    """Kubernetes equality-based selection: every key of a non-empty selector has that label value
    (an empty selector selects nothing here, as a Service without selector gets no endpoints)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def gpu_limit(container) -> int | None:
    value = ((container.get("resources") or {}).get("limits") or {}).get(GPU)
    return int(value) if value is not None else None


def gateway_listeners(objs, gateway_name) -> list[dict]:
    """spec.listeners of the Gateway named `gateway_name` (none without such a Gateway)."""
    return [listener for gw in of_kind(objs, "Gateway") if name_of(gw) == gateway_name
            for listener in (gw.get("spec") or {}).get("listeners") or []]


def listener_port(objs, gateway_name, section):
    return next((listener.get("port") for listener in gateway_listeners(objs, gateway_name)
                 if listener.get("name") == section), None)


def routes_on_port(objs, port):
    out = []
    for route in of_kind(objs, "HTTPRoute"):
        for parent in (route.get("spec") or {}).get("parentRefs") or []:
            if listener_port(objs, parent.get("name"), parent.get("sectionName")) == port:
                out.append(route)
    return out


def picker_container(objs):
    """(deployment, container) running `python -m picker`."""
    for t in pod_templates(objs):
        for _, c in t.containers():
            args = argv(c)
            if "-m" in args and "picker" in args:
                return t.owner, c
    return None, None


def services_selecting(objs, labels, namespace):
    return [s for s in of_kind(objs, "Service")
            if ns_of(s) == namespace and matches((s.get("spec") or {}).get("selector") or {}, labels)]


def served_model_names(objs) -> dict[str, list[str]]:
    """LWS name -> --served-model-name values of its leader."""
    out = {}
    for t in pod_templates(objs):
        if t.role == "leader":
            _, c = vllm_container(t)
            if c is not None:
                out[name_of(t.owner)] = flag_values(argv(c), "--served-model-name") or []
    return out


def routes_on_listener(objs, section: str, gateway: str | None = None) -> list[dict]:
    """HTTPRoutes attached to the listener named `section` (parentRefs[].sectionName), of the
    Gateway named `gateway` when given."""
    return [r for r in of_kind(objs, "HTTPRoute")
            if any(p.get("sectionName") == section and gateway in (None, p.get("name"))
                   for p in (r.get("spec") or {}).get("parentRefs") or [])]


def spec_rules(obj: dict) -> list[dict]:
    """spec.rules of an HTTPRoute or an InferenceModelRewrite."""
    return (obj.get("spec") or {}).get("rules") or []


def rule_backend_refs(route: dict) -> list[tuple[str, list[dict]]]:
    """(`spec.rules[i].backendRefs`, that rule's backendRefs) for each rule of an HTTPRoute."""
    return [(f"spec.rules[{i}].backendRefs", rule.get("backendRefs") or []) for i, rule in enumerate(spec_rules(route))]


def backend_refs(route: dict) -> list[dict]:
    """Every backendRef of an HTTPRoute, rule after rule."""
    return [ref for _, refs in rule_backend_refs(route) for ref in refs]


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")


def seconds(text) -> float | None:
    """A Gateway API / Envoy duration ('10s', '1h', '250ms', '3600s') in seconds."""
    if text is None:
        return None
    m = _DURATION.match(str(text))
    if not m:
        return None
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]
