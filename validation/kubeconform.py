"""Run the pinned kubeconform offline over the rendered output, against local schema files."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from validation.problems import Problem

BUILTIN_TEMPLATE = "{{.ResourceKind}}{{.KindSuffix}}.json"
CRD_TEMPLATE = "{{.Group}}/{{.ResourceKind}}_{{.ResourceAPIVersion}}.json"


def kind_suffix(api_version: str) -> str:
    """kubeconform's {{.KindSuffix}}: `-v1`, `-apps-v1`, `-rbac-v1` (pkg/registry/registry.go)."""
    parts = api_version.split("/")
    suffix = "-" + parts[0].split(".")[0].lower()
    if len(parts) > 1:
        suffix += "-" + parts[1].lower()
    return suffix


def _write_if_changed(path: Path, text: str) -> None:
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_schemas(schema_root: Path, objects: list, builtin, crds) -> None:
    """Local schema tree for the kinds in `objects`: built-in kinds and converted CRDs."""
    builtin_dir, crd_dir = schema_root / "builtin", schema_root / "crds"
    done = set()
    for obj in objects:
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        if not isinstance(api_version, str) or not isinstance(kind, str) or (api_version, kind) in done:
            continue
        done.add((api_version, kind))
        definition = builtin.definition_for(api_version, kind)
        if definition:
            target = builtin_dir / f"{kind.lower()}{kind_suffix(api_version)}.json"
            if not target.is_file():
                _write_if_changed(target, json.dumps(builtin.standalone(definition)))
        elif crds.has(api_version, kind):
            group, _, version = api_version.rpartition("/")
            target = crd_dir / group / f"{kind.lower()}_{version}.json"
            source = crds.kubeconform_file(api_version, kind)
            if not target.is_file() or target.stat().st_size != source.stat().st_size \
                    or target.read_bytes() != source.read_bytes():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)


_AT_PATH = re.compile(r"- at '([^']*)': ")


def _split_message(msg: str) -> list[tuple[str, str]]:
    """kubeconform puts schema-compiled errors only into `msg`:
    "... - at '/spec': validation failed   - at '/spec/replicas': got string, want null or integer"
    -> [("spec.replicas", "got string, want null or integer")]."""
    parts = _AT_PATH.split(msg)
    if len(parts) < 3:
        return [("", msg)]
    found = [(path.strip("/").replace("/", "."), text.strip())
             for path, text in zip(parts[1::2], parts[2::2])]
    return [(p, t) for p, t in found if t != "validation failed"] or [("", msg)]


def run(kubeconform: Path, files: dict[Path, str], schema_root: Path, k8s_version: str,
        names: dict | None = None) -> list[Problem]:
    """kubeconform -strict over `files` (path -> render target); its findings as Problems.
    `names` maps (target, kind, name) to "Kind namespace/name" (kubeconform omits the namespace)."""
    names = names or {}
    if not files:
        return []
    if not kubeconform.is_file():
        return [Problem("kubeconform", f"{kubeconform} not found (run `make tools`)", source="kubeconform")]
    cmd = [str(kubeconform), "-strict", "-summary", "-output", "json",
           "-kubernetes-version", k8s_version,
           "-schema-location", str(schema_root / "builtin" / BUILTIN_TEMPLATE),
           "-schema-location", str(schema_root / "crds" / CRD_TEMPLATE),
           *map(str, files)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return [Problem("kubeconform", f"exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}",
                        source="kubeconform")]
    problems = []
    by_name = {str(p): t for p, t in files.items()}
    for res in report.get("resources", []):
        if res.get("status") in ("statusValid", "statusSkipped", "statusEmpty"):
            continue
        target = by_name.get(res.get("filename"), res.get("filename", "?"))
        obj = names.get((target, res.get("kind"), res.get("name")), f"{res.get('kind', '?')} {res.get('name', '?')}")
        errors = [e for e in res.get("validationErrors") or [] if e.get("path") or e.get("msg") != "validation failed"]
        if not errors:
            for path, msg in _split_message(res.get("msg") or str(res.get("status"))):
                problems.append(Problem(target, msg, obj, path, source="kubeconform"))
        for err in errors:
            path = err.get("path", "").strip("/").replace("/", ".")
            problems.append(Problem(target, err.get("msg", ""), obj, path, source="kubeconform"))
    if proc.returncode != 0 and not problems:
        problems.append(Problem("kubeconform", f"exit {proc.returncode}: {proc.stderr.strip()}",
                                source="kubeconform"))
    return problems
