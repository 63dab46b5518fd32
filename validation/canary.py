"""The canary split file, checked before kustomize copies its numbers into both ports' weights.

`components/canary/split.yaml` holds the only two numbers a user edits to move canary traffic.
Kustomize's replacements copy them verbatim: a string weight makes kustomize fail with a YAML
decode error that names no file, and a quoted "10" is copied as a string. So every render of a
kustomization that includes the canary component checks the file first and reports one problem
per bad field, naming the file and the field.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from validation.problems import Problem

COMPONENT = "components/canary"
SPLIT_FILE = f"{COMPONENT}/split.yaml"
FIELDS = ("stableWeight", "canaryWeight")
# InferenceModelRewrite targets[].weight bounds (llm-d-router v0.10.0 CRD); HTTPRoute allows 0,
# but the rewrite, the other port, does not.
MIN_WEIGHT, MAX_WEIGHT = 1, 1_000_000


def _kustomization(directory: Path) -> dict:
    for name in ("kustomization.yaml", "kustomization.yml"):
        path = directory / name
        if path.is_file():
            try:
                doc = yaml.safe_load(path.read_text())
            except yaml.YAMLError:
                return {}  # kustomize itself reports the syntax error
            return doc if isinstance(doc, dict) else {}
    return {}


def includes_canary(root: Path, target: str) -> bool:
    """Does the kustomization at `target` (through local resources/components) use the component?"""
    root = root.resolve()
    canary = (root / COMPONENT).resolve()
    seen: set[Path] = set()
    todo = [(root / target).resolve()]
    while todo:
        directory = todo.pop()
        if directory == canary:
            return True
        if directory in seen or not directory.is_dir():
            continue
        seen.add(directory)
        doc = _kustomization(directory)
        for entry in (doc.get("resources") or []) + (doc.get("components") or []):
            if isinstance(entry, str) and "://" not in entry:
                todo.append((directory / entry).resolve())
    return False


def split_problems(root: Path) -> list[Problem]:
    """One problem per missing or invalid weight in split.yaml ([] when it is valid)."""
    path = root / SPLIT_FILE
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        return [Problem(SPLIT_FILE, f"cannot read the canary split: {err.strerror}", source="canary")]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark else ""
        return [Problem(SPLIT_FILE, f"invalid YAML{line}: {getattr(err, 'problem', err)}",
                        source="canary")]
    spec = doc.get("spec") if isinstance(doc, dict) else None
    if not isinstance(spec, dict):
        return [Problem(SPLIT_FILE, "no spec with stableWeight and canaryWeight",
                        "CanarySplit qwq", "spec", source="canary")]
    problems = []
    for name in FIELDS:
        value = spec.get(name)
        reason = _weight_error(value)
        if reason:
            problems.append(Problem(SPLIT_FILE, reason, "CanarySplit qwq", f"spec.{name}",
                                    source="canary"))
    return problems


def _weight_error(value) -> str:
    if value is None:
        return f"missing: write a whole number from {MIN_WEIGHT} to {MAX_WEIGHT:,}"
    if isinstance(value, bool) or not isinstance(value, int):
        shown = repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"
        return (f"must be a whole number without quotes (e.g. 80), got {shown}: "
                "kustomize copies it verbatim into the route and rewrite weights")
    if not MIN_WEIGHT <= value <= MAX_WEIGHT:
        return (f"must be from {MIN_WEIGHT} to {MAX_WEIGHT:,}, got {value} "
                "(InferenceModelRewrite weights are >= 1; to end the canary deploy overlays/a10)")
    return ""


def split_weights(root: Path) -> dict[str, int]:
    """{'stableWeight': ..., 'canaryWeight': ...} as written in split.yaml."""
    spec = yaml.safe_load((root / SPLIT_FILE).read_text())["spec"]
    return {name: spec[name] for name in FIELDS}
