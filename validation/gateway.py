"""Envoy Gateway's own verdict on every render target that holds gateway objects.

`egctl x translate` (Envoy Gateway's translator, the same version the cluster runs, built by
`make tools`) reads the rendered Gateway API and Envoy Gateway objects, offline, and returns them
with the statuses Envoy Gateway would write, plus the xDS it would send Envoy. Two kinds of rule:

- statuses: every GatewayClass, Gateway, listener, route and policy has a status, and its
  `Accepted`, `ResolvedRefs` and `Programmed` conditions are True (a policy without status is
  attached to nothing: Envoy Gateway silently applies it nowhere);
- xDS: what the design needs is really in the generated Envoy config (`xds_problems`).
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import yaml

from validation.edge import placeholder_secrets
from validation.manifests import GATEWAY_GROUPS, gateway_objects, group_of, seconds  # noqa: F401 (seconds: part of this API)
from validation.problems import Problem, describe

CHECKED_CONDITIONS = ("Accepted", "ResolvedRefs", "Programmed")
POLICY_KINDS = ("ClientTrafficPolicy", "BackendTrafficPolicy", "EnvoyExtensionPolicy", "SecurityPolicy",
                "EnvoyPatchPolicy")
# Off-cluster the translator cannot see Services' endpoints; egctl adds placeholder Services and
# endpoints for what the objects reference (--add-missing-resources), so routes resolve as they
# would in a cluster where the Services exist. Those placeholders are not ours to check.
_SOURCE = "envoy-gateway"


def has_gateway(objs: list[dict]) -> bool:
    return any(o.get("kind") == "Gateway" for o in gateway_objects(objs))


CLUSTER_SCOPED = ("GatewayClass",)


def translator_input(objs: list[dict]) -> list[dict]:
    """Gateway objects plus the core objects they may reference (Services, Secrets, ConfigMaps),
    in the namespace `kubectl apply` would put them in (default) when the render names none."""
    core = [o for o in objs if group_of(o) == "" and o.get("kind") in ("Service", "Secret", "ConfigMap")]
    out = []
    for o in gateway_objects(objs) + core:
        if o.get("kind") not in CLUSTER_SCOPED and not (o.get("metadata") or {}).get("namespace"):
            o = {**o, "metadata": {**(o.get("metadata") or {}), "namespace": "default"}}
        out.append(o)
    return out


class TranslateError(RuntimeError):
    pass


def translate(egctl: Path, objs: list[dict], placeholders: bool = True) -> tuple[list[dict], dict]:
    """(objects with statuses, xDS config dumps per Gateway) from one `egctl x translate` run.
    placeholders=False: the Secrets nobody created stay missing, as in a cluster before the first
    deploy step."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        # + stand-ins for the Secrets the objects reference but the repo never holds (edge.py)
        extra = placeholder_secrets(objs) if placeholders else []
        f.write(yaml.safe_dump_all(translator_input(objs) + extra, sort_keys=False))
        path = f.name
    try:
        cmd = [str(egctl), "x", "translate", "--from", "gateway-api", "--to", "gateway-api,xds", "--type", "all",
               "--file", path, "--add-missing-resources", "--output", "yaml"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        Path(path).unlink(missing_ok=True)
    if proc.returncode != 0:
        raise TranslateError(f"egctl x translate failed: {proc.stderr.strip()[-3000:]}")
    out = yaml.load(proc.stdout, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    xds = out.pop("xds", {}) or {}
    return _flatten(out), {"configs": [c for dump in xds.values() for c in dump.get("configs", [])]}


def _flatten(resources: dict) -> list[dict]:
    """egctl prints the resources grouped by kind (a list, or one object); return plain objects."""
    out = []
    for value in resources.values():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, dict) and "kind" in v:
                out.append(v)
    return out


def _bad_conditions(conditions: list[dict]) -> list[dict]:
    return [c for c in conditions or [] if c.get("type") in CHECKED_CONDITIONS and c.get("status") != "True"]


def _condition_text(c: dict) -> str:
    return f"{c.get('type')}={c.get('status')} ({c.get('reason')}: {c.get('message', '').strip()})"


def status_problems(target: str, translated: list[dict], ours: set[tuple[str, str, str]]) -> list[Problem]:
    """Problems in the statuses of the objects of `ours` ((kind, namespace, name) of the render)."""
    problems = []

    def add(obj, message, field):
        problems.append(Problem(target, message, describe(obj), field, source=_SOURCE))

    def add_bad_refs(obj, entries: list[dict], ref_key: str, what: str, field: str):
        """The bad conditions of each status.parents / status.ancestors entry, named by its ref."""
        for i, entry in enumerate(entries):
            ref = entry.get(ref_key) or {}
            for c in _bad_conditions(entry.get("conditions")):
                add(obj, f"{what} {ref.get('name')}/{ref.get('sectionName', '*')}: {_condition_text(c)}",
                    f"{field}[{i}]")

    seen = set()
    for obj in translated:
        meta = obj.get("metadata") or {}
        key = (obj.get("kind"), meta.get("namespace", ""), meta.get("name"))
        if key not in ours:
            continue
        seen.add(key)
        kind, status = obj["kind"], obj.get("status") or {}
        if kind in ("GatewayClass", "Gateway", "Backend"):
            # offline, a Gateway's own conditions wait for an address; its listeners carry the verdict
            if not status.get("conditions") and not (kind == "Gateway" and status.get("listeners")):
                add(obj, "Envoy Gateway gave it no status", "status")
            for c in _bad_conditions(status.get("conditions")):
                add(obj, _condition_text(c), "status.conditions")
        if kind == "Gateway":
            declared = {listener["name"] for listener in obj["spec"].get("listeners", [])}
            reported = {listener.get("name") for listener in status.get("listeners") or []}
            for name in sorted(declared - reported):
                add(obj, f"listener {name}: Envoy Gateway gave it no status", "spec.listeners")
            for i, listener in enumerate(status.get("listeners") or []):
                for c in _bad_conditions(listener.get("conditions")):
                    add(obj, f"listener {listener.get('name')}: {_condition_text(c)}", f"status.listeners[{i}]")
        if kind.endswith("Route"):
            parents = status.get("parents") or []
            if not parents:
                add(obj, "Envoy Gateway gave it no status: it is attached to no Gateway listener", "status.parents")
            add_bad_refs(obj, parents, "parentRef", "parent", "status.parents")
        if kind in POLICY_KINDS:
            ancestors = status.get("ancestors") or []
            if not ancestors:
                add(obj, "Envoy Gateway gave it no status: its targetRefs match nothing, so it applies to nothing",
                    "spec.targetRefs")
            add_bad_refs(obj, ancestors, "ancestorRef", "ancestor", "status.ancestors")
    for kind, ns, name in sorted(ours - seen):
        problems.append(Problem(target, "missing from Envoy Gateway's output (not accepted as input)",
                                f"{kind} {ns + '/' if ns else ''}{name}", source=_SOURCE))
    return problems


def object_keys(objs: list[dict]) -> set[tuple[str, str, str]]:
    keys = set()
    for o in translator_input(objs):
        if group_of(o) not in GATEWAY_GROUPS:
            continue
        meta = o.get("metadata") or {}
        namespace = "" if o.get("kind") in CLUSTER_SCOPED else meta["namespace"]
        keys.add((o.get("kind"), namespace, meta.get("name")))
    return keys


def check_target(egctl: Path, target: str, objs: list[dict]) -> list[Problem]:
    """Every rule of this module for one render target."""
    try:
        translated, xds = translate(egctl, objs)
    except TranslateError as err:
        return [Problem(target, str(err), source=_SOURCE)]
    problems = status_problems(target, translated, object_keys(objs))
    from validation.gateway_xds import xds_problems

    problems += xds_problems(target, objs, xds)
    return problems


def check_all(egctl: Path, rendered) -> list[Problem]:
    """check_target for every render target holding a Gateway; identical inputs translated once."""
    from concurrent.futures import ThreadPoolExecutor

    seen: dict[str, list] = {}
    for r in rendered:
        if r.objects and has_gateway(r.objects):
            key = yaml.safe_dump_all(translator_input(r.objects), sort_keys=True)
            seen.setdefault(key, []).append(r)
    todo = list(seen.values())
    if todo and not egctl.is_file():
        return [Problem(str(egctl), "egctl is missing: `make tools` builds Envoy Gateway's translator",
                        source=_SOURCE)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda g: (g, check_target(egctl, g[0].target, g[0].objects)), todo))
    problems = []
    for group, found in results:
        for r in group:  # the same finding for every target that rendered the same objects
            problems += [Problem(r.target, p.message, p.obj, p.path, source=p.source) for p in found]
    return problems
