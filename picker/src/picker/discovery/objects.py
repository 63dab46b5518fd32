"""InferenceObjective and InferenceModelRewrite (llm-d.ai/v1alpha2) from YAML or API dicts.

Errors name the file, the object and the field. Other kinds are ignored, so the rendered
`kubectl kustomize base/inference` output can be fed in whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

GROUP = "llm-d.ai"
OBJECTIVE_KIND = "InferenceObjective"
REWRITE_KIND = "InferenceModelRewrite"


@dataclass(frozen=True, slots=True)
class Objective:
    name: str
    priority: int = 0
    pool: str | None = None


@dataclass(frozen=True, slots=True)
class RewriteRule:
    models: tuple[str, ...]                 # exact-match model names; empty = matches any model
    targets: tuple[tuple[str, float], ...]  # (modelRewrite, weight)


@dataclass(frozen=True, slots=True)
class Rewrite:
    name: str
    rules: tuple[RewriteRule, ...]
    pool: str | None = None
    created: str = ""  # creationTimestamp (RFC 3339 sorts as text); oldest wins


class ObjectError(ValueError):
    pass


def _is_kind(doc: Any, kind: str) -> bool:
    return (isinstance(doc, dict) and doc.get("kind") == kind
            and str(doc.get("apiVersion", "")).startswith(GROUP + "/"))


def _where(doc: dict[str, Any], source: str) -> str:
    name = (doc.get("metadata") or {}).get("name", "<unnamed>")
    return f"{source}: {doc.get('kind')} {name!r}"


def _pool(spec: dict[str, Any], where: str) -> str | None:
    ref = spec.get("poolRef")
    if ref is None:
        return None
    if not isinstance(ref, dict) or not isinstance(ref.get("name"), str):
        raise ObjectError(f"{where}: spec.poolRef.name must be a string")
    return ref["name"]


def _name(doc: dict[str, Any], where: str) -> str:
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str):
        raise ObjectError(f"{where}: metadata.name is required")
    return name


def parse_objective(doc: dict[str, Any], source: str = "<api>") -> Objective:
    where = _where(doc, source)
    name = _name(doc, where)
    spec = doc.get("spec") or {}
    if not isinstance(spec, dict):
        raise ObjectError(f"{where}: spec must be a mapping")
    priority = spec.get("priority", 0)
    if priority is None:
        priority = 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ObjectError(f"{where}: spec.priority must be an integer, got {priority!r}")
    return Objective(name, priority, _pool(spec, where))


def parse_rewrite(doc: dict[str, Any], source: str = "<api>") -> Rewrite:
    where = _where(doc, source)
    name = _name(doc, where)
    spec = doc.get("spec") or {}
    rules_in = spec.get("rules") if isinstance(spec, dict) else None
    if not isinstance(rules_in, list) or not rules_in:
        raise ObjectError(f"{where}: spec.rules must be a non-empty list")
    rules = []
    for i, rule in enumerate(rules_in):
        field = f"spec.rules[{i}]"
        if not isinstance(rule, dict):
            raise ObjectError(f"{where}: {field} must be a mapping")
        models = []
        for j, match in enumerate(rule.get("matches") or []):
            model = match.get("model") if isinstance(match, dict) else None
            value = model.get("value") if isinstance(model, dict) else None
            mtype = model.get("type", "Exact") if isinstance(model, dict) else None
            if not isinstance(value, str) or mtype != "Exact":
                raise ObjectError(f"{where}: {field}.matches[{j}].model needs type Exact "
                                  f"and a string value")
            models.append(value)
        targets = []
        raw_targets = rule.get("targets")
        if not isinstance(raw_targets, list) or not raw_targets:
            raise ObjectError(f"{where}: {field}.targets must be a non-empty list")
        weights_given = [isinstance(t, dict) and "weight" in t for t in raw_targets]
        if any(weights_given) and not all(weights_given):
            raise ObjectError(f"{where}: {field}.targets: set weight on all targets or none")
        for k, t in enumerate(raw_targets):
            tf = f"{field}.targets[{k}]"
            if not isinstance(t, dict) or not isinstance(t.get("modelRewrite"), str):
                raise ObjectError(f"{where}: {tf}.modelRewrite must be a string")
            weight = t.get("weight", 1)
            if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= 1_000_000:
                raise ObjectError(f"{where}: {tf}.weight must be an integer 1..1000000")
            targets.append((t["modelRewrite"], float(weight)))
        rules.append(RewriteRule(tuple(models), tuple(targets)))
    return Rewrite(name, tuple(rules), _pool(spec, where),
                   str((doc.get("metadata") or {}).get("creationTimestamp") or ""))


def objects_from_docs(docs: Iterable[Any], source: str) -> tuple[list[Objective], list[Rewrite]]:
    objectives, rewrites = [], []
    for doc in docs:
        if _is_kind(doc, OBJECTIVE_KIND):
            objectives.append(parse_objective(doc, source))
        elif _is_kind(doc, REWRITE_KIND):
            rewrites.append(parse_rewrite(doc, source))
    return objectives, rewrites


def _files(paths: Iterable[str | Path]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.suffix in (".yaml", ".yml")))
        elif p.is_file():
            out.append(p)
        else:
            raise ObjectError(f"{p}: no such file or directory")
    return out


def load_objects(paths: Iterable[str | Path]) -> tuple[list[Objective], list[Rewrite]]:
    """Objectives and rewrites from YAML files or directories (multi-document, other kinds ignored)."""
    objectives: list[Objective] = []
    rewrites: list[Rewrite] = []
    for f in _files(paths):
        try:
            docs = list(yaml.safe_load_all(f.read_text()))
        except yaml.YAMLError as exc:
            raise ObjectError(f"{f}: invalid YAML: {exc}") from None
        flat = []
        for doc in docs:  # a kind: List wraps items
            if isinstance(doc, dict) and doc.get("kind") == "List":
                flat.extend(doc.get("items") or [])
            else:
                flat.append(doc)
        o, r = objects_from_docs(flat, str(f))
        objectives += o
        rewrites += r
    return objectives, rewrites
